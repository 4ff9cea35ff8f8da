"""``kvsvc`` as a server from before the Session RPC, for the Node and Go clients'
fallback tests: the real server, with Session left out of its service (as
tests/test_session.py's ``without_session`` does in-process), so a client's
Session stream is answered UNIMPLEMENTED and every unary RPC works as usual.

Usage: ``.venv/bin/python clients/testdata/kvsvc_without_session.py serve ARGS...``
"""

from __future__ import annotations

import sys
from typing import Any

from kvsvc.cli.main import main
from kvsvc.server.ops.lifecycle import Server

_add = Server._add_service


def _older(self: Server, service: Any, servicer: object, server: Any = None) -> None:
    if service.full_name == "kvsvc.v1.KVCacheService":

        class Old:
            full_name = service.full_name
            methods = [m for m in service.methods if m.name != "Session"]

        service = Old
    _add(self, service, servicer, server)


Server._add_service = _older  # type: ignore[method-assign]

if __name__ == "__main__":
    sys.exit(main())
