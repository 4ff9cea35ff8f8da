"""kvsvc as vLLM's KV offload and prefix-sharing backend (vLLM's V1 connector API).

Load it with ``--kv-transfer-config '{"kv_connector": "KvsvcConnector",
"kv_connector_module_path": "kvsvc.integrations.vllm", "kv_role": "kv_both",
"kv_load_failure_policy": "recompute", "kv_connector_extra_config": {"target":
"127.0.0.1:50051"}}'`` (docs/vllm.md has every key).

vLLM makes one instance per role, as its base class documents: the scheduler-side
one in the engine-core process (scheduler.py: lookups, load and store plans,
request bookkeeping) and a worker-side one in each worker process (worker.py: the
KV cache mapped into kvsvc, loads, stores, fences, failed blocks). They share no
memory; the plans travel as ``KvsvcConnectorMetadata`` (common.py). This class
builds its role's half and delegates each hook to it. Every hook catches
everything: a kvsvc failure becomes a miss or blocks that vLLM recomputes, never
an exception into the engine.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from kvsvc.errors import BoundedLog
from kvsvc.integrations.vllm.common import (
    KVConnectorBase_V1,
    KVConnectorRole,
    KVConnectorTransferResults,
    KvsvcConnectorMetadata,
    KvsvcConnectorStats,
    log,
    setup_logging,
)
from kvsvc.integrations.vllm.config import VllmConnectorConfig
from kvsvc.integrations.vllm.scheduler import KvsvcConnectorScheduler
from kvsvc.integrations.vllm.worker import KvsvcConnectorWorker

T = TypeVar("T")

__all__ = ["KvsvcConnector", "KvsvcConnectorMetadata", "KvsvcConnectorStats"]


def _guarded(default: Callable[..., T]) -> Callable[[Callable[..., T]], Callable[..., T]]:
    """No exception escapes into vLLM (it would kill the engine): log, count, and
    return ``default(self, *args)`` instead."""

    def wrap(fn: Callable[..., T]) -> Callable[..., T]:
        # wraps: the hook keeps the signature vLLM's base declares (inspect follows
        # __wrapped__; tests/e2e/vllm/test_versions.py compares them).
        @functools.wraps(fn)
        def hook(self: Any, *args: Any, **kwargs: Any) -> T:
            try:
                return fn(self, *args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - it would kill the engine
                self.counters["hook_errors"] = self.counters.get("hook_errors", 0) + 1
                self.warn.warning(
                    "kvsvc connector: %s raised %s: %s", fn.__name__, type(exc).__name__, exc
                )
                log.debug("traceback", exc_info=True)
                return default(self, *args)

        return hook

    return wrap


#: what a failed ``get_num_new_matched_tokens`` answers: nothing to load
_MISS: tuple[int | None, bool] = (0, False)


class KvsvcConnector(KVConnectorBase_V1):
    """kvsvc behind vLLM's KV connector API; see the module docstring."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        self.cfg = VllmConnectorConfig.parse(extra)
        setup_logging(self.cfg.log_level)
        policy = getattr(vllm_config.kv_transfer_config, "kv_load_failure_policy", "recompute")
        if policy != "recompute":
            log.warning(
                "kvsvc connector: kv_load_failure_policy is %r: a failed load then fails "
                'the request; set it to "recompute" so vLLM recomputes instead',
                policy,
            )
        self.warn = BoundedLog(log, 10.0)
        self.counters: dict[str, int] = {}
        self.sched: KvsvcConnectorScheduler | None = None
        self.worker: KvsvcConnectorWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.sched = KvsvcConnectorScheduler(vllm_config, kv_cache_config, self.cfg)
            self.counters = self.sched.counters
        else:
            self.worker = KvsvcConnectorWorker(vllm_config, kv_cache_config, self.cfg)
            self.counters = self.worker.counters

    # --- scheduler side ---
    @_guarded(lambda self, *a: _MISS)
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """From the presence index, or a Lookup's answer once it ended; None ("ask
        again next step") while a Lookup runs off this thread."""
        assert self.sched is not None
        return self.sched.get_num_new_matched_tokens(request, num_computed_tokens)

    @_guarded(lambda self, *a: None)
    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self.sched is not None
        self.sched.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KvsvcConnectorMetadata:
        # Not guarded: it cannot raise (see KvsvcConnectorScheduler.build_connector_meta).
        assert self.sched is not None
        return self.sched.build_connector_meta(scheduler_output)

    @_guarded(lambda self, *a: (False, None))
    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, None]:
        assert self.sched is not None
        return self.sched.request_finished(request, block_ids)

    @_guarded(lambda self, *a: [])
    def take_events(self) -> list[Any]:
        """kvsvc's blocks as vLLM KV events; vLLM's scheduler appends them to every
        KVEventBatch it publishes (called each step, events on or off)."""
        return self.sched.take_events() if self.sched is not None else []

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """No (vLLM 0.33 asks; its config then refuses ``enable_sleep_mode``): kvsvc
        maps the KV cache's memory once, and sleep frees and remaps that memory."""
        return False

    # --- worker side ---
    @_guarded(lambda self, *a: None)
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.worker is not None
        self.worker.register_kv_caches(kv_caches)

    @_guarded(lambda self, *a: None)
    def unregister_kv_caches(self) -> None:
        """vLLM 0.33, before its KV memory is freed (never with sleep mode, which
        ``supports_sleep_mode`` refuses): kvsvc stops using that memory for good."""
        if self.worker is not None:
            self.worker.detach()

    @_guarded(lambda self, *a: None)
    def restore_kv_caches(self) -> None:
        """vLLM 0.33, after its KV memory is back: nothing proves it is the memory
        kvsvc mapped, so the connector stays detached (misses; vLLM computes)."""
        if self.worker is not None:
            self.worker.restored()

    @_guarded(lambda self, *a: None)
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        assert self.worker is not None
        meta = self._get_connector_metadata()
        if isinstance(meta, KvsvcConnectorMetadata):
            self.worker.start_load_kv(meta)

    @_guarded(lambda self, *a: None)
    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        meta = kv_connector_metadata
        if self.worker is not None and isinstance(meta, KvsvcConnectorMetadata) and meta.preempted:
            self.worker.preempted(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads are asynchronous: vLLM schedules a request once they ended

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return None  # the whole step's chunks are stored at wait_for_save

    @_guarded(lambda self, *a: None)
    def wait_for_save(self) -> None:
        """Starts this step's stores (the forward has written their blocks); their
        requests' blocks stay allocated until ``get_finished`` reports them."""
        assert self.worker is not None
        if self.has_connector_metadata():
            meta = self._get_connector_metadata()
            if isinstance(meta, KvsvcConnectorMetadata):
                self.worker.save(meta)

    @_guarded(lambda self, *a: KVConnectorTransferResults())
    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        assert self.worker is not None
        return self.worker.transfer_results(finished_req_ids)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        r = self.get_transfer_results(finished_req_ids)
        return r.finished_sending or None, r.finished_recving or None

    @_guarded(lambda self, *a: set())
    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self.worker is not None
        return self.worker.load_errors()

    def get_kv_connector_stats(self) -> KvsvcConnectorStats | None:
        try:
            return self.worker.stats() if self.worker is not None else None
        except Exception:  # noqa: BLE001 - the engine must survive
            return None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvsvcConnectorStats:
        return KvsvcConnectorStats(data=dict(data or {}))

    @_guarded(lambda self, *a: None)
    def shutdown(self) -> None:
        for side in (self.sched, self.worker):
            if side is not None:
                side.shutdown()
