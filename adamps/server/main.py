"""`adamps ps`: run one parameter server until SIGTERM/SIGINT (a final flush on the way out)."""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import ctypes.util
import gc
import logging
import sys

from adamps import config
from adamps.role import role_parser, run_role
from adamps.server.config import PsConfig
from adamps.wire import web

log = logging.getLogger("adamps.ps")

# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def tune_malloc(mmap_threshold: int = 64 << 20, trim_threshold: int = 256 << 20) -> bool:
    """Keeps multi-MB request bodies on the heap and the heap from shrinking after each one.

    By default glibc serves every allocation above 128 KiB with a fresh mmap and unmaps it on free,
    so each 4 MB body costs ~1,000 page faults; the reference measured 3-4x on loopback pushes
    (shared/reference/machine-limits.md section 3: MALLOC_MMAP_THRESHOLD_=64Mi +
    MALLOC_TRIM_THRESHOLD_=256Mi). Returns False where mallopt is unavailable (not glibc) or
    refuses a value.
    """
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok_mmap = mallopt(_M_MMAP_THRESHOLD, mmap_threshold) == 1
    if not ok_mmap:  # older glibc caps the threshold at 32 MiB on 64-bit
        ok_mmap = mallopt(_M_MMAP_THRESHOLD, min(mmap_threshold, 32 << 20)) == 1
    ok_trim = mallopt(_M_TRIM_THRESHOLD, trim_threshold) == 1
    return ok_mmap and ok_trim


def freeze_startup_heap() -> int:
    """Moves every object alive now (the imported modules, the server as built) out of the
    garbage collector's generations (``gc.freeze``), so that its full collections walk only
    what was made since; returns the objects frozen.

    Issue 36's profile of a click-through run at RF 3: a server of about 170,000 objects
    ran a full collection every 2-3 seconds of training, 70-110 ms each, about a tenth of
    its CPU, charged to whatever line allocated then (``Ready()``, a ``RowPush``); frozen,
    each took 8-37 ms. Frozen objects are still freed when their last reference goes; only
    a cycle among them is never collected, and those are built once, at start."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def build_parser() -> argparse.ArgumentParser:
    return role_parser(
        "adamps ps",
        "Run a parameter server (Project Adam 3.3): under controllers, or alone on a static "
        "bucket map.",
        PsConfig,
    )


def main(argv: list[str] | None = None) -> int:
    return run_role(build_parser(), PsConfig, "ps", argv, serve)


def serve(cfg: PsConfig) -> int:
    if cfg.tune_malloc:
        log.info("glibc malloc thresholds raised: %s", tune_malloc())

    from threadpoolctl import threadpool_limits

    from adamps.server.api.app import ParameterServer

    # Owner threads are the parallelism; BLAS threads inside each would only oversubscribe the cores.
    limits = threadpool_limits(limits=cfg.blas_threads)
    try:
        ps = ParameterServer(cfg)
    except config.ConfigError as exc:
        log.error("%s", exc)
        return 2
    try:
        app = ps.make_app()
        log.info(
            "parameter server: %d tensors, %d shards held, buckets %s, data in %s",
            len(ps.store.tensors),
            len(ps.store.shards),
            cfg.buckets or "all",
            cfg.data_dir,
        )
        log.info("startup heap frozen: %d objects", freeze_startup_heap())
        asyncio.run(web.run_app(app, cfg.host, cfg.port, stop=ps.stop_serving))
    finally:
        ps.close()
        limits.restore_original_limits()
    if ps.fatal is not None:  # its reason was logged once, when it stopped (stop_for)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
