"""Start LMCache's multiprocess server (``lmcache.v1.multiprocess.server``) with
its arguments, binding its Prometheus endpoint to 127.0.0.1 rather than every
interface (LMCache calls ``prometheus_client.start_http_server(port)``, which
binds 0.0.0.0). Runs under the Python that has lmcache installed:

    LMCACHE_TRACK_USAGE=false /tmp/bench-venv/bin/python benchmarks/lmcache_launch.py \\
        --transport grpc --host 127.0.0.1 --port P --l1-size-gb 1 --eviction-policy LRU \\
        --prometheus-port Q
"""

from __future__ import annotations

import runpy
import sys
from typing import Any

import prometheus_client

_start_http_server = prometheus_client.start_http_server


def _loopback_only(port: int, addr: str = "127.0.0.1", *args: Any, **kwargs: Any) -> Any:
    return _start_http_server(port, "127.0.0.1", *args, **kwargs)


prometheus_client.start_http_server = _loopback_only
sys.argv = ["lmcache.v1.multiprocess.server", *sys.argv[1:]]
runpy.run_module("lmcache.v1.multiprocess.server", run_name="__main__", alter_sys=True)
