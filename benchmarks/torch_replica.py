"""PyTorch replicas on adamps against one plain PyTorch process (issue 22), in one run.

    python benchmarks/torch_replica.py [--epochs 5] [--batch 16]

1. **Plain PyTorch**: one process (1 intra-op thread) trains examples/torch_mnist.py's convnet on
   the built-in MNIST (4,000 images) with torch.optim.SGD at the same batch size and learning
   rate; images per CPU-second of that process, held-out accuracy after each epoch.
2. **adamps**: `adamps up --torch examples.torch_mnist:Net` with 2 replicas (3 controllers, 3
   replicated parameter servers, 1 data server on loopback), the same model, batch and epochs;
   images per CPU-second of the two trainer processes (their own figure, from their summary
   lines) and of the whole cluster (every process of the run: this script's children's rusage),
   held-out accuracy at each epoch (replica 0's history, the servers' weights).
3. **Bytes pushed per image** by the nn.Linear weights: as activation/error vectors (what was
   sent) against the dense gradients of the same pushes (the trainers' `torch pushes` log line).

The limit each figure is compared against is measured in the same run: plain PyTorch's rate and
accuracy, and the dense size of the linear layers' pushes. The goal is a trainer ratio >= 0.7.
The last line printed is one JSON object of the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LR = 0.1


def plain(epochs: int, batch: int) -> dict:
    import torch
    from torch import nn

    from dataserver.sources import builtin_mnist
    from examples.torch_mnist import Net

    torch.set_num_threads(1)
    x, y, tx, ty = builtin_mnist()
    x = torch.from_numpy(x).float().div(255).unsqueeze(1)
    y = torch.from_numpy(y)
    tx = torch.from_numpy(tx).float().div(255).unsqueeze(1)
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    g = torch.Generator().manual_seed(0)
    acc, cpu, images = {}, 0.0, 0
    for epoch in range(1, epochs + 1):
        model.train()
        order = torch.randperm(len(y), generator=g)
        c0 = time.process_time()
        for i in range(0, len(y), batch):
            idx = order[i : i + batch]
            opt.zero_grad()
            nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
            images += len(idx)
        cpu += time.process_time() - c0
        model.eval()
        with torch.no_grad():
            acc[epoch] = float((model(tx).argmax(1).numpy() == ty).mean())
    return {"images": images, "cpu_s": cpu, "images_per_cpu_s": images / cpu, "accuracy": acc}


def adamps(epochs: int, batch: int, n_push: int, n_fetch: int) -> dict:
    run = Path(tempfile.mkdtemp(prefix="torch-replica-")) / "run"
    flags = ["--torch", "examples.torch_mnist:Net", "--epochs", str(epochs), "--trainers", "2",
             "--target-accuracy", "0", "--no-progress", "--run-dir", str(run)]  # fmt: skip
    for kv in (f"batch_size={batch}", f"n_push={n_push}", f"n_fetch={n_fetch}", "optimizer=sgd", f"lr={LR}",
               f"local_lr={LR}"):  # fmt: skip
        flags += ["--train-arg", kv]
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run([sys.executable, "-m", "adamps", "up", *flags], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=1800)  # fmt: skip
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if out.returncode != 0:
        raise SystemExit(f"adamps up failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    cluster_cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    trainers, pushes = [], []
    for log in sorted((run / "logs").glob("train*.log")):
        text = log.read_text()
        for line in text.splitlines():
            if line.startswith("{") and '"cpu_main_s"' in line:
                trainers.append(json.loads(line))
        m = re.search(r"torch pushes (\{.*\})", text)
        if m:
            pushes.append(json.loads(m.group(1)))
    history = [json.loads(x) for x in (run / "history.jsonl").read_text().splitlines()]
    images = sum(t["images"] for t in trainers)
    # the trainers' CPU while training (every thread; process startup, imports and the final
    # wait excluded, as the plain process's loop is timed without them)
    trainer_cpu = sum(p["train_cpu_s"] for p in pushes)
    process_cpu = sum(t["cpu_main_s"] + t["cpu_workers_s"] for t in trainers)
    return {
        "images": images,
        "trainer_cpu_s": trainer_cpu,
        "trainer_process_cpu_s": process_cpu,
        "cluster_cpu_s": cluster_cpu,
        "images_per_trainer_cpu_s": images / trainer_cpu,
        "images_per_cluster_cpu_s": images / cluster_cpu,
        "wall_s": max(t["seconds"] for t in trainers),
        "accuracy": {h["epoch"]: h["accuracy"] for h in history},
        "linear_bytes": sum(p["linear_bytes"] for p in pushes),
        "linear_dense_bytes": sum(p["linear_dense_bytes"] for p in pushes),
        "bytes_pushed": sum(p["bytes_pushed"] for p in pushes),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description="adamps torch replicas vs plain PyTorch")
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--n-push", type=int, default=4, help="adamps train --n-push")
    ap.add_argument("--n-fetch", type=int, default=8, help="adamps train --n-fetch")
    a = ap.parse_args()
    p = plain(a.epochs, a.batch)
    d = adamps(a.epochs, a.batch, a.n_push, a.n_fetch)
    ratio_trainers = d["images_per_trainer_cpu_s"] / p["images_per_cpu_s"]
    ratio_cluster = d["images_per_cluster_cpu_s"] / p["images_per_cpu_s"]
    print(f"plain PyTorch, 1 process:     {p['images_per_cpu_s']:8,.0f} images per CPU-second "
          f"({p['images']:,} images, {p['cpu_s']:.1f} CPU-s)")  # fmt: skip
    print(f"adamps, 2 replicas, trainers: {d['images_per_trainer_cpu_s']:8,.0f} images per "
          f"CPU-second ({d['images']:,} images, {d['trainer_cpu_s']:.1f} CPU-s training; "
          f"{d['trainer_process_cpu_s']:.1f} with startup)  ratio "
          f"{ratio_trainers:.2f} (goal >= 0.7: {'met' if ratio_trainers >= 0.7 else 'missed'})")  # fmt: skip
    print(f"adamps, whole cluster:        {d['images_per_cluster_cpu_s']:8,.0f} images per "
          f"CPU-second ({d['cluster_cpu_s']:.1f} CPU-s of 3 controllers, 3 PS, 1 data server, "
          f"2 trainers, adamps up)  ratio {ratio_cluster:.2f}")  # fmt: skip
    lin, dense = d["linear_bytes"] / d["images"], d["linear_dense_bytes"] / d["images"]
    print(f"nn.Linear pushes: {lin:,.0f} bytes per image as sent (act/err where smaller) vs "
          f"{dense:,.0f} as dense gradients: {dense / lin:.2f}x fewer; all pushes "
          f"{d['bytes_pushed'] / d['images']:,.0f} bytes per image")  # fmt: skip
    print("held-out accuracy per epoch (plain PyTorch / adamps 2 replicas):")
    for e in range(1, a.epochs + 1):
        print(f"  epoch {e}: {p['accuracy'][e]:.3f} / {d['accuracy'].get(e, float('nan')):.3f}")
    print(json.dumps({
        "epochs": a.epochs, "batch": a.batch, "n_push": a.n_push, "n_fetch": a.n_fetch,
        "plain_images_per_cpu_s": round(p["images_per_cpu_s"], 1),
        "adamps_images_per_trainer_cpu_s": round(d["images_per_trainer_cpu_s"], 1),
        "adamps_images_per_cluster_cpu_s": round(d["images_per_cluster_cpu_s"], 1),
        "ratio_trainers": round(ratio_trainers, 3), "ratio_cluster": round(ratio_cluster, 3),
        "goal_met": ratio_trainers >= 0.7,
        "linear_bytes_per_image": round(lin, 1), "linear_dense_bytes_per_image": round(dense, 1),
        "bytes_pushed_per_image": round(d["bytes_pushed"] / d["images"], 1),
        "plain_accuracy": p["accuracy"], "adamps_accuracy": d["accuracy"],
        "adamps_wall_s": round(d["wall_s"], 1),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
