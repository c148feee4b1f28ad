"""Training in one process, without parameter servers: plain SGD on one replica, with one
worker or several Hogwild workers. Used by tests, benchmarks and as the synchronous baseline of
the accuracy comparison (Project Adam's Table 1).

    python -m trainer.local --epochs 5 --batch 8 --lr 0.03 --workers 2

Every run with the same seed starts from the same weights and visits the training images in the
same order (``epoch_order``), so other implementations (benchmarks/accuracy.py's PyTorch run) can
be compared image for image.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from threadpoolctl import threadpool_limits

from trainer.hogwild import DEFAULT_MODE, MODES, Hogwild
from trainer.model import Model, resolve_spec

Data = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]


def builtin_data() -> Data:
    """The built-in dataset: 4,000 training and 1,000 held-out real MNIST digits."""
    from dataserver.sources import builtin_mnist

    return builtin_mnist()


def epoch_order(n: int, seed: int, epoch: int) -> np.ndarray:
    """The order in which an epoch visits the n training images (deterministic)."""
    return np.random.default_rng([seed, epoch]).permutation(n)


def epoch_batches(n: int, batch: int, seed: int, epoch: int) -> list[np.ndarray]:
    """The epoch's batches of image indices; a last partial batch is kept."""
    order = epoch_order(n, seed, epoch)
    return [order[i : i + batch] for i in range(0, n, batch)]


@dataclass
class EpochResult:
    epoch: int  #: 1-based
    accuracy: float  #: held-out accuracy at the end of the epoch
    loss: float  #: mean training loss over the epoch's batches
    seconds: float  #: training wall time of the epoch (evaluation excluded)
    images: int  #: training images processed


class SgdWorker:
    """A worker's step function: plain SGD over the batches it is given, on a parameter
    buffer it may share with other workers (no locks: Hogwild)."""

    def __init__(
        self,
        spec: dict[str, Any],
        images: np.ndarray,
        labels: np.ndarray,
        lr: float,
        params: np.ndarray,
    ) -> None:
        self.model = Model(spec, params=params)
        self.x = self.model.prepare(images)
        self.y = np.asarray(labels, np.int64)
        self.lr = lr

    def __call__(self, batches: list[np.ndarray]) -> tuple[float, int, int]:
        """Train on the batches; return (sum of batch losses, batches, images)."""
        total = 0.0
        images = 0
        for idx in batches:
            total += self.model.sgd_step(self.x[idx], self.y[idx], self.lr)
            images += len(idx)
        return total, len(batches), images


def sgd_worker_factory(
    spec: dict[str, Any],
    images: np.ndarray,
    labels: np.ndarray,
    lr: float,
    worker_id: int,
    params: np.ndarray,
) -> SgdWorker:
    """Hogwild factory (use through functools.partial; importable, so picklable)."""
    return SgdWorker(spec, images, labels, lr, params)


def train_local(
    model: str | dict[str, Any] = "adam-mnist",
    *,
    epochs: int = 5,
    batch: int = 8,
    lr: float = 0.03,
    seed: int = 0,
    workers: int = 1,
    mode: str = DEFAULT_MODE,
    data: Data | None = None,
    on_epoch: Callable[[EpochResult], None] | None = None,
) -> tuple[np.ndarray, list[EpochResult]]:
    """Train from ``seed``'s initial weights; return the final flat parameters and per-epoch
    results. With workers > 1 the epoch's batches are dealt round-robin to Hogwild workers."""
    spec = resolve_spec(model)
    train_x, train_y, test_x, test_y = builtin_data() if data is None else data
    evaluator = Model(spec)
    evaluator.init_params(seed)
    test_in = evaluator.prepare(test_x)
    results: list[EpochResult] = []

    def finish(epoch: int, loss_sum: float, n_batches: int, images: int, seconds: float) -> None:
        acc = evaluator.accuracy(test_in, test_y)
        res = EpochResult(epoch, acc, loss_sum / max(n_batches, 1), seconds, images)
        results.append(res)
        if on_epoch is not None:
            on_epoch(res)

    if workers == 1:
        with threadpool_limits(1):  # one core per worker, as in Hogwild; also the fastest here
            worker = SgdWorker(spec, train_x, train_y, lr, evaluator.params)
            for epoch in range(1, epochs + 1):
                batches = epoch_batches(len(train_y), batch, seed, epoch)
                t0 = time.perf_counter()
                loss_sum, n_batches, images = worker(batches)
                finish(epoch, loss_sum, n_batches, images, time.perf_counter() - t0)
        return evaluator.params.copy(), results

    factory = functools.partial(sgd_worker_factory, spec, train_x, train_y, lr)
    with Hogwild(factory, workers, evaluator.params, mode=mode) as pool:
        shared = Model(spec, params=pool.params)
        for epoch in range(1, epochs + 1):
            batches = epoch_batches(len(train_y), batch, seed, epoch)
            t0 = time.perf_counter()
            outs = pool.run([batches[w::workers] for w in range(workers)])
            seconds = time.perf_counter() - t0
            evaluator.params[...] = shared.params  # evaluate a snapshot (workers are idle now)
            finish(
                epoch,
                sum(o[0] for o in outs),
                sum(o[1] for o in outs),
                sum(o[2] for o in outs),
                seconds,
            )
        final = shared.params.copy()
    return final, results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.local", description=__doc__)
    parser.add_argument("--model", default="adam-mnist", help="built-in name or JSON description")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=0.03)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--mode", choices=MODES, default=DEFAULT_MODE)
    parser.add_argument("--save", default="", help="write the final weights to this .npz")
    args = parser.parse_args(argv)

    def show(r: EpochResult) -> None:
        print(
            f"epoch {r.epoch}: held-out accuracy {r.accuracy:.4f}, loss {r.loss:.4f}, "
            f"{r.images / r.seconds:.0f} images/s",
            flush=True,
        )

    params, results = train_local(
        args.model,
        epochs=args.epochs,
        batch=args.batch,
        lr=args.lr,
        seed=args.seed,
        workers=args.workers,
        mode=args.mode,
        on_epoch=show,
    )
    if args.save:
        np.savez(args.save, **Model(args.model, params=params).export())
        print(f"weights written to {args.save}", flush=True)
    print(json.dumps({"epochs": [asdict(r) for r in results]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
