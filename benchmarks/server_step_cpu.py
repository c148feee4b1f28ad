"""Parameter-server CPU per training step at RF 3: the click-through workload of
``benchmarks/practitioner.py`` (batch 512, one replica, 3 controllers + 3 servers, 64 buckets).

    python benchmarks/server_step_cpu.py                  # 40,000 examples (78 steps)
    python benchmarks/server_step_cpu.py 60000 ps0.raw    # and py-spy raw samples of ps0

Measured as the servers' CPU (utime + stime of every thread, /proc/PID/stat) over the replica's
steps, divided by the steps and the 3 servers: on a shared machine the CPU a step costs is
comparable where its wall time is not. "net" subtracts the servers' idle rate (measured for 6 s
before the steps) times the steps' wall time. Compare before and after back to back.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import secrets
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# First, even when PYTHONPATH names it too: sys.path[0] is benchmarks/, whose trainer.py would
# shadow the trainer package in the replica processes.
sys.path.insert(0, str(ROOT))

import benchmarks.practitioner as P  # noqa: E402

BATCH = 512


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 40_000
    profile = sys.argv[2] if len(sys.argv) > 2 else ""
    s = replace(
        P.Setting("ctr", optimizer="adagrad", lr=0.05, examples=n, extra={"test": 2000}),
        batch=BATCH, replicas=1,
    )  # fmt: skip
    token = secrets.token_hex(16)
    cluster = P.start_cluster(3, Path(tempfile.mkdtemp(prefix="server_step_cpu")), token)
    try:
        import adamps.torch as at

        conn = {"controllers": cluster.controllers, "run": "bench-ctr", "token": token}
        at.DownpourOptimizer(
            P.build_model(s, False), controllers=cluster.controllers, run=conn["run"],
            token=token, lr=s.lr, optimizer=s.optimizer, create=True,
        ).close()  # fmt: skip
        time.sleep(3.0)  # placement's aftermath settles
        ps = {k: p.popen.pid for k, p in cluster.procs.items() if k.startswith("ps")}

        def cpu() -> float:
            return sum(P.proc_cpu_s(pid) for pid in ps.values())

        c0, t0 = cpu(), time.monotonic()
        time.sleep(6.0)
        idle = (cpu() - c0) / (time.monotonic() - t0)
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        proc = ctx.Process(target=P.replica, args=(s, 0, conn, None, out))
        c0, t0 = cpu(), time.monotonic()
        proc.start()
        spy = None
        if profile:
            time.sleep(4.0)  # the replica's imports and first pulls
            spy = subprocess.Popen(
                ["py-spy", "record", "-p", str(ps["ps0"]), "-d", "25", "-r", "50",
                 "-f", "raw", "-o", profile],
            )  # fmt: skip
        res = out.get()
        used, wall = cpu() - c0, time.monotonic() - t0
        proc.join()
        if spy is not None:
            spy.wait()
        if "error" in res:
            raise RuntimeError(res["error"])
        steps = res["examples"] // BATCH
        gross = used / steps / len(ps) * 1000
        net = (used - idle * wall) / steps / len(ps) * 1000
        print(
            f"steps {steps}: servers {used:.2f} CPU-s over {wall:.1f} s (idle {idle:.3f} CPU-s/s);"
            f" per step per server {gross:.1f} ms gross, {net:.1f} ms net of idle;"
            f" load average {os.getloadavg()[0]:.1f}; AUC {res['metric']:.4f}"
        )
    finally:
        cluster.stop()


if __name__ == "__main__":
    main()
