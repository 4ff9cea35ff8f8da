"""Claims the README makes about the code, checked against the code, so that they
cannot drift again (each of these had: five exception classes missing from the
list, a `make` target the README named that did nothing)."""

from __future__ import annotations

import re
from pathlib import Path

from kvsvc import errors

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()


def test_the_exception_list_names_every_class_a_caller_can_catch() -> None:
    paragraph = README[README.index("Client exceptions (`kvsvc.errors`") :].split("\n\n")[0]
    listed = set(re.findall(r"`(\w+)`", paragraph))
    classes = {
        name
        for name, value in vars(errors).items()
        if isinstance(value, type) and issubclass(value, errors.KVServiceError)
    }
    assert classes - listed == set(), "README's exception list misses these"
    assert {n for n in listed - classes if n[0].isupper() and n != "ValueError"} == set()


def test_every_make_target_the_readme_names_exists() -> None:
    makefile = (REPO / "Makefile").read_text()
    targets = set(re.findall(r"^([a-z][\w-]*):", makefile, re.M))
    named = set(re.findall(r"`make ([a-z][\w-]*)", README))
    assert named, "the README names make targets"
    assert named - targets == set()


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
