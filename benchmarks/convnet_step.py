"""The convnet's cost through adamps.torch alone: ``benchmarks/practitioner.py``'s convnet setting
(2 replicas, RF 3, batch 32, SGD lr 0.05, 3 controllers + 3 servers) against plain PyTorch in the
same run, and where one trainer step's CPU goes.

    python benchmarks/convnet_step.py                  # ratios: whole cluster and trainers alone
    python benchmarks/convnet_step.py --epochs 2       # longer (the quick run is 1 epoch)
    python benchmarks/convnet_step.py --profile 200    # cProfile of one trainer's 200 steps (CPU)

Ratios are examples per CPU-second (utime + stime from /proc, every thread, every process of the
cluster) of adamps over plain PyTorch, as practitioner.py counts them; the load average is
printed with them (compare figures only as alternated pairs on a shared machine). ``--profile``
runs one replica in this process under cProfile with a CPU-time clock (a wall clock would put
the waits for the servers on top) and prints its top functions by own time and by total.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import secrets
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # before benchmarks/, whose trainer.py shadows the package

import benchmarks.practitioner as P  # noqa: E402

CONV = P.Setting("convnet", batch=32, epochs=1, optimizer="sgd", lr=0.05)


def ratios(epochs: int) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="adamps-convnet-"))
    load0 = os.getloadavg()[0]
    plain = P.run_setting(replace(CONV, epochs=epochs, replicas=0), tmp)
    r = P.run_setting(replace(CONV, epochs=epochs, replicas=2), tmp)
    rate = plain["examples"] / plain["cluster_cpu_s"]
    c = r["examples"] / r["cluster_cpu_s"] / rate
    t = r["examples"] / r["trainer_cpu_s"] / rate
    print(
        f"plain {rate:,.0f} ex/CPU-s; adamps 2 rep RF 3: trainers {r['trainer_cpu_s']:.2f} CPU-s, "
        f"servers+controllers {r['servers_cpu_s']:.2f} CPU-s for {r['examples']} ex, "
        f"wall {r['wall_s']:.1f} s"
    )
    print(
        f"convnet_rf3_2rep_cluster_ratio {c:.3f} trainers_ratio {t:.3f} "
        f"load {load0:.2f} -> {os.getloadavg()[0]:.2f}",
        flush=True,
    )


def profile(steps: int, top: int, spy_out: str) -> None:
    import torch

    import adamps.torch as at

    torch.set_num_threads(1)
    token = secrets.token_hex(16)
    cluster = P.start_cluster(3, Path(tempfile.mkdtemp(prefix="adamps-convnet-")), token)
    try:
        model = P.build_model(CONV, False)
        opt = at.DownpourOptimizer(
            model, controllers=cluster.controllers, run="prof", token=token, lr=CONV.lr,
            optimizer="sgd", create=True,
        )  # fmt: skip
        lossf = P.loss_fn(CONV)
        x, y, _, _ = P.image_data()

        def run(n: int) -> None:
            for i in range(n):
                j = (i * 32) % (len(y) - 32)
                opt.zero_grad()
                lossf(model(x[j : j + 32]), y[j : j + 32]).backward()
                opt.step()

        run(20)  # warm: connections, buffers
        ps = {k: p.popen.pid for k, p in cluster.procs.items()}
        s0 = {k: P.proc_cpu_s(pid) for k, pid in ps.items()}
        spy = None
        if spy_out:
            spy = subprocess.Popen(
                ["py-spy", "record", "-p", str(ps["ps0"]), "-d", "10", "-r", "100",
                 "-f", "raw", "-o", spy_out], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip
        prof = cProfile.Profile(time.process_time)
        c0, t0 = time.process_time(), time.perf_counter()
        prof.enable()
        run(steps)
        prof.disable()
        cpu, wall = time.process_time() - c0, time.perf_counter() - t0
        s1 = {k: P.proc_cpu_s(pid) for k, pid in ps.items()}
        opt.close()
        if spy is not None:
            spy.wait()
    finally:
        cluster.stop()
    print(
        f"{steps} steps: trainer {1000 * cpu / steps:.2f} ms CPU, {1000 * wall / steps:.2f} ms "
        f"wall a step (profiled); load {os.getloadavg()[0]:.2f}"
    )
    per = {k: 1000 * (s1[k] - s0[k]) / steps for k in s1}
    print("cluster CPU ms a step: " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(per.items())))
    for key in ("tottime", "cumulative"):
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats(key).print_stats(top)
        print(s.getvalue())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--profile", type=int, default=0, help="steps of one trainer under cProfile")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--spy", default="", help="with --profile: py-spy raw samples of ps0 here")
    a = ap.parse_args()
    if a.profile:
        profile(a.profile, a.top, a.spy)
    else:
        ratios(a.epochs)


if __name__ == "__main__":
    main()
