"""cProfile of every parameter server a benchmark starts, by their main thread's CPU time.

    PYTHONPATH=$PWD:$PWD/benchmarks/cprofile_hook ADAMPS_CPROFILE_DIR=/tmp/prof \
        python benchmarks/server_step_cpu.py 40000

Each `adamps ps` process (its argv names --server-id) profiles its main thread (the event loop:
replication, the data plane, the clock) with ``time.thread_time`` as the timer, so the times are
its CPU, not the wall clock that waits for the GIL, and writes ``ps<pid>.prof`` at a clean exit
(SIGTERM: the cluster's stop). Read with ``python -m pstats``; call counts per step are what to
compare on a loaded machine. The profiler slows the event loop about threefold.
"""

import os
import sys

_dir = os.environ.get("ADAMPS_CPROFILE_DIR")
if _dir and "--server-id" in sys.argv:
    import atexit
    import cProfile
    import time

    _prof = cProfile.Profile(time.thread_time)
    _prof.enable()

    def _dump() -> None:
        _prof.disable()
        _prof.dump_stats(os.path.join(_dir, f"ps{os.getpid()}.prof"))

    atexit.register(_dump)
