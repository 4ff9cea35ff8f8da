"""Claims the README and the pages it moved to docs/ make about the code, checked
against the code, so that they cannot drift again (each of these had: five exception
classes missing from the list, a `make` target the README named that did nothing;
tests/unit/test_docs.py checks every page's make targets, links, paths and commands)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvsvc import errors

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()


def test_the_exception_list_names_every_class_a_caller_can_catch() -> None:
    doc = (REPO / "docs" / "errors.md").read_text()
    paragraph = doc[doc.index("Client exceptions (`kvsvc.errors`") :].split("\n\n")[0]
    listed = set(re.findall(r"`(\w+)`", paragraph))
    classes = {
        name
        for name, value in vars(errors).items()
        if isinstance(value, type) and issubclass(value, errors.KVServiceError)
    }
    assert classes - listed == set(), "docs/errors.md's exception list misses these"
    assert {n for n in listed - classes if n[0].isupper() and n != "ValueError"} == set()


def test_the_fast_loop_is_make_check_and_runs_the_unit_layer() -> None:
    assert "`make check`" in README
    makefile = (REPO / "Makefile").read_text()
    check = re.search(r"^check:(.*)$", makefile, re.M)
    assert check and {"lint", "typecheck", "unit"} <= set(check.group(1).split())
    assert re.search(r"^unit:.*\n\t.*pytest.* tests/unit\b", makefile, re.M)


def test_public_imports_users_write_keep_working() -> None:
    import kvsvc
    from kvsvc.client import AsyncKVCacheClient, KVCacheClient

    assert kvsvc.Client is KVCacheClient and kvsvc.AsyncClient is AsyncKVCacheClient
    assert kvsvc.TransferUnprovable is errors.TransferUnprovable


def test_the_architecture_doc_names_every_module_of_the_tree() -> None:
    """docs/architecture.md gives each package a paragraph naming its modules: a
    module added, moved or renamed without the doc fails here."""
    doc = (REPO / "docs" / "architecture.md").read_text()
    paragraphs = {
        m.group(1).rstrip("/"): m.group(2)
        for m in re.finditer(r"\*\*`(kvsvc/[\w/]*)`[^*]*\*\*(.*?)(?=\n\n)", doc, re.S)
    }
    package = REPO / "kvsvc"
    missing = []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(REPO)
        if "v1" in rel.parts or path.name in ("__init__.py", "__main__.py"):
            continue
        home = "/".join(rel.parts[:-1])
        # a module is named in its package's paragraph, or a subpackage's in its parent's
        named = f"`{path.stem}`" in paragraphs.get(home, "") or any(
            f"`{rel.parts[-2]}/`" in text and f"`{path.stem}`" in text
            for text in paragraphs.values()
        )
        if not named:
            missing.append(str(rel))
    assert missing == [], "modules docs/architecture.md does not name"


def test_the_configuration_file_the_docs_show_is_one_kvsvc_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvsvc.server.config import SETTINGS, ConfigError, read_config_file

    page = (REPO / "docs" / "configuration.md").read_text()
    examples = re.findall(r"```toml\n(.*?)```", page, re.S)
    assert examples, "docs/configuration.md shows a configuration file"
    monkeypatch.chdir(tmp_path)
    for text in examples:
        Path("kvsvc.toml").write_text(text)
        assert set(read_config_file("kvsvc.toml")) <= set(SETTINGS)
    # The error the page quotes is the one a misspelt key gets.
    Path("kvsvc.toml").write_text('store_byte = "1G"\n')
    with pytest.raises(ConfigError) as ei:
        read_config_file("kvsvc.toml")
    assert f"`kvsvc serve: {ei.value}`" in page
    for flag in ("--config", "--check", "--print-config", "KVSVC_CONFIG"):
        assert f"{flag}" in page
    assert "(docs/configuration.md)" in README
