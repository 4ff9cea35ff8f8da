"""Both vLLM plug-ins key their namespace on the weights' identity, not the model's
name: two deployments of different weights under one local path never share KV
(SGLang issue 24758 is this bug in another backend); the same weights do."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering", reason="the vLLM tests run in .venv-vllm")

from direct import KV_CACHE_CONFIG, vllm_config
from support import write_model_dir
from tiering import offload_config
from vllm.v1.kv_offload.config import OffloadingModelConfig

from kvsvc.integrations.identity import weights_identity
from kvsvc.integrations.vllm.common import deployment_namespace, offload_namespace
from kvsvc.integrations.vllm.config import VllmConnectorConfig


@pytest.fixture(autouse=True)
def fresh() -> Iterator[None]:
    weights_identity.cache_clear()
    yield
    weights_identity.cache_clear()


def connector_ns(model: str, **extra: str) -> str:
    weights_identity.cache_clear()
    cfg = VllmConnectorConfig.parse(extra)
    return deployment_namespace(vllm_config(1, model=model), KV_CACHE_CONFIG, cfg)


def tier_ns(model: str, **extra: str) -> str:
    weights_identity.cache_clear()
    config = dataclasses.replace(
        offload_config("e", {}), model=OffloadingModelConfig(name=model, dtype="bfloat16")
    )
    return offload_namespace(config, 4096, VllmConnectorConfig.parse(extra))


@pytest.mark.parametrize("namespace_of", [connector_ns, tier_ns], ids=["connector", "tier"])
def test_other_weights_under_one_path_get_another_namespace(tmp_path: Path, namespace_of) -> None:  # type: ignore[no-untyped-def]
    model = write_model_dir(tmp_path / "model", b"\x01" * 256)
    first = namespace_of(model)
    assert namespace_of(model) == first, "the same weights must share"
    write_model_dir(tmp_path / "model", b"\x02" * 512)  # a fine-tune deployed over the path
    assert namespace_of(model) != first


@pytest.mark.parametrize("namespace_of", [connector_ns, tier_ns], ids=["connector", "tier"])
def test_an_operator_set_identity_decides(tmp_path: Path, namespace_of) -> None:  # type: ignore[no-untyped-def]
    model = write_model_dir(tmp_path / "model", b"\x01" * 256)
    first = namespace_of(model, model_identity="release-7")
    write_model_dir(tmp_path / "model", b"\x01" * 300)
    assert namespace_of(model, model_identity="release-7") == first
    assert namespace_of(model, model_identity="release-8") != first


def test_an_unknown_key_is_still_refused() -> None:
    with pytest.raises(ValueError, match="unknown keys"):
        VllmConnectorConfig.parse({"model_identiy": "x"})
