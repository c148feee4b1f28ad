"""Held-out accuracy against wall time for the three consistency modes (issue 25), as
DistBelief's figure 4 plots its methods: the same model (adam-mnist), data (built-in, 4,000 /
1,000 digits), replicas and hyper-parameters, one run per mode, each on a fresh parameter server
and data server started as real processes.

    python benchmarks/consistency.py [--replicas 2] [--epochs 4] [--batch 16] [--ssp 2]
        [--png docs/consistency.png]

Every replica steps once per minibatch (--workers 1 --n-push 1; async also fetches every
step, --n-fetch 1), with server-side Adagrad. The limit each mode is compared against is
measured in the same run: async (Downpour), the mode that never waits. Printed per mode: the
accuracy per epoch, the training wall time, steps per second, and its ratio to async's; the
last line is one JSON object. The PNG is drawn with matplotlib's object API (as adamps/up/plot.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from adamps.up.procs import Proc, adamps_argv, free_port  # noqa: E402


def run_mode(mode: str, args: argparse.Namespace, root: Path) -> dict:
    env = {"ADAMPS_TOKEN": "bench-token", "OPENBLAS_NUM_THREADS": "1"}
    procs: list[Proc] = []
    try:
        ps_port, ds_port = free_port(), free_port()
        ps = Proc(adamps_argv("ps", "--port", str(ps_port), "--data-dir", str(root / "ps"),
                              "--no-lmdb-sync"), root / "ps.log", env=env, name="ps")  # fmt: skip
        procs.append(ps)
        ds = Proc(adamps_argv("dataserver", "--port", str(ds_port), "--no-augment"),
                  root / "ds.log", env=env, name="ds")  # fmt: skip
        procs.append(ds)
        ps.wait_http(f"http://127.0.0.1:{ps_port}/healthz", 60)
        ds.wait_http(f"http://127.0.0.1:{ds_port}/healthz", 60)
        common = [
            "train", "--ps", f"http://127.0.0.1:{ps_port}",
            "--dataservers", f"http://127.0.0.1:{ds_port}", "--consistency", mode,
            "--n-replicas", str(args.replicas), "--epochs", str(args.epochs),
            "--batch-size", str(args.batch), "--workers", "1", "--n-push", "1", "--n-fetch", "1",
            "--warm-start", "0", "--metrics-port", "-1", "--run", "bench",
        ]  # fmt: skip
        history = root / "history.jsonl"
        t0 = time.time()
        trainers = [
            Proc(
                adamps_argv(
                    *common, "--replica", str(r), *(["--history", str(history)] if r == 0 else [])
                ),
                root / f"train{r}.log",
                env=env,
                name=f"train{r}",
            )  # fmt: skip
            for r in range(args.replicas)
        ]
        procs += trainers
        for p in trainers:
            p.popen.wait(args.timeout)
            if p.returncode != 0:
                raise RuntimeError(f"{mode}: {p.name} exited with {p.returncode}:\n{p.tail()}")
        wall = time.time() - t0
        summaries = [json.loads(p.log_path.read_text().strip().splitlines()[-1]) for p in trainers]
        recs = [json.loads(x) for x in history.read_text().splitlines()]
        train_s = max(s["seconds"] for s in summaries)
        steps = sum(s["images"] for s in summaries) / args.batch  # minibatches
        return {
            "mode": mode,
            "points": [(0.0, args.initial_acc)] + [(r["time"] - t0, r["accuracy"]) for r in recs],
            "acc": [r["accuracy"] for r in recs],
            "train_s": train_s,
            "wall_s": wall,
            "steps_per_s": steps / train_s,
        }
    finally:
        for p in reversed(procs):
            p.stop(5)


def initial_accuracy() -> float:
    """Held-out accuracy of the weights every run starts from (--seed 0): the curves' t = 0."""
    from trainer.local import builtin_data
    from trainer.model import Model, resolve_spec

    _, _, test_x, test_y = builtin_data()
    m = Model(resolve_spec("adam-mnist"))
    m.init_params(0)
    return m.accuracy(m.prepare(test_x), test_y)


def plot(path: Path, runs: list[dict], title: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    for run in runs:
        xs, ys = zip(*run["points"], strict=True)
        ax.plot(xs, [100 * y for y in ys], marker="o", label=run["mode"])
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel("held-out accuracy (%)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--ssp", type=int, default=2, help="S of the ssp:S run")
    parser.add_argument("--png", default=str(ROOT / "docs" / "consistency.png"))
    parser.add_argument("--timeout", type=float, default=900)
    args = parser.parse_args(argv)
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    args.initial_acc = initial_accuracy()
    runs = []
    for mode in ("async", f"ssp:{args.ssp}", "sync"):
        with tempfile.TemporaryDirectory(prefix="adamps-consistency-") as tmp:
            runs.append(run_mode(mode, args, Path(tmp)))
    base = runs[0]
    title = (
        f"adam-mnist, built-in data, {args.replicas} replicas, batch {args.batch}, "
        f"a step per minibatch, server Adagrad"
    )
    print(title)
    print(
        f"held-out accuracy of the initial weights (t = 0 of every curve): {args.initial_acc:.3f}"
    )
    for r in runs:
        print(
            f"{r['mode']:>6}: held-out accuracy per epoch "
            + ", ".join(f"{a * 100:.1f}%" for a in r["acc"])
            + f"; training {r['train_s']:.1f} s, {r['steps_per_s']:.1f} steps/s | async "
            f"{base['steps_per_s']:.1f} steps/s | ratio {r['steps_per_s'] / base['steps_per_s']:.2f}"
        )
    plot(Path(args.png), runs, title)
    print(f"plot: {args.png}")
    print(json.dumps({
        "replicas": args.replicas, "epochs": args.epochs, "batch": args.batch,
        "initial_acc_pct": round(args.initial_acc * 100, 2),
        "modes": {
            r["mode"]: {
                "heldout_acc_pct": [round(a * 100, 2) for a in r["acc"]],
                "train_s": round(r["train_s"], 2),
                "steps_per_s": round(r["steps_per_s"], 2),
                "ratio_steps_to_async": round(r["steps_per_s"] / base["steps_per_s"], 3),
            }
            for r in runs
        },
    }))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
