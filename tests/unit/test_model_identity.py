"""The weights' identity in the plug-ins' namespace fingerprints (identity.py): two
deployments share KV only when their weights are the same files, hub commit or
operator-set identity; a model known only by name says so once."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvsvc.integrations import identity
from kvsvc.integrations.identity import fingerprint_weights, weights_identity

COMMIT_A = "a" * 40
COMMIT_B = "b" * 40


@pytest.fixture(autouse=True)
def fresh(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    weights_identity.cache_clear()
    identity._warned.clear()
    yield
    weights_identity.cache_clear()


def model_dir(root: Path, weights: bytes = b"w" * 64, config: str = '{"hidden": 8}') -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(config)
    (root / "model.safetensors.index.json").write_text('{"weight_map": {}}')
    (root / "model-00001-of-00001.safetensors").write_bytes(weights)
    (root / "tokenizer.json").write_text("{}")
    return root


def ident(path: Path | str, revision: str | None = None, **kw: object) -> str:
    weights_identity.cache_clear()
    return weights_identity(str(path), revision, **kw).value  # type: ignore[arg-type]


def test_the_same_files_are_the_same_identity(tmp_path: Path) -> None:
    d = model_dir(tmp_path / "m")
    first = ident(d)
    assert first.startswith("files:")
    assert ident(d) == first
    assert not weights_identity(str(d)).weak


def test_weights_replaced_under_the_same_path_are_another_identity(tmp_path: Path) -> None:
    d = model_dir(tmp_path / "m")
    before = ident(d)
    model_dir(d, weights=b"v" * 65)  # a fine-tune written over the same path
    assert ident(d) != before


def test_weights_rewritten_with_the_same_size_are_another_identity(tmp_path: Path) -> None:
    d = model_dir(tmp_path / "m")
    f = d / "model-00001-of-00001.safetensors"
    before = ident(d)
    st = f.stat()
    f.write_bytes(b"x" * st.st_size)
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert ident(d) != before


def test_a_changed_config_is_another_identity(tmp_path: Path) -> None:
    d = model_dir(tmp_path / "m")
    before = ident(d)
    (d / "config.json").write_text('{"hidden": 16}')
    assert ident(d) != before


def test_files_that_do_not_shape_kv_do_not_split_the_namespace(tmp_path: Path) -> None:
    d = model_dir(tmp_path / "m")
    before = ident(d)
    (d / "tokenizer.json").write_text('{"changed": true}')
    (d / "README.md").write_text("notes")
    assert ident(d) == before


def test_a_single_weight_file_is_identified_by_its_size_and_mtime(tmp_path: Path) -> None:
    f = tmp_path / "model.gguf"
    f.write_bytes(b"g" * 10)
    before = ident(f)
    f.write_bytes(b"g" * 11)
    assert ident(f) != before


def test_the_operator_set_identity_wins(tmp_path: Path) -> None:
    d = model_dir(tmp_path / "m")
    assert ident(d, override="release-7") == "set:release-7"


def hub_ref(tmp_path: Path, model: str, ref: str, commit: str) -> None:
    refs = tmp_path / "hub" / f"models--{model.replace('/', '--')}" / "refs"
    refs.mkdir(parents=True, exist_ok=True)
    (refs / ref).write_text(commit)


def test_a_hub_name_is_its_revisions_commit(tmp_path: Path) -> None:
    hub_ref(tmp_path, "org/model", "main", COMMIT_A)
    hub_ref(tmp_path, "org/model", "v2", COMMIT_B)
    assert ident("org/model") == f"hub:{COMMIT_A}"
    assert ident("org/model", "v2") == f"hub:{COMMIT_B}"
    assert ident("org/model", COMMIT_B) == f"hub:{COMMIT_B}"


def test_an_unknown_revision_resolves_only_when_one_is_cached(tmp_path: Path) -> None:
    hub_ref(tmp_path, "org/model", "v2", COMMIT_B)
    assert ident("org/model", revision_known=False) == f"hub:{COMMIT_B}"
    hub_ref(tmp_path, "org/model", "main", COMMIT_A)
    weights_identity.cache_clear()
    weak = weights_identity("org/model", None, revision_known=False)
    assert weak.weak and weak.value == "name:org/model@None"


def test_a_name_alone_is_weak_and_warned_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    log = logging.getLogger("kvsvc.test-identity")
    with caplog.at_level(logging.WARNING, logger=log.name):
        first = fingerprint_weights("served-name", None, "", log)
        second = fingerprint_weights("served-name", None, "", log)
    assert first == second == "name:served-name@None"
    warnings = [r for r in caplog.records if "model_identity" in r.getMessage()]
    assert len(warnings) == 1
    assert "served-name" in warnings[0].getMessage()


def test_a_resolvable_model_is_not_warned(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    d = model_dir(tmp_path / "m")
    log = logging.getLogger("kvsvc.test-identity")
    with caplog.at_level(logging.WARNING, logger=log.name):
        fingerprint_weights(str(d), None, "", log)
    assert not caplog.records
