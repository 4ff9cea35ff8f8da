"""What both halves of the vLLM connector share: the vLLM version gate (the one
module that imports vLLM's connector API: another version is warned of, a vLLM
without that API fails with one line), the deployment namespace and chunk keys,
the metadata the scheduler sends the workers each step, the stats vLLM sums over
workers, and the connector's logger."""

from __future__ import annotations

import hashlib
import json
import logging
import sys
from dataclasses import dataclass, field
from typing import Any

import vllm

from kvsvc.integrations.identity import fingerprint_weights
from kvsvc.integrations.vllm.config import VllmConnectorConfig

#: The vLLM versions kvsvc's tests run against (scripts/check_vllm.sh): 0.32 with
#: its CPU engine, 0.33 and 0.34 engine-free. Another version is not refused while
#: the seams below import: one warning names the tested range.
TESTED_VERSIONS = ("0.32", "0.33", "0.34")
VLLM_VERSION = ".".join(str(vllm.__version__).split(".")[:2])
TESTED_RANGE = f"{TESTED_VERSIONS[0]}-{TESTED_VERSIONS[-1]}"

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
        KVConnectorTransferResults,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
except ImportError as exc:
    raise ImportError(
        f"kvsvc.integrations.vllm cannot run on vLLM {vllm.__version__}: its KV connector "
        f"API lacks what kvsvc uses ({exc}); tested with vLLM {TESTED_RANGE}"
    ) from exc

log = logging.getLogger("kvsvc.vllm")
if VLLM_VERSION not in TESTED_VERSIONS:
    log.warning(
        "kvsvc: vLLM %s is outside the range kvsvc was tested with (%s); the connector "
        "API kvsvc uses is present, so it runs",
        vllm.__version__,
        TESTED_RANGE,
    )

__all__ = [
    "TESTED_RANGE",
    "TESTED_VERSIONS",
    "VLLM_VERSION",
    "KVConnectorBase_V1",
    "KVConnectorRole",
    "KVConnectorTransferResults",
    "KvsvcConnectorMetadata",
    "KvsvcConnectorStats",
    "Op",
    "chunk_key",
    "deployment_namespace",
    "hash_bytes",
    "log",
    "offload_namespace",
    "setup_logging",
]


def setup_logging(level: str) -> None:
    """vLLM configures only its own loggers: without a handler ours would print
    nothing below WARNING."""
    log.setLevel(level.upper())
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [kvsvc] %(message)s"))
        log.addHandler(handler)
        log.propagate = False


# --- what the scheduler sends the workers each step ---
@dataclass
class Op:
    """A load or store of one request: its chunks as (hash of the chunk's last
    vLLM block, the chunk's block ids). vLLM's block hashes chain, so the last
    block's hash names the whole prefix."""

    req_id: str
    chunks: list[tuple[bytes, list[int]]]
    #: the request's namespace when it is not the deployment's (its cache salt's,
    #: with ``salt_namespaces``: config.salt_namespace); empty: the mapping's
    namespace: str = ""


@dataclass
class KvsvcConnectorMetadata(KVConnectorMetadata):
    loads: list[Op] = field(default_factory=list)
    stores: list[Op] = field(default_factory=list)
    preempted: set[str] = field(default_factory=set)


@dataclass
class KvsvcConnectorStats(KVConnectorStats):
    """Counters since the last interval, summed over workers (vLLM logs them)."""

    def reset(self) -> None:
        self.data: dict[str, Any] = {}

    def aggregate(self, other: KVConnectorStats) -> KvsvcConnectorStats:
        for k, v in other.data.items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


def deployment_namespace(vllm_config: Any, kv_cache_config: Any, cfg: VllmConnectorConfig) -> str:
    """The namespace two engines share only when their KV is interchangeable:
    model and its weights' identity (identity.py), dtype, block size, KV spec,
    parallel sizes, vLLM minor version. The TP rank goes into each key, the
    worker's tensor layout into the mapping (the server refuses to load a chunk
    stored under another layout)."""
    mc, pc, cc = vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config
    specs = sorted({repr(g.kv_cache_spec) for g in getattr(kv_cache_config, "kv_cache_groups", [])})
    revision = getattr(mc, "revision", None)
    fingerprint = {
        "model": str(mc.model),
        "revision": str(revision),
        "weights": fingerprint_weights(str(mc.model), revision, cfg.model_identity, log),
        "dtype": str(mc.dtype),
        "cache_dtype": str(cc.cache_dtype),
        "block_size": int(cc.block_size),
        "kv_specs": specs,
        "tp": int(pc.tensor_parallel_size),
        "pp": int(pc.pipeline_parallel_size),
        "blocks_per_chunk": cfg.blocks_per_chunk,
        "vllm": VLLM_VERSION,
    }
    return _namespace(cfg, fingerprint)


def offload_namespace(config: Any, row_bytes: int, cfg: VllmConnectorConfig) -> str:
    """The namespace of the offloading tier (tier.py): as ``deployment_namespace``,
    from what vLLM's ``OffloadingConfig`` holds, plus the primary tier's row (one
    kvsvc chunk holds one whole row: every worker's slot of one offload chunk)."""
    par, cache = config.parallel, config.cache
    fingerprint = {
        "kind": "offload",  # another byte layout than the KV connector's chunks
        "model": str(config.model.name),
        # vLLM's offloading config carries no revision: a hub name resolves only
        # when this host's cache holds one revision of it.
        "weights": fingerprint_weights(
            str(config.model.name), None, cfg.model_identity, log, revision_known=False
        ),
        "cache_dtype": str(config.model.dtype),
        "groups": [[g.group_id, g.tokens_per_block, len(g.layer_names)] for g in config.groups],
        "worker_kv_bytes_per_block": int(config.worker_kv_bytes_per_block),
        "row_bytes": int(row_bytes),
        "tokens_per_hash": int(cache.tokens_per_hash),
        "blocks_per_chunk": int(cache.blocks_per_chunk),
        "parallel": [par.world_size, par.tp_size, par.pp_size, par.pcp_size, par.dcp_size],
        "layout": [
            str(getattr(config, "kv_cache_layout", None)),
            bool(getattr(config, "canonical_layout", False)),
            bool(getattr(config, "replicated_layout", False)),
        ],
        "vllm": VLLM_VERSION,
    }
    return _namespace(cfg, fingerprint)


def _namespace(cfg: VllmConnectorConfig, fingerprint: dict[str, Any]) -> str:
    digest = hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()
    return f"{cfg.namespace}/{digest[:32]}"


def chunk_key(tp_rank: int, block_hash: bytes) -> bytes:
    """One key per chunk and TP rank: a hit needs every rank's shard."""
    return b"tp%d:" % tp_rank + block_hash


def hash_bytes(h: Any) -> bytes:
    """A vLLM block hash as key bytes (bytes as they are; any other kind hashed)."""
    return h if isinstance(h, bytes) else hashlib.sha256(repr(h).encode()).digest()
