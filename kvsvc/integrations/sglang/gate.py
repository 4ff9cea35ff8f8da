"""The version gate of SGLang's HiCache storage backend: SGLang releases outside
``TESTED_RANGE`` get one warning, not a refusal, while the seams this backend uses
are there (``HiCacheStorage`` with its v1 calls, the host pool's
``get_page_buffer_meta``); only their absence is an ImportError, raised when this
module is imported. What the backend builds on from SGLang is imported here."""

from __future__ import annotations

import logging
import re

import sglang

log = logging.getLogger("kvsvc.sglang")

__all__ = [
    "STORAGE_BATCH_SIZE",
    "TESTED_RANGE",
    "HiCacheStorage",
    "HiCacheStorageConfig",
    "HiCacheStorageExtraInfo",
]

#: The SGLang releases this backend was tested with, oldest and newest.
TESTED_RANGE = ("0.5.23", "0.5.23")
#: What the backend calls on SGLang's classes; without any of them it cannot work.
STORAGE_SEAMS = ("register_mem_pool_host", "batch_exists", "batch_get_v1", "batch_set_v1")
POOL_SEAMS = ("get_page_buffer_meta",)


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", version)[:3])


def _absent(why: str) -> ImportError:
    return ImportError(
        f"kvsvc.integrations.sglang cannot run on SGLang {sglang.__version__}: {why} "
        f"(tested with SGLang {TESTED_RANGE[0]} to {TESTED_RANGE[1]})"
    )


try:
    from sglang.srt.mem_cache.hicache_storage import (
        STORAGE_BATCH_SIZE,
        HiCacheStorage,
        HiCacheStorageConfig,
        HiCacheStorageExtraInfo,
    )
except ImportError as exc:
    raise _absent(f"its HiCache storage interface does not import ({exc})") from exc


def _host_pools() -> list[type]:
    """SGLang's MHA and MLA host pool classes where 0.5.x keeps them; where they
    moved, each pool is checked when it is registered instead."""
    try:
        from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
        from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
    except ImportError:
        return []
    return [MHATokenToKVPoolHost, MLATokenToKVPoolHost]


def _check_seams() -> None:
    """ImportError naming what is absent; one warning when the release is untested."""
    missing = [
        f"HiCacheStorage.{m}"
        for m in STORAGE_SEAMS
        if not callable(getattr(HiCacheStorage, m, None))
    ]
    missing += [
        f"{pool.__name__}.{m}"
        for pool in _host_pools()
        for m in POOL_SEAMS
        if not callable(getattr(pool, m, None))
    ]
    if missing:
        raise _absent(f"it lacks {', '.join(missing)}")
    version = _release(str(sglang.__version__))
    if not _release(TESTED_RANGE[0]) <= version <= _release(TESTED_RANGE[1]):
        log.warning(
            "kvsvc: SGLang %s is outside the tested range %s to %s; the HiCache storage "
            "seams kvsvc uses are present, so it runs",
            sglang.__version__,
            *TESTED_RANGE,
        )


_check_seams()
