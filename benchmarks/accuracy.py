"""Held-out accuracy of adam-mnist after the same number of epochs, trained different ways
(Project Adam's Table 1 comparison) on the built-in data (4,000 train / 1,000 held-out real
MNIST digits):

- numpy, one replica, one worker: synchronous plain SGD (the baseline);
- numpy Hogwild, 2 worker processes on one shared buffer, plain SGD;
- PyTorch on the CPU (1 thread): the same model, initial weights, batches and update, when
  torch is installed.

    python benchmarks/accuracy.py [--epochs 5 | --full] [--batch 8] [--lr 0.03] [--seed 0]

More rows: add a function to ROWS (name -> run(args) -> per-epoch held-out accuracies); the
table and the JSON pick it up. With 1,000 held-out images the standard error of an accuracy is
about +-0.5 points. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from trainer.local import builtin_data, epoch_batches, train_local  # noqa: E402
from trainer.model import Model  # noqa: E402

Outcome = tuple[list[float], float]  # per-epoch held-out accuracy, training seconds


def _numpy(args: argparse.Namespace, workers: int) -> Outcome:
    _, res = train_local(
        "adam-mnist",
        epochs=args.epochs,
        batch=args.batch,
        lr=args.lr,
        seed=args.seed,
        workers=workers,
        data=args.data,
    )
    return [r.accuracy for r in res], sum(r.seconds for r in res)


def numpy_sync(args: argparse.Namespace) -> Outcome:
    return _numpy(args, 1)


def numpy_hogwild(args: argparse.Namespace) -> Outcome:
    return _numpy(args, 2)


def pytorch(args: argparse.Namespace) -> Outcome:
    """Same initial weights (Model.init_params(seed)), same batches (epoch_batches), plain SGD."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1)
    spec = importlib.util.spec_from_file_location("bench_trainer", ROOT / "benchmarks/trainer.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    model = Model("adam-mnist")
    model.init_params(args.seed)
    net = bench.torch_model(model.params)
    opt = torch.optim.SGD(net.parameters(), lr=args.lr)
    train_x, train_y, test_x, test_y = args.data
    x = torch.from_numpy(model.prepare(train_x)).permute(0, 3, 1, 2).contiguous()
    y = torch.from_numpy(train_y.astype(np.int64))
    tx = torch.from_numpy(model.prepare(test_x)).permute(0, 3, 1, 2).contiguous()
    accs = []
    seconds = 0.0
    for epoch in range(1, args.epochs + 1):
        t0 = time.perf_counter()
        for idx in epoch_batches(len(train_y), args.batch, args.seed, epoch):
            i = torch.from_numpy(idx)
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(net(x[i]), y[i]).backward()
            opt.step()
        seconds += time.perf_counter() - t0
        with torch.no_grad():
            pred = net(tx).argmax(dim=1).numpy()
        accs.append(float((pred == test_y).mean()))
    return accs, seconds


def torch_available() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


#: JSON key -> (table label, run, the command the row stands for); add rows here. A run gets
#: the parsed arguments (epochs, batch, lr, seed, data = the built-in split).
ROWS: dict[str, tuple[str, Callable[[argparse.Namespace], Outcome], str]] = {
    "numpy_sync": (
        "numpy, 1 replica x 1 worker, sync SGD",
        numpy_sync,
        "python -m trainer.local --workers 1",
    ),
    "numpy_hogwild_2w": (
        "numpy Hogwild, 2 worker processes, SGD",
        numpy_hogwild,
        "python -m trainer.local --workers 2",
    ),
    "torch_1t": ("PyTorch CPU, 1 thread, SGD", pytorch, "python benchmarks/accuracy.py"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--full", action="store_true", help="15 epochs (Adam's table setting)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=0.03)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.full:
        args.epochs = 15
    has_torch = torch_available()
    args.data = builtin_data()
    print(
        f"adam-mnist, built-in data (4,000 train / 1,000 held-out), {args.epochs} epochs, "
        f"batch {args.batch}, lr {args.lr}, seed {args.seed}"
    )
    result: dict[str, object] = {"epochs": args.epochs, "batch": args.batch, "lr": args.lr}
    print(f"{'run':<40}{'held-out acc':>13}{'best epoch':>11}{'train s':>9}  command")
    for key, (label, run, command) in ROWS.items():
        if run is pytorch and not has_torch:
            print(f"{label:<40}  torch not installed")
            result[f"{key}_acc_pct"] = None
            continue
        accs, secs = run(args)
        print(
            f"{label:<40}{accs[-1] * 100:12.1f}%{max(accs) * 100:10.1f}%{secs:9.1f}  "
            f"{command} --epochs {args.epochs}"
        )
        result[f"{key}_acc_pct"] = round(accs[-1] * 100, 2)
        result[f"{key}_per_epoch_acc_pct"] = [round(a * 100, 2) for a in accs]
        result[f"{key}_train_s"] = round(secs, 2)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
