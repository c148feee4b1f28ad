"""Held-out accuracy and throughput of asynchronous multi-replica adamps (Downpour SGD with
server-side Adagrad), run as real processes on this machine: 1 parameter server (static bucket
map), 1 data server (built-in data: 4,000 train / 1,000 held-out real MNIST digits) and
``--replicas`` `adamps train` processes. This is the cluster row of benchmarks/accuracy.py's
table (Project Adam's Table 1 comparison).

    python benchmarks/accuracy_cluster.py [--epochs 5] [--replicas 2] [--workers 1]
        [--optimizer adagrad] [--lr 0.01] [--batch 8] [--n-push 4] [--n-fetch 8] [--augment]
        [--http-only]

In the same run it measures the limit the cluster's images/s is compared against: the same
model trained in one process by trainer.local (plain SGD, one worker, the same batch size;
helper-1's single-process trainer), and prints both and the ratio. The data server does not
augment unless --augment (the local baseline does not augment either). The last line is one
JSON object.
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


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a live process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return round((int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), 2)


def run_cluster(args: argparse.Namespace, root: Path) -> dict:
    env = {"ADAMPS_TOKEN": "bench-token", "OPENBLAS_NUM_THREADS": "1"}
    procs: list[Proc] = []
    try:
        ps_port, ds_port = free_port(), free_port()
        # With a data port, as `adamps up` starts servers: the trainers pull and push dense
        # deltas over it (--http-only: no data port, the trainers use HTTP).
        dp = [] if args.http_only else ["--data-port", str(free_port())]
        ps = Proc(adamps_argv("ps", "--port", str(ps_port), "--data-dir", str(root / "ps"),
                              "--no-lmdb-sync", *dp), root / "ps.log", env=env, name="ps")  # fmt: skip
        procs.append(ps)
        ds_args = ["dataserver", "--port", str(ds_port), "--source", "builtin"]
        if not args.augment:
            ds_args.append("--no-augment")
        ds = Proc(adamps_argv(*ds_args), root / "ds.log", env=env, name="dataserver")
        procs.append(ds)
        ps.wait_http(f"http://127.0.0.1:{ps_port}/healthz", 60)
        ds.wait_http(f"http://127.0.0.1:{ds_port}/healthz", 60)
        common = [
            "train", "--ps", f"http://127.0.0.1:{ps_port}",
            "--dataservers", f"http://127.0.0.1:{ds_port}",
            "--n-replicas", str(args.replicas), "--epochs", str(args.epochs),
            "--batch-size", str(args.batch), "--workers", str(args.workers),
            "--optimizer", args.optimizer, "--lr", str(args.lr), "--local-lr", str(args.local_lr),
            "--adagrad-initial", str(args.adagrad_initial),
            "--n-push", str(args.n_push), "--n-fetch", str(args.n_fetch),
            "--warm-start", str(args.warm_start), "--metrics-port", "-1",
        ]  # fmt: skip
        t0 = time.monotonic()
        trainers = []
        for r in range(args.replicas):
            extra = ["--replica", str(r)]
            if r == 0:
                extra += [
                    "--history",
                    str(root / "history.jsonl"),
                    "--out",
                    str(root / "model.npz"),
                ]
            p = Proc(
                adamps_argv(*common, *extra), root / f"train{r}.log", env=env, name=f"train{r}"
            )
            procs.append(p)
            trainers.append(p)
        for p in trainers:
            p.popen.wait(args.timeout)
        wall = time.monotonic() - t0
        cpu = {"ps": _cpu_seconds(ps.pid), "dataserver": _cpu_seconds(ds.pid)}
        summaries = []
        for p in trainers:
            if p.returncode != 0:
                raise RuntimeError(f"{p.name} exited with {p.returncode}:\n{p.tail()}")
            summaries.append(json.loads(p.log_path.read_text().strip().splitlines()[-1]))
        history = [json.loads(x) for x in (root / "history.jsonl").read_text().splitlines()]
        images = sum(s["images"] for s in summaries)
        train_s = max(s["seconds"] for s in summaries)
        return {
            "per_epoch_acc": [h["accuracy"] for h in history],
            "acc": summaries[0]["heldout_accuracy"][str(args.epochs)],
            "images": images,
            "train_s": train_s,
            "wall_s": wall,
            "images_per_s": images / train_s,
            "cpu_s": {
                **cpu,
                "trainer_main": round(sum(s["cpu_main_s"] for s in summaries), 2),
                "trainer_workers": round(sum(s["cpu_workers_s"] for s in summaries), 2),
            },
        }
    finally:
        for p in reversed(procs):
            p.stop(5)


def run_local(args: argparse.Namespace) -> dict:
    from trainer.local import train_local

    cpu0 = time.process_time()
    _, res = train_local("adam-mnist", epochs=args.local_epochs, batch=args.batch, lr=args.local_lr)
    cpu = time.process_time() - cpu0  # includes the held-out evaluations (small)
    images = sum(r.images for r in res)
    secs = sum(r.seconds for r in res)
    return {
        "acc": res[-1].accuracy,
        "images_per_s": images / secs,
        "images_per_cpu_s": images / cpu,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--optimizer", default="adagrad", choices=("adagrad", "sgd"))
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--adagrad-initial", type=float, default=0.1)
    parser.add_argument("--local-lr", type=float, default=0.03)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--n-push", type=int, default=4)
    parser.add_argument("--n-fetch", type=int, default=8)
    parser.add_argument("--warm-start", type=int, default=100)
    parser.add_argument("--augment", action="store_true")
    parser.add_argument("--http-only", action="store_true",
                        help="the PS gets no data port: trainers pull and push over HTTP")  # fmt: skip
    parser.add_argument("--local-epochs", type=int, default=2, help="epochs of the local baseline")
    parser.add_argument("--timeout", type=float, default=900)
    args = parser.parse_args(argv)
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory(prefix="adamps-acc-") as tmp:
        cluster = run_cluster(args, Path(tmp))
    local = run_local(args)
    print(
        f"adam-mnist, built-in data, {args.replicas} replicas x {args.workers} worker(s), "
        f"Downpour + server {args.optimizer} lr {args.lr}, batch {args.batch}, "
        f"n_push {args.n_push}, n_fetch {args.n_fetch}, warm start {args.warm_start}, "
        f"augment {args.augment}, trainers over {'HTTP' if args.http_only else 'the data plane'}"
    )
    print(
        "held-out accuracy per epoch: "
        + ", ".join(f"{a * 100:.1f}%" for a in cluster["per_epoch_acc"])
    )
    print(f"held-out accuracy after {args.epochs} epochs: {cluster['acc'] * 100:.1f}%")
    print(
        f"images/s: cluster {cluster['images_per_s']:.0f} ({cluster['images']} images in "
        f"{cluster['train_s']:.1f} s of training, {cluster['wall_s']:.1f} s wall with start-up) | "
        f"single process trainer.local 1 worker {local['images_per_s']:.0f} | "
        f"ratio {cluster['images_per_s'] / local['images_per_s']:.2f}"
    )
    cluster_cpu = sum(cluster["cpu_s"].values())
    per_cpu = cluster["images"] / cluster_cpu
    print(
        f"images per CPU second (robust to a busy machine): cluster {per_cpu:.0f} (all its "
        f"processes) | single process {local['images_per_cpu_s']:.0f} | "
        f"ratio {per_cpu / local['images_per_cpu_s']:.2f}"
    )
    print(
        "CPU seconds (2 cores = 2 CPU s per s of wall time): "
        + ", ".join(f"{k} {v}" for k, v in cluster["cpu_s"].items())
        + f"; training wall {cluster['train_s']:.1f} s"
    )
    print(json.dumps({
        "replicas": args.replicas, "workers": args.workers, "epochs": args.epochs,
        "optimizer": args.optimizer, "lr": args.lr, "batch": args.batch,
        "n_push": args.n_push, "n_fetch": args.n_fetch, "augment": args.augment,
        "transport": "http" if args.http_only else "dataplane",
        "heldout_acc_pct": round(cluster["acc"] * 100, 2),
        "per_epoch_acc_pct": [round(a * 100, 2) for a in cluster["per_epoch_acc"]],
        "cluster_images_per_s": round(cluster["images_per_s"], 1),
        "cluster_train_s": round(cluster["train_s"], 2),
        "local_1worker_images_per_s": round(local["images_per_s"], 1),
        "ratio_cluster_to_local": round(cluster["images_per_s"] / local["images_per_s"], 3),
        "cpu_s": cluster["cpu_s"],
        "cluster_images_per_cpu_s": round(per_cpu, 1),
        "local_images_per_cpu_s": round(local["images_per_cpu_s"], 1),
    }))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
