"""``lookup`` takes its namespace (or mapping) first, as ``put``, ``get`` and
``store`` do, and still reads the keyword form it had (``lookup(keys, namespace=)``):
the request each form builds, without a server."""

from __future__ import annotations

from typing import Any

import pytest

from kvsvc.client import calls
from kvsvc.client.plans import MappingHandle


class Recorder:
    """Stands in for a client: keeps the request a call would send."""

    def _plan(self, op: Any, request: Any, timeout: Any, *rest: Any) -> Any:
        self.request = request
        return request


def request_of(*args: Any, **kwargs: Any) -> Any:
    c = Recorder()
    steps = calls.lookup(c, *args, **kwargs)  # type: ignore[arg-type]
    next(steps)  # runs to the send: the request is built
    return c.request


MAPPING = MappingHandle("m-1", "ns", "start", 8, 4096, "fp")


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [
        (("ns", [b"a", b"b"]), {}),
        (([b"a", b"b"],), {"namespace": "ns"}),
        (("ns", [b"a", b"b"]), {"timeout": 5}),
    ],
)
def test_a_namespace_first_or_by_keyword_builds_the_same_request(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    req = request_of(*args, **kwargs)
    assert (req.namespace, req.mapping_id, list(req.keys)) == ("ns", "", [b"a", b"b"])


@pytest.mark.parametrize(
    ("args", "kwargs"), [((MAPPING, [b"k"]), {}), (([b"k"],), {"mapping": MAPPING})]
)
def test_a_mapping_first_or_by_keyword_builds_the_same_request(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    req = request_of(*args, **kwargs)
    assert (req.namespace, req.mapping_id, list(req.keys)) == ("", "m-1", [b"k"])


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        (("ns",), {}, "no keys given"),
        ((MAPPING,), {}, "no keys given"),
        (("ns", [b"k"]), {"namespace": "other"}, "given too"),
        (("ns", [b"k"]), {"mapping": MAPPING}, "given too"),
        (([b"x"], [b"k"]), {}, "not a namespace"),
    ],
)
def test_ambiguous_calls_are_type_errors(
    args: tuple[Any, ...], kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(TypeError, match=message):
        request_of(*args, **kwargs)


def test_neither_a_namespace_nor_a_mapping_is_still_a_value_error() -> None:
    with pytest.raises(ValueError, match="exactly one of mapping= or namespace="):
        request_of([b"k"])
