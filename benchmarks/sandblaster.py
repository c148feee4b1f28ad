"""Sandblaster L-BFGS (DistBelief 4.2, issue 14), measured with real processes on this machine:
3 controllers and 3 parameter servers on loopback, a coordinator, trainers.

    python benchmarks/sandblaster.py [--trainers 3] [--slowdown 4] [--budget 120]
        [--iterations 2] [--png docs/sandblaster.png] [--skip-figure4]

1. Backup tasks: one trainer of ``--trainers`` runs ``--slowdown`` times slower. Images/s per
   batch (median over the evaluations after the first, then over ``--rounds`` rounds of the
   three cases run in turn) with backup tasks, without them, and with no straggler. Goal: with
   backup tasks >= 0.8 of no straggler.
2. DistBelief figure 4's comparison on adam-mnist from the same initial weights (seed 0):
   held-out accuracy against wall time and against CPU seconds (every process of the cluster,
   sampled from /proc) for one-replica SGD, Downpour with Adagrad (2 replicas) and Sandblaster
   L-BFGS (2 trainers), each given ``--budget`` seconds. The benchmark samples the accuracy by
   pulling the servers' parameters (its own CPU is not counted). Drawn to ``--png``.
3. Bytes on the network per L-BFGS iteration: the coordinator's (to and from the servers, and
   its trainer API) and the trainers'.

The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from adamps.client.ps import ControllerRouting, PSClient  # noqa: E402
from adamps.layout import Layout, TensorSpec  # noqa: E402
from adamps.up.cluster import LocalCluster, http_json  # noqa: E402
from adamps.up.procs import free_port  # noqa: E402
from dataserver.sources import builtin_mnist  # noqa: E402
from trainer.model import Model, builtin  # noqa: E402

TOKEN = "bench-sandblaster-token"
N_BUCKETS = 16


def cpu_seconds(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def new_cluster(root: Path) -> LocalCluster:
    c = LocalCluster(root, token=TOKEN, n_servers=3, n_buckets=N_BUCKETS,
                     env={"OPENBLAS_NUM_THREADS": "1"})  # fmt: skip
    c.start(timeout=120)
    return c


def coordinator(c: LocalCluster, **opts: Any) -> str:
    port = free_port()
    flags = {"controllers": ",".join(c.controllers), "port": port, "n-buckets": N_BUCKETS,
             "model": "adam-mnist", "run": "bench", **opts}  # fmt: skip
    args: list[str] = []
    for k, v in flags.items():  # booleans are --flag / --no-flag
        args += [f"--{k}" if v else f"--no-{k}"] if isinstance(v, bool) else [f"--{k}", str(v)]
    c.start_process("coordinator", "coordinator", *args).wait_http(
        f"http://127.0.0.1:{port}/healthz", 120
    )
    return f"http://127.0.0.1:{port}"


def status(url: str) -> dict[str, Any]:
    code, body = http_json(f"{url}/status", timeout=5.0)
    return body if code == 200 else {}


def sb_trainer(c: LocalCluster, coord: str, i: int, slowdown: float = 1.0) -> None:
    c.start_process(f"train{i}", "train", "--controllers", ",".join(c.controllers),
                    "--coordinator", coord, "--replica", str(i), "--n-replicas", "16",
                    "--metrics-port", "-1", "--slowdown", str(slowdown))  # fmt: skip


def wait_done(url: str, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    st: dict[str, Any] = {}
    while time.monotonic() < deadline:
        st = status(url) or st
        if st.get("stopped") or st.get("error"):
            return st
        time.sleep(0.5)
    return st


# -- 1. backup tasks -------------------------------------------------------------------------


def backup_tasks(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """The three cases in rounds (A, B, C, A, B, C, ...) on one cluster, each a run of its own
    (its own tensors), so that a shared machine's drift hits every case alike; per case the
    median over rounds of each run's median images/s per batch."""
    cases = [
        ("no_straggler", 1.0, True),
        ("straggler_without_backup", args.slowdown, False),
        ("straggler_with_backup", args.slowdown, True),
    ]
    rates: dict[str, list[float]] = {name: [] for name, _, _ in cases}
    counts: dict[str, dict[str, int]] = {
        n: {"evals": 0, "backups": 0, "duplicates": 0} for n in rates
    }
    c = new_cluster(root / "backup")
    try:
        for rnd in range(args.rounds):
            for ci, (name, slow, backup) in enumerate(cases):
                url = coordinator(c, **{"max-iter": args.iterations, "portions": args.portions,
                                        "backup": backup, "gtol": 0, "m": 3,
                                        "run": f"b{rnd}c{ci}"})  # fmt: skip
                for i in range(args.trainers):
                    sb_trainer(c, url, i, slow if i == 0 else 1.0)
                st = wait_done(url, 900)
                for i in range(args.trainers):
                    c.stop_process(f"train{i}")
                c.stop_process("coordinator")
                evals = st.get("evals", [])[1:] or st.get("evals", [])
                r = [e["images"] / e["seconds"] for e in evals if e["seconds"] > 0]
                if r:
                    rates[name].append(statistics.median(r))
                counts[name]["evals"] += len(evals)
                counts[name]["backups"] += sum(e["backups"] for e in evals)
                counts[name]["duplicates"] += sum(e["duplicates"] for e in evals)
                print(f"backup tasks: round {rnd} {name}: {round(rates[name][-1], 1) if r else None} "
                      f"images/s per batch", flush=True)  # fmt: skip
    finally:
        c.stop()
    out: dict[str, Any] = {}
    for name in rates:
        out[name] = {
            "images_per_s": round(statistics.median(rates[name]), 1) if rates[name] else None,
            "rounds": [round(x, 1) for x in rates[name]],
            **counts[name],
        }
    base = out["no_straggler"]["images_per_s"] or 0
    for name in ("straggler_without_backup", "straggler_with_backup"):
        r = out[name]["images_per_s"]
        out[name]["of_no_straggler"] = round(r / base, 3) if r and base else None
    out["goal"] = ">= 0.8 of no straggler with backup tasks"
    print(f"backup tasks: {out}", flush=True)
    return out


# -- 2. figure 4 -----------------------------------------------------------------------------


class Sampler:
    """Held-out accuracy of the servers' parameters, wall and CPU seconds of the cluster."""

    def __init__(self, c: LocalCluster, prefix: str = "") -> None:
        self.c = c
        self.model = Model(builtin("adam-mnist"))
        _, _, vx, vy = builtin_mnist()
        self.x, self.y = self.model.prepare(vx), vy
        specs = [TensorSpec(prefix + n, s) for n, s in self.model.tensors()]
        self.names = [s.name for s in specs]
        self.prefix = prefix
        self.client = PSClient(ControllerRouting(c.controllers), Layout(specs, N_BUCKETS),
                               TOKEN, retry_for=5.0)  # fmt: skip
        self.t0 = time.monotonic()
        self.points: list[dict[str, float]] = []

    def sample(self) -> None:
        try:
            values, _ = self.client.pull(self.names)
        except Exception:  # noqa: BLE001 - not created yet
            return
        for n in self.names:
            self.model.param(n[len(self.prefix) :])[...] = values[n]
        pids = [p.pid for p in self.c.procs.values() if p.alive]
        self.points.append({
            "wall_s": round(time.monotonic() - self.t0, 2),
            "cpu_s": round(cpu_seconds(pids), 2),
            "accuracy": round(self.model.accuracy(self.x, self.y), 4),
        })  # fmt: skip


def figure4(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    runs: dict[str, Any] = {}
    for algo in ("sgd_1_replica", "downpour_adagrad", "sandblaster_lbfgs"):
        c = new_cluster(root / algo)
        extra: dict[str, Any] = {}
        try:
            sampler = Sampler(c, "sb.bench." if algo == "sandblaster_lbfgs" else "")
            if algo == "sandblaster_lbfgs":
                url = coordinator(c, **{"max-iter": 1000, "portions": args.portions})
                for i in range(2):
                    sb_trainer(c, url, i)
            else:
                ds = c.start_dataserver("--source", "builtin", "--no-augment")
                c.procs["dataserver0"].wait_http(f"http://{ds}/healthz", 120)
                n = 1 if algo == "sgd_1_replica" else 2
                opt = (
                    ["--optimizer", "sgd", "--lr", "0.05"] if n == 1 else ["--optimizer", "adagrad"]
                )
                for r in range(n):
                    c.start_process(
                        f"train{r}", "train", "--controllers", ",".join(c.controllers),
                        "--dataservers", f"http://{ds}", "--replica", str(r), "--n-replicas", str(n),
                        "--epochs", "1000", "--worker-mode", "thread", "--metrics-port", "-1", *opt,
                    )  # fmt: skip
            deadline = time.monotonic() + args.budget
            while time.monotonic() < deadline:
                time.sleep(args.sample)
                sampler.sample()
            if algo == "sandblaster_lbfgs":
                st = status(url)
                extra = {"iterations": st.get("iteration"), "per_iteration": st.get("per_iteration"),
                         "shards": st.get("shards"), "params": st.get("params")}  # fmt: skip
            sampler.client.close()
        finally:
            c.stop()
        if algo == "sandblaster_lbfgs":
            sums = []
            for i in range(2):
                log = (root / algo / "logs" / f"train{i}.log").read_text().strip().splitlines()
                lines = [ln for ln in log if ln.startswith("{")]
                if lines:
                    sums.append(json.loads(lines[-1]))
            extra["trainers"] = sums
        runs[algo] = {"points": sampler.points, **extra}
        last = sampler.points[-1] if sampler.points else {}
        print(f"figure 4: {algo}: final {last}", flush=True)
    return runs


def draw(runs: dict[str, Any], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for algo, r in runs.items():
        pts = r["points"]
        a.plot([p["wall_s"] for p in pts], [p["accuracy"] for p in pts], label=algo)
        b.plot([p["cpu_s"] for p in pts], [p["accuracy"] for p in pts], label=algo)
    a.set_xlabel("wall time (s)")
    b.set_xlabel("CPU seconds (all processes)")
    for ax in (a, b):
        ax.set_ylabel("held-out accuracy")
        ax.set_ylim(0, 1)
        ax.legend(loc="lower right", fontsize="small")
    fig.suptitle("adam-mnist on the built-in data (DistBelief figure 4's comparison)")
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=100)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trainers", type=int, default=3)
    p.add_argument("--slowdown", type=float, default=4.0)
    p.add_argument("--portions", type=int, default=40)
    p.add_argument("--iterations", type=int, default=2, help="L-BFGS iterations per backup case")
    p.add_argument("--rounds", type=int, default=3, help="rounds of the three backup cases")
    p.add_argument("--budget", type=float, default=120.0, help="seconds per figure-4 algorithm")
    p.add_argument("--sample", type=float, default=5.0, help="seconds between accuracy samples")
    p.add_argument("--png", default=str(ROOT / "docs" / "sandblaster.png"))
    p.add_argument("--skip-figure4", action="store_true")
    args = p.parse_args(argv)
    result: dict[str, Any] = {"machine_cores": os.cpu_count()}
    with tempfile.TemporaryDirectory(prefix="bench-sandblaster-") as tmp:
        root = Path(tmp)
        result["backup_tasks"] = backup_tasks(args, root)
        if not args.skip_figure4:
            runs = figure4(args, root)
            draw(runs, Path(args.png))
            result["figure4"] = {
                algo: {"final": r["points"][-1] if r["points"] else None,
                       "points": r["points"]} for algo, r in runs.items()
            }  # fmt: skip
            sb = runs["sandblaster_lbfgs"]
            iters = max(1, sb.get("iterations") or 1)
            per = sb.get("per_iteration") or []
            result["bytes_per_iteration"] = {
                "params": sb.get("params"),
                "vector_bytes": 4 * (sb.get("params") or 0),
                "shards": sb.get("shards"),
                "coordinator_ps": int(np.median([x["ps_bytes_sent"] + x["ps_bytes_received"]
                                                 for x in per])) if per else None,
                "coordinator_api": int(np.median([x["api_bytes"] for x in per])) if per else None,
                "trainers": int(sum(t["bytes_sent"] + t["bytes_received"]
                                    for t in sb.get("trainers", [])) / iters),
            }  # fmt: skip
            result["png"] = args.png
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
