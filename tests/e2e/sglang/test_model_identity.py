"""The SGLang backend keys its namespace on the weights' identity, not the model's
name: two deployments of different weights under one local path never share KV
(SGLang issue 24758 is this bug in another backend); the same weights do."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("sglang.srt.mem_cache.hicache_storage", reason="runs in .venv-sglang")

from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang_pools import mha_pool
from support import write_model_dir

from kvsvc.integrations.identity import weights_identity
from kvsvc.integrations.sglang.storage import KvsvcHiCacheStorage


@pytest.fixture(autouse=True)
def fresh() -> Iterator[None]:
    weights_identity.cache_clear()
    yield
    weights_identity.cache_clear()


def namespace(model: str, **extra: str) -> str:
    """The namespace a backend of ``model`` uses (no server needed: it is fixed when
    the host pool is registered)."""
    weights_identity.cache_clear()
    config = HiCacheStorageConfig(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=False,
        is_page_first_layout=True,
        model_name=model,
        extra_config={"target": "127.0.0.1:1", "interface_v1": 1, **extra},
    )
    backend = KvsvcHiCacheStorage(config, {})
    try:
        backend.register_mem_pool_host(mha_pool("page_first"))
        return str(backend.namespace)
    finally:
        backend.close()


def test_other_weights_under_one_path_get_another_namespace(tmp_path: Path) -> None:
    model = write_model_dir(tmp_path / "model", b"\x01" * 256)
    first = namespace(model)
    assert namespace(model) == first, "the same weights must share"
    write_model_dir(tmp_path / "model", b"\x02" * 512)  # a fine-tune deployed over the path
    assert namespace(model) != first


def test_an_operator_set_identity_decides(tmp_path: Path) -> None:
    model = write_model_dir(tmp_path / "model", b"\x01" * 256)
    first = namespace(model, model_identity="release-7")
    write_model_dir(tmp_path / "model", b"\x01" * 300)
    assert namespace(model, model_identity="release-7") == first
    assert namespace(model, model_identity="release-8") != first
