"""cProfile of every parameter server (and controller) a benchmark starts, by CPU time.

    PYTHONPATH=$PWD:$PWD/benchmarks/cprofile_hook ADAMPS_CPROFILE_DIR=/tmp/prof \
        python benchmarks/server_step_cpu.py 40000

Each `adamps ps` process (its argv names --server-id) profiles its main thread (the event loop:
replication, the data plane, the clock) with ``time.thread_time`` as the timer, so the times are
its CPU, not the wall clock that waits for the GIL, and writes ``ps<pid>.prof`` at a clean exit
(SIGTERM: the cluster's stop). Read with ``python -m pstats``; call counts per step are what to
compare on a loaded machine. The profiler slows the event loop about threefold.

``ADAMPS_CPROFILE_THREADS=1`` profiles every thread instead, and controllers too (argv names
--member; their Raft thread is where an idle controller spends its CPU): each thread gets its
own profiler, and ``<role><pid>-<thread name>.prof`` is written per thread at exit
(`python benchmarks/idle.py` under it names what an idle cluster spends its CPU on).
``ADAMPS_CPROFILE_START=PATH`` counts CPU only once the file PATH exists (touch it when the
window of interest begins: the start, imports and joins then cost nothing; call counts still
cover the whole run).
"""

import os
import sys

_dir = os.environ.get("ADAMPS_CPROFILE_DIR")
_threads = os.environ.get("ADAMPS_CPROFILE_THREADS") == "1"
_role = "ps" if "--server-id" in sys.argv else ("ctl" if "--member" in sys.argv else None)
if _dir and (_role == "ps" or (_threads and _role)):
    import atexit
    import cProfile
    import threading
    import time

    _profs: list[tuple[str, cProfile.Profile]] = []
    _trigger = os.environ.get("ADAMPS_CPROFILE_START")
    _started = [False, 0.0]  # the trigger file was seen; when it is looked for next
    _base = threading.local()

    def _cpu() -> float:
        """This thread's CPU seconds since the trigger file appeared (0 before)."""
        if not _started[0]:
            now = time.monotonic()
            if now < _started[1]:
                return 0.0
            _started[:] = [os.path.exists(_trigger), now + 0.5]
            if not _started[0]:
                return 0.0
        base = getattr(_base, "t", None)
        if base is None:
            base = _base.t = time.thread_time()
        return time.thread_time() - base

    def _start(name: str) -> cProfile.Profile:
        prof = cProfile.Profile(_cpu if _trigger else time.thread_time)
        _profs.append((name, prof))
        prof.enable()
        return prof

    if _threads:
        _run = threading.Thread.run

        def _profiled_run(self: threading.Thread) -> None:
            _start(self.name.replace("/", "_").replace(" ", "_"))
            _run(self)

        threading.Thread.run = _profiled_run  # type: ignore[method-assign]

    _start("MainThread")

    def _dump() -> None:
        for name, prof in list(_profs):
            prof.disable()  # the calling thread's only; the others' stats are read as they are
            suffix = f"-{name}" if _threads else ""
            prof.dump_stats(os.path.join(_dir, f"{_role}{os.getpid()}{suffix}.prof"))

    atexit.register(_dump)
