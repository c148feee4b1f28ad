"""`adamps up --algorithm sandblaster` on two source trees in turn (issue 39 #19): wall time
per L-BFGS iteration, the trainers' compute against their whole run, and the CPU seconds of
every role, sampled from /proc while the run lasts.

    python benchmarks/sandblaster_ab.py --tree /tmp/sb-old --tree . [--iterations 10] [--rounds 2]

A tree is a checkout of this repository (e.g. ``git worktree add /tmp/sb-old <commit>``); each
run is ``python -m adamps up`` with that tree first on PYTHONPATH. The runs alternate (A, B, A,
B, ...), so a machine whose load drifts affects both alike. Two figures are robust to a load
shared by both: ``train_per_compute`` (a trainer's whole run divided by the seconds it spent in
its own numpy work: the share of its time spent waiting for the cluster), and CPU seconds per
iteration per role (what the cluster costs on a machine with few cores). The last line is one
JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _cpu_seconds(pid: int) -> float | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def one_run(tree: str, iterations: int, run_dir: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": os.path.abspath(tree)}
    argv = [
        sys.executable, "-m", "adamps", "up", "--algorithm", "sandblaster",
        "--iterations", str(iterations), "--no-progress", "--target-accuracy", "0",
        "--run-dir", str(run_dir),
    ]  # fmt: skip
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, cwd=tree, env=env, stdout=subprocess.DEVNULL)
    cpu: dict[str, float] = {}  # the last reading of each process while alive
    while proc.poll() is None:
        try:
            pids = json.loads((run_dir / "pids.json").read_text())
        except (OSError, ValueError):
            pids = {}
        for name, pid in pids.items():
            got = _cpu_seconds(int(pid))
            if got is not None:
                cpu[name] = got
        time.sleep(0.5)
    wall = time.monotonic() - t0
    times = [json.loads(line)["time"] for line in open(run_dir / "iterations.jsonl")]
    trainers = [
        json.loads(line)
        for f in sorted((run_dir / "logs").glob("train*.log"))
        for line in open(f)
        if '"algorithm": "sandblaster"' in line
    ]
    roles: dict[str, float] = {}
    for name, secs in cpu.items():
        role = name.rstrip("0123456789")
        roles[role] = roles.get(role, 0.0) + secs
    return {
        "rc": proc.returncode,
        "wall_s": round(wall, 1),
        "s_per_iteration": round((times[-1] - times[0]) / max(1, len(times) - 1), 2),
        "train_per_compute": round(
            statistics.mean(t["seconds"] / t["compute_seconds"] for t in trainers), 2
        ),
        "cpu_s_per_iteration": {k: round(v / len(times), 2) for k, v in sorted(roles.items())},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree", action="append", required=True, help="a checkout (repeat: 2)")
    ap.add_argument("--iterations", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="sandblaster-ab-"))
    out: dict[str, list[dict]] = {t: [] for t in a.tree}
    for r in range(a.rounds):
        for i, tree in enumerate(a.tree):
            res = one_run(tree, a.iterations, root / f"r{r}-t{i}")
            out[tree].append(res)
            print(f"round {r} {tree}: {json.dumps(res)}", flush=True)
    summary = {
        tree: {
            "s_per_iteration": statistics.median(x["s_per_iteration"] for x in runs),
            "train_per_compute": statistics.median(x["train_per_compute"] for x in runs),
        }
        for tree, runs in out.items()
    }
    print(json.dumps({"iterations": a.iterations, "runs": out, "median": summary}))


if __name__ == "__main__":
    main()
