"""The native copy loop (``kvsvc/server/data/native/copyloop.c``): where the package
build put it, loading it, and its calls (one copy + CRC-32C pass with the GIL
released). Which loop copies use is kvsvc.server.data.copies' switch, ``NATIVE``."""

from __future__ import annotations

import ctypes
import importlib.machinery
import logging
from pathlib import Path

import numpy as np

from kvsvc.server.data.checksum import SEGMENT_BYTES
from kvsvc.server.data.claims import Claims

log = logging.getLogger(__name__)

#: why the native loop is not loaded in this process ("" once it is, or never tried)
_WHY_NOT = ""


def why_not() -> str:
    """Why the last :func:`load_native` found no native loop ("" when it did)."""
    return _WHY_NOT


class NativeCopy:
    """The compiled copy loop (``kvsvc/server/data/native/copyloop.c``, built by the
    package build, setup.py; ``make native`` in place): one call copies a run of
    segments between an engine's sealed memfd and a chunk and checksums each, with the
    GIL released for the whole call (ctypes drops it), so a copy thread takes the GIL
    once per task instead of twice per segment."""

    def __init__(self, path: Path) -> None:
        lib = ctypes.CDLL(str(path))
        u32, vp, size = ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t
        lib.kvsvc_crc32c_init.restype = ctypes.c_int
        #: 0: CRC on tables; 1: the crc32 instruction; 2: and VPCLMULQDQ folding
        self.level = lib.kvsvc_crc32c_init()
        self.hardware = self.level > 0
        for name in ("kvsvc_crc32c", "kvsvc_crc32c_nofold", "kvsvc_crc32c_tables"):
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = u32, [u32, vp, size]
        self.crc32c, self.crc32c_tables = lib.kvsvc_crc32c, lib.kvsvc_crc32c_tables
        self.crc32c_nofold = lib.kvsvc_crc32c_nofold
        self._nt = getattr(lib, "kvsvc_copy_nt", None)  # absent from an older build
        if self._nt is not None:
            self._nt.restype, self._nt.argtypes = ctypes.c_int, [ctypes.c_int]
        #: copies write with non-temporal stores (where the CRC folds; see copyloop.c)
        self.streaming = self.stream(True)
        fn = lib.kvsvc_copy_segments
        fn.restype = ctypes.c_long
        fn.argtypes = [vp, size, vp, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint64]
        fn.argtypes += [ctypes.c_int, vp, ctypes.POINTER(u32)]
        self._copy = fn
        claim = getattr(lib, "kvsvc_copy_claim", None)  # absent from an older build
        if claim is not None:
            claim.restype = ctypes.c_long
            claim.argtypes = [vp, size, vp, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int, vp]
            claim.argtypes += [ctypes.POINTER(u32), vp, vp, size, size, vp, ctypes.c_uint64]
        self._claim = claim
        #: tasks of one chunk's copy share its segments in C (``claim``)
        self.claims = claim is not None
        copy_g = getattr(lib, "kvsvc_copy_segments_guarded", None)  # absent from an older build
        claim_g = getattr(lib, "kvsvc_copy_claim_guarded", None)
        install = getattr(lib, "kvsvc_guard_install", None)
        if copy_g is not None and claim_g is not None and install is not None and claim:
            copy_g.restype, copy_g.argtypes = fn.restype, fn.argtypes
            claim_g.restype, claim_g.argtypes = ctypes.c_long, claim.argtypes
            install.restype = ctypes.c_int
        #: copies of mapped memory that may shrink (a passed plain shared file), with a
        #: SIGBUS in it caught as TRUNCATED: the SIGBUS handler is installed
        self.guards = install is not None and bool(install())
        self._copy_g = copy_g if self.guards else None
        self._claim_g = claim_g if self.guards else None

    def stream(self, on: bool) -> bool:
        """Use non-temporal stores or not (for tests and benchmarks that compare
        both paths); returns whether they are used now."""
        self.streaming = bool(self._nt(int(on))) if self._nt is not None else False
        return self.streaming

    def copy(
        self,
        runs: np.ndarray,
        addr: int,
        lo: int,
        hi: int,
        digests: ctypes.Array,
        *,
        to_store: bool,
        guarded: bool = False,
    ) -> tuple[int, int]:
        """Copy chunk bytes [lo, hi) (``lo`` on a segment boundary) between the
        engine (``runs``: rows of engine address, chunk offset, length) and the
        chunk at ``addr``, with each segment's CRC taken in the same pass. A Store
        writes them into ``digests``; a Retrieve compares each with ``digests``
        once written into the blocks and stops at the first mismatch. Returns
        (-1, 0), or (failed segment from lo, its CRC), or (TRUNCATED, 0) when
        ``guarded`` (the runs may fault: see copyloop.c) and a page of them did."""
        got = ctypes.c_uint32()
        fn = self._copy
        if guarded:
            assert self._copy_g is not None
            fn = self._copy_g
        failed = fn(
            runs.ctypes.data, len(runs), addr, lo, hi, SEGMENT_BYTES, int(to_store),
            ctypes.addressof(digests), ctypes.byref(got),
        )  # fmt: skip
        return failed, got.value

    def claim(
        self,
        runs: np.ndarray,
        addr: int,
        size: int,
        claims: Claims,
        me: int,
        *,
        to_store: bool,
        guarded: bool = False,
    ) -> tuple[int, int]:
        """Task ``me``'s part of a chunk's copy shared by ``claims`` (see Claims):
        its own segments, then help with the others'. Returns (-1, 0), or (the
        failed segment, its CRC), or (TRUNCATED, 0) as :meth:`copy`."""
        fn = self._claim
        if guarded:
            fn = self._claim_g
        assert fn is not None
        got = ctypes.c_uint32()
        failed = fn(
            runs.ctypes.data, len(runs), addr, size, SEGMENT_BYTES, int(to_store),
            ctypes.addressof(claims.digests), ctypes.byref(got), ctypes.addressof(claims.ranges),
            ctypes.addressof(claims.starts), len(claims.starts), me,
            ctypes.addressof(claims.owner), claims.share(me),
        )  # fmt: skip
        return failed, got.value


#: What a guarded copy returns when a page of the engine's runs faulted (SIGBUS).
TRUNCATED = -2

#: The package build's name for the copy loop: a C library (no PyInit) in an
#: extension module's place, named with this interpreter's extension suffix.
NATIVE_NAME = "_copyloop"
#: What the CRC of each level runs on (NativeCopy.level).
CRC_PATHS = ("CRC tables (no crc32 instruction)", "the crc32 instruction", "VPCLMULQDQ folding")


NATIVE_DIR = Path(__file__).with_name("native")


def native_path(directory: Path = NATIVE_DIR) -> Path | None:
    """Where the package build put the copy loop, if it did."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = directory / f"{NATIVE_NAME}{suffix}"
        if path.is_file():
            return path
    return None


def load_native(path: Path | None = None) -> NativeCopy | None:
    """The native copy loop, or None (the Python loop then does the same work); why
    is kept for :func:`why_not`."""
    global _WHY_NOT
    path = path or native_path()
    if path is None or not path.exists():
        _WHY_NOT = (
            "the native loop was not built when kvsvc was installed (no C compiler then?): "
            "reinstall with cc present, or `make native` in a checkout"
        )
        log.info("copy loop: %s; copies run the Python loop", _WHY_NOT)
        return None
    try:
        return NativeCopy(path)
    except (OSError, AttributeError) as exc:  # AttributeError: a symbol missing
        _WHY_NOT = f"cannot load {path.name} ({exc})"
        log.warning("copy loop: %s; copies run the Python loop", _WHY_NOT)
        return None
