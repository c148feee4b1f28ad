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
