"""The reason catalogue (kvsvc/errors/reasons.py REASONS) is the one declaration of every
reason: the sources, docs/errors.md's table, proto/kvsvc/v1/reasons.json and the classes
are all checked against it here. The Node and Go clients check their tables
against the JSON in their own errors tests."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from kvsvc import errors
from kvsvc.errors import (
    REASONS,
    TRANSPORT_REASONS,
    CapacityExhausted,
    KVServiceError,
    ServiceUnavailable,
    classes,
    from_grpc_error,
    from_remote_error,
    reasons,
    to_remote_error,
)

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "kvsvc"

# Reasons raised today with a class other than the catalogue's (reason, class).
# Each is a real inconsistency left for the owner of the use site; a new one fails.
KNOWN_CLASS_CONFLICTS = {
    # regions.py: a memfd smaller than its tensors cannot grow, so it is refused
    # as InvalidRequest (a file region is RegionUnavailable: Map retries it).
    ("REGION_TOO_SMALL", "InvalidRequest"),
    # client.py: the client finds the server has no fd socket before sending.
    ("FD_PASSING_DISABLED", "Unimplemented"),
}


@dataclass(frozen=True)
class Use:
    """A reason literal in the sources."""

    where: str
    reason: str
    cls: str | None  # the class it is raised with / declared on, when the source says
    retryable: bool | None  # a literal retryable= beside it


def scan(paths: list[Path]) -> list[Use]:
    """Every reason literal: ``reason="..."`` keywords, class-level ``reason = "..."``
    and comparisons such as ``exc.reason == "..."``."""
    uses: list[Use] = []
    for path in paths:
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            where = f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}"
            if isinstance(node, ast.Call):
                kw = {k.arg: k.value for k in node.keywords if k.arg}
                value = kw.get("reason")
                if isinstance(value, ast.Constant) and isinstance(value.value, str):
                    func = node.func
                    name = (
                        func.id
                        if isinstance(func, ast.Name)
                        else func.attr
                        if isinstance(func, ast.Attribute)
                        else None
                    )
                    retry = kw.get("retryable")
                    literal = retry.value if isinstance(retry, ast.Constant) else None
                    uses.append(Use(f"{where}:{node.lineno}", value.value, name, literal))
            elif isinstance(node, ast.ClassDef):
                for stmt in node.body:
                    target = (
                        stmt.targets[0]
                        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1
                        else stmt.target
                        if isinstance(stmt, ast.AnnAssign)
                        else None
                    )
                    value = getattr(stmt, "value", None)
                    if (
                        isinstance(target, ast.Name)
                        and target.id == "reason"
                        and isinstance(value, ast.Constant)
                        and isinstance(value.value, str)
                    ):
                        uses.append(Use(f"{where}:{stmt.lineno}", value.value, node.name, None))
            elif isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
                if any(isinstance(s, ast.Attribute) and s.attr == "reason" for s in sides):
                    for s in sides:
                        if isinstance(s, ast.Constant) and isinstance(s.value, str):
                            uses.append(Use(f"{where}:{node.lineno}", s.value, None, None))
    return uses


def problems(uses: list[Use]) -> list[str]:
    """What a use gets wrong against the catalogue."""
    known_classes = {"KVServiceError", *classes._BY_NAME}
    found = []
    for u in uses:
        declared = REASONS.get(u.reason)
        if declared is None:
            found.append(
                f"{u.where}: reason {u.reason!r} is not declared in "
                "kvsvc/errors/reasons.py's catalogue"
            )
            continue
        if (
            u.cls in known_classes
            and u.cls != declared.cls.__name__
            and (u.reason, u.cls) not in KNOWN_CLASS_CONFLICTS
        ):
            found.append(
                f"{u.where}: {u.reason} raised as {u.cls}; the catalogue says "
                f"{declared.cls.__name__}"
            )
        if u.retryable is not None and u.retryable != declared.retryable:
            found.append(
                f"{u.where}: {u.reason} with retryable={u.retryable}; the catalogue says "
                f"{declared.retryable} (declare it there and drop the keyword)"
            )
    return found


def sources() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "_pb2" not in p.name)


def test_every_reason_in_kvsvc_is_declared_with_its_class() -> None:
    uses = scan(sources())
    assert len(uses) > 50, "the scan finds the reasons kvsvc raises"
    scanned = {u.where.partition(":")[0] for u in uses}
    assert "kvsvc/errors/classes.py" in scanned, "the classes' own reasons are scanned too"
    assert problems(uses) == []


def test_every_declared_reason_is_used() -> None:
    """Nothing stale in the catalogue: each reason is raised, compared against or a
    class's own, except the transport reasons from_grpc_error makes by status."""
    used = {u.reason for u in scan(sources())}
    transport = {r.name for r in TRANSPORT_REASONS.values()}
    stale = set(REASONS) - used - transport
    assert stale == set(), "declared in kvsvc/errors/reasons.py's catalogue but raised nowhere"


def test_the_scan_catches_what_is_not_declared(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text(
        "from kvsvc.errors import InvalidRequest, KVServiceError, RegionUnavailable\n"
        "class Odd(KVServiceError):\n"
        '    reason = "ODD_CLASS_REASON"\n'
        "def f(exc):\n"
        '    if exc.reason == "NEVER_DECLARED":\n'
        '        raise InvalidRequest("x", reason="BRAND_NEW_REASON")\n'
        '    raise InvalidRequest("x", reason="REGION_TRUNCATED")\n'
        "def g():\n"
        '    raise CapacityExhausted("x", reason="FD_SOCKET_BUSY", retryable=False)\n'
    )
    found = "\n".join(problems(scan([bad])))
    assert "'ODD_CLASS_REASON' is not declared" in found
    assert "'NEVER_DECLARED' is not declared" in found
    assert "'BRAND_NEW_REASON' is not declared" in found
    assert "REGION_TRUNCATED raised as InvalidRequest; the catalogue says RegionUnavailable" in (
        found
    )
    assert "FD_SOCKET_BUSY with retryable=False; the catalogue says True" in found


def test_the_catalogue_is_well_formed() -> None:
    names = [r.name for r in reasons._CATALOGUE]
    assert len(names) == len(set(names)), "a reason is declared twice"
    for r in REASONS.values():
        assert re.fullmatch(r"[A-Z][A-Z0-9_]*", r.name) and len(r.name) <= 63, r.name
        assert r.meaning and "\n" not in r.meaning and "|" not in r.meaning, r.name
        if r not in TRANSPORT_REASONS.values():
            assert r.code == r.cls.code, r.name
    # Every class's own reason is declared with that class, its code and retryable.
    for cls in [KVServiceError, *classes._BY_NAME.values()]:
        declared = REASONS[cls.reason]
        assert (declared.cls, declared.code, declared.retryable) == (
            cls,
            cls.code,
            cls.retryable,
        ), cls.__name__


def test_classes_register_themselves() -> None:
    assert classes._BY_NAME["MappingLost"] is errors.MappingLost
    assert classes._BY_REASON["CHECKSUM_MISMATCH"] is errors.DataLoss
    assert classes._BY_CODE[grpc.StatusCode.FAILED_PRECONDITION] is errors.LayoutMismatch
    assert classes._BY_CODE[grpc.StatusCode.UNKNOWN] is errors.RemoteHandlerError
    before = (dict(classes._BY_NAME), dict(classes._BY_REASON), dict(classes._BY_CODE))
    try:

        class ProbeOnlyError(CapacityExhausted):
            reason = "PROBE_ONLY"

        env = to_remote_error(ProbeOnlyError("probe"), "rid")
        assert type(from_remote_error(env)) is ProbeOnlyError
        env.type = "SomethingElse"
        assert type(from_remote_error(env)) is ProbeOnlyError  # by its reason
        with pytest.raises(TypeError, match="named MappingLost exists"):
            type("MappingLost", (KVServiceError,), {})
        with pytest.raises(TypeError, match="reason CHUNK_NOT_FOUND is Miss's"):
            type("AnotherMiss", (KVServiceError,), {"reason": "CHUNK_NOT_FOUND"})
        assert "AnotherMiss" not in classes._BY_NAME
    finally:
        for table, saved in zip(
            (classes._BY_NAME, classes._BY_REASON, classes._BY_CODE), before, strict=True
        ):
            table.clear()
            table.update(saved)


def test_generated_json_and_doc_table_match_the_catalogue() -> None:
    run = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_reasons.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stdout + run.stderr


# The base class is never raised by a server: a bare KVServiceError comes back as
# the class of its code, like a newer server's unknown class.
SERVER_REASONS = [r for r in REASONS.values() if not r.client and r.cls is not KVServiceError]


@pytest.mark.parametrize("reason", SERVER_REASONS, ids=lambda r: r.name)
def test_every_server_reason_round_trips_the_envelope(reason: errors.Reason) -> None:
    exc = reason.cls("m", reason=reason.name)
    assert exc.retryable is reason.retryable
    back = from_remote_error(to_remote_error(exc, "rid"))
    assert (type(back), back.code, back.reason, back.retryable) == (
        reason.cls,
        reason.code,
        reason.name,
        reason.retryable,
    )


@pytest.mark.parametrize("code", list(TRANSPORT_REASONS), ids=lambda c: c.name)
def test_transport_failures_get_their_declared_reason(code: grpc.StatusCode) -> None:
    declared = TRANSPORT_REASONS[code]
    failure = grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), "d")
    exc = from_grpc_error(failure, request_id="r")
    assert (type(exc), exc.code, exc.reason, exc.retryable) == (
        declared.cls,
        code,
        declared.name,
        declared.retryable,
    )


def test_a_declared_reason_brings_its_retryable_default() -> None:
    assert CapacityExhausted("busy", reason="FD_SOCKET_BUSY").retryable is True
    assert CapacityExhausted("full").retryable is False
    assert ServiceUnavailable("closed", reason="CLIENT_CLOSED").retryable is False
    assert ServiceUnavailable("lost").retryable is True
    # An explicit value, or an undeclared reason (a newer server's), keeps its own.
    assert CapacityExhausted("busy", reason="FD_SOCKET_BUSY", retryable=False).retryable is False
    assert CapacityExhausted("x", reason="NOT_IN_THE_CATALOGUE").retryable is False
