"""Training on a device through adamps against plain PyTorch on the same device, in one run.

    python benchmarks/torch_device.py                  # the accelerator if there is one, else the CPU
    python benchmarks/torch_device.py --quick          # a smoke run: well under 2 minutes
    python benchmarks/torch_device.py --device cuda:0 --dtype bfloat16 --batch 256

Both train examples/torch_mnist.py's convnet (two convolutions with BatchNorm, two nn.Linear
layers) on MNIST-shaped images generated in this process (random pixels and labels: nothing is
downloaded, so it runs on a machine that reaches nothing), the batches already on the device:

1. **plain PyTorch**: the model on the device, ``torch.optim.SGD``;
2. **adamps**: the same model on the device, a ``DownpourOptimizer`` (SGD on the servers, same lr,
   ``n_push = n_fetch = 1`` by default: every step pushes its gradients and fetches the values)
   against a fresh local cluster of 3 controllers and 3 parameter servers on loopback, started
   as ``adamps up`` starts them (benchmarks/practitioner.py's cluster). Every step copies the
   gradients to the host through pinned buffers (one synchronize per step) and the values back
   (adamps/torch/staging.py; docs/training.md, "Devices").

Each is timed over the same number of steps after a warm-up, with the device synchronized before
the clock is read. Printed: images per second of both, their ratio (the limit adamps is measured
against is plain PyTorch on the same device, in the same run), the host copies per step, and
"no device: ran on cpu" when the machine has no accelerator. The last line printed is one JSON
object of the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

LR = 0.05


def accelerator() -> str | None:
    """The machine's accelerator device, or None (then everything runs on the CPU)."""
    import torch

    if torch.cuda.is_available():
        return "cuda"
    acc = getattr(torch, "accelerator", None)  # torch >= 2.6: mps, xpu, ...
    if acc is not None and acc.is_available():
        dev = acc.current_accelerator()
        return dev.type if dev is not None else None
    return None


def synchronize(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type != "cpu" and hasattr(torch, "accelerator"):
        torch.accelerator.synchronize()


def data(n: int, device: Any, dtype: Any) -> tuple[Any, Any]:
    """`n` MNIST-shaped images (1 x 28 x 28, pixels in [0, 1]) and labels, on `device`."""
    import torch

    g = torch.Generator().manual_seed(0)
    x = torch.rand(n, 1, 28, 28, generator=g).to(device, dtype)
    y = torch.randint(0, 10, (n,), generator=g).to(device)
    return x, y


def make_model(device: Any, dtype: Any) -> Any:
    import torch

    from examples.torch_mnist import Net

    torch.manual_seed(0)
    return Net().to(device, dtype)


def train(model: Any, opt: Any, x: Any, y: Any, batch: int, steps: int, warmup: int) -> dict:
    """`warmup` untimed steps, then `steps` timed ones (cycling over the images)."""
    from torch import nn

    device = x.device
    n = len(y)
    i = 0
    loss = None

    def one() -> None:
        nonlocal i, loss
        lo = (i * batch) % max(1, n - batch + 1)
        xb, yb = x[lo : lo + batch], y[lo : lo + batch]
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(xb).float(), yb)
        loss.backward()
        opt.step()
        i += 1

    model.train()
    for _ in range(warmup):
        one()
    synchronize(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        one()
    if hasattr(opt, "flush"):
        opt.flush()  # every push acknowledged: the servers have the steps timed
    synchronize(device)
    seconds = time.perf_counter() - t0
    return {
        "images": steps * batch,
        "seconds": seconds,
        "images_per_s": steps * batch / seconds,
        "last_loss": float(loss.detach()) if loss is not None else float("nan"),
    }


def start_cluster(root: Path, token: str) -> Any:
    from adamps.up.cluster import LocalCluster

    c = LocalCluster(
        root, token=token, n_servers=3, n_buckets=64,
        ps_opts={"log-level": os.environ.get("PS_LOG", "WARNING")},
    )  # fmt: skip
    c.start(timeout=120)
    return c


def main() -> None:
    ap = argparse.ArgumentParser(description="adamps on a device vs plain PyTorch on it")
    ap.add_argument(
        "--device", default=None, help="torch device (default: the accelerator, else cpu)"
    )
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--steps", type=int, default=300, help="timed steps of each")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--images", type=int, default=8192, help="generated images, on the device")
    ap.add_argument("--n-push", type=int, default=1)
    ap.add_argument("--n-fetch", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="a smoke run: 20 steps of batch 32")
    a = ap.parse_args()
    if a.quick:
        a.steps, a.warmup, a.batch, a.images = 20, 2, 32, 512

    import torch

    import adamps.torch as at

    acc = accelerator()
    device = torch.device(a.device or acc or "cpu")
    dtype = getattr(torch, a.dtype)
    if device.type == "cpu":
        print(
            "no device: ran on cpu" if acc is None else f"ran on cpu (the {acc} was not asked for)"
        )
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
    x, y = data(a.images, device, dtype)

    model = make_model(device, dtype)
    plain = train(
        model, torch.optim.SGD(model.parameters(), lr=LR), x, y, a.batch, a.steps, a.warmup
    )

    tmp = Path(tempfile.mkdtemp(prefix="torch-device-"))
    token = secrets.token_hex(16)
    cluster = start_cluster(tmp / "cluster", token)
    try:
        model = make_model(device, dtype)
        opt = at.DownpourOptimizer(
            model, controllers=cluster.controllers, run="bench-device", token=token, lr=LR,
            optimizer="sgd", n_push=a.n_push, n_fetch=a.n_fetch,
        )  # fmt: skip
        try:
            ours = train(model, opt, x, y, a.batch, a.steps, a.warmup)
            up, down = opt.worker.stage_up, opt.worker.stage_down
            stats = opt.stats()
            ours.update(
                syncs=up.syncs, host_buffers=up.allocations + down.allocations,
                pushes=stats["pushes"], fetches=stats["fetches"],
                bytes_pushed=stats["bytes_pushed"],
            )  # fmt: skip
        finally:
            opt.close()
    finally:
        cluster.stop()
        shutil.rmtree(tmp, ignore_errors=True)

    ratio = ours["images_per_s"] / plain["images_per_s"]
    steps = a.steps + a.warmup
    print(f"device: {name} ({a.dtype}, batch {a.batch}, {a.steps} timed steps)")
    print(f"plain PyTorch:  {plain['images_per_s']:10,.0f} images/s")
    print(f"adamps:         {ours['images_per_s']:10,.0f} images/s  (ratio {ratio:.3f}; "
          f"n_push {a.n_push}, n_fetch {a.n_fetch}; 3 controllers, 3 parameter servers on loopback)")  # fmt: skip
    print(f"host copies:    {ours['syncs'] / steps:.2f} device synchronizations per step, "
          f"{ours['host_buffers']} host buffers allocated in {steps} steps, "
          f"{ours['bytes_pushed'] / max(1, ours['pushes']):,.0f} bytes per push")  # fmt: skip
    print(json.dumps({
        "device": name, "device_type": device.type, "accelerator": acc, "dtype": a.dtype,
        "batch": a.batch, "steps": a.steps, "n_push": a.n_push, "n_fetch": a.n_fetch,
        "adamps_images_per_s": round(ours["images_per_s"], 1),
        "torch_images_per_s": round(plain["images_per_s"], 1),
        "ratio": round(ratio, 4),
        "syncs_per_step": round(ours["syncs"] / steps, 3),
        "host_buffers": ours["host_buffers"],
        "bytes_per_push": round(ours["bytes_pushed"] / max(1, ours["pushes"]), 1),
        "adamps_last_loss": round(ours["last_loss"], 4),
        "torch_last_loss": round(plain["last_loss"], 4),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
