"""Gives the heap a flush freed back to the system (issue 30).

``tune_malloc`` (adamps.server.main) keeps request bodies on the heap and raises glibc's trim
threshold to 256 MiB, so freed memory stays for the next request instead of costing page faults.
A flush frees a chunk's records and LMDB's dirty pages (without ``writemap`` LMDB mallocs every
page a write transaction touches): without a trim, the process keeps them (in the main heap and
in the owner threads' arenas, which never shrink on their own) and its RSS holds several chunks
above the state. ``malloc_trim(0)`` after each flush returns them: a few milliseconds per flush.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Callable


def _load() -> Callable[[], int] | None:
    name = ctypes.util.find_library("c")
    if not name:
        return None
    try:
        fn = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return lambda: int(fn(0))


_TRIM = _load()


def trim() -> bool:
    """Returns free heap memory of every arena to the system; False where unavailable."""
    return _TRIM is not None and _TRIM() == 1


def _load_madvise() -> Callable[[int, int], int] | None:
    name = ctypes.util.find_library("c")
    if not name:
        return None
    try:
        fn = ctypes.CDLL(name, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return lambda addr, length: int(fn(addr, length, _MADV_DONTNEED))


#: Linux's MADV_DONTNEED
_MADV_DONTNEED = 4
_MADVISE = _load_madvise()


def drop_file_view(path: str) -> bool:
    """Unmaps from this process the pages of `path`'s read-only shared maps (LMDB's, opened
    without ``writemap``: ``r--s`` in /proc/self/maps) that reads touched: they stay in the
    kernel's page cache, and the next read maps them again (a minor fault). RSS then counts what
    the process holds, not the file pages a start's load or a flush's B-tree walk read once
    (issue 38: a reloaded table's RSS was half page cache). A writable or private map is never
    touched: that would drop data. False where unavailable (not Linux, not glibc)."""
    if _MADVISE is None:
        return False
    try:
        with open("/proc/self/maps") as f:
            lines = [ln.split() for ln in f if ln.rstrip().endswith(path)]
    except OSError:
        return False
    done = False
    for parts in lines:
        if len(parts) >= 6 and parts[1] == "r--s" and parts[5] == path:
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            done = _MADVISE(lo, hi - lo) == 0 or done
    return done
