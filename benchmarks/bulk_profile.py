"""Where a bulk load's time goes (issue 38, item 3): py-spy profiles of the 3 servers of an RF 3
cluster while one client loads --rows rows of --dim (Adagrad) in requests of 100,000 ids, by
``push_rows`` (gradients of new rows: `embeddings.py --only-load`'s ``bulk_load_rows_per_s``) or
``put_rows`` (values: ``adamps table load``'s path).

Prints the rows per second the client saw, the servers' and the client's CPU seconds over the
load and the flush that follows (from /proc: load-independent, where the rows per second are
not), and, over the 3 servers, the frames most often on the stack (py-spy ``--format raw``
samples, each frame counted once per sample: inclusive) of the owner threads (the row store),
the flusher and the rest. py-spy's idle detection does not work in this container (a thread
waiting is sampled as active, benchmarks/profile_cluster.py): the waits (select, a condition
wait) are in "the rest".

    python benchmarks/bulk_profile.py [--rows 500000] [--dim 16] [--op push|put] [--top 12]
        [--no-spy]

py-spy is a benchmark-only dependency (`pip install 'adamps[bench]'`).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.append(str(ROOT / "benchmarks"))

from replication import N_BUCKETS, TOKEN  # noqa: E402
from replication import cluster as start_cluster  # noqa: E402

from adamps.client.ps import ControllerRouting, PSClient  # noqa: E402
from adamps.layout import Layout  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")
PUSH = 100_000
#: frames that every sample of a thread has (the process's and the thread's entry)
BORING = ("threading.py", "runpy", "adamps/cli.py", "adamps/role.py", "__main__", "main.py:")


def cpu_s(pid: int) -> float:
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / TICK


def top_frames(files: list[Path], top: int) -> dict[str, list[tuple[int, str]]]:
    """Per thread group (owners, flusher, the rest): the most frequent frames, inclusive."""
    groups: dict[str, Counter[str]] = {"owner": Counter(), "flusher": Counter(), "rest": Counter()}
    totals: Counter[str] = Counter()
    for f in files:
        for line in f.read_text().splitlines():
            if not line.strip():
                continue
            stack, n = line.rsplit(" ", 1)
            thread, *frames = stack.split(";")
            g = "owner" if "owner" in thread else "flusher" if "flusher" in thread else "rest"
            totals[g] += int(n)
            for fr in set(frames):
                if not any(b in fr for b in BORING):
                    groups[g][fr] += int(n)
    return {f"{g} ({totals[g]} samples)": c.most_common(top) for g, c in groups.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=500_000)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--op", choices=("push", "put"), default="push")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--no-spy", action="store_true", help="the CPU seconds only")
    args = ap.parse_args()
    spy = None if args.no_spy else shutil.which("py-spy")
    root = Path(tempfile.mkdtemp(prefix="adamps-bulk-profile-"))
    c = start_cluster(str(root / "rf3"), 3, 262_144)
    spies: list[subprocess.Popen] = []
    try:
        pids = [p.popen.pid for n, p in c.procs.items() if n.startswith("ps")]
        with PSClient(ControllerRouting(c.controllers), Layout([], n_buckets=N_BUCKETS), TOKEN,
                      timeout=120.0) as client:  # fmt: skip
            client.create_table("load", args.dim, init={"kind": "normal", "std": 0.01, "seed": 1},
                                optimizer={"kind": "adagrad", "lr": 0.1})  # fmt: skip
            ids = np.random.default_rng(0).permutation(args.rows).astype(np.int64) * 7919 + 13
            rows = np.full((PUSH, args.dim), 1e-3, np.float32)
            send = client.push_rows if args.op == "push" else client.put_rows
            if spy:
                for pid in pids:
                    out = root / f"ps{pid}.txt"
                    cmd = [spy, "record", "--pid", str(pid), "--format", "raw", "--threads",
                           "--nonblocking", "-r", "50", "-o", str(out)]  # fmt: skip
                    spies.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL,
                                                  stderr=subprocess.DEVNULL))  # fmt: skip
                time.sleep(1.0)
            cpu0, me0 = sum(cpu_s(p) for p in pids), time.process_time()
            t0 = time.perf_counter()
            for s in range(0, args.rows, PUSH):
                send("load", ids[s : s + PUSH], rows[: len(ids[s : s + PUSH])])
            took = time.perf_counter() - t0
            for i in range(len(c.servers)):
                c.flush_server(i, timeout=300)
            cpu = sum(cpu_s(p) for p in pids) - cpu0
        print(
            f"{args.op}_rows of {args.rows:,} rows, dim {args.dim}, RF 3: "
            f"{args.rows / took:,.0f} rows/s; CPU over the load and its flush: servers "
            f"{cpu:.2f} s ({cpu / args.rows * 1e6:.2f} us a row), client "
            f"{time.process_time() - me0:.2f} s; load average {os.getloadavg()[0]:.1f}"
        )
    finally:
        for p in spies:
            p.send_signal(2)
        for p in spies:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
        c.stop()
    files = [f for f in root.glob("ps*.txt") if f.stat().st_size]
    for group, frames in top_frames(files, args.top).items() if files else ():
        print(f"-- {group}")
        for fr, n in frames:
            print(f"  {n:6d}  {fr}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
