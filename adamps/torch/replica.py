"""``Replica(model, loss_fn).fit(loader)``: a Downpour replica with Hogwild workers.

    replica = adamps.torch.Replica(model, nn.functional.cross_entropy,
                                   controllers=["127.0.0.1:7101"], lr=0.05, workers=2)
    replica.fit(loader, epochs=3)            # any iterable of (inputs, targets)
    torch.save(replica.state_dict(), "model.pt")   # the servers' values

The workers are threads sharing the one model without locks (Hogwild): torch releases the GIL
inside its kernels, so they compute side by side. Each takes the next minibatch from the shared
iterator, computes its gradients with ``torch.autograd.grad`` (into its own tensors: ``.grad``
would be shared by all threads) and runs its own Downpour rule (adamps/torch/downpour.py): local
step, push every ``n_push`` of its steps, fetch every ``n_fetch``. While one worker waits on the
network the others compute.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from adamps.torch.downpour import PushCounts
from adamps.torch.optimizer import Connection


@dataclass
class FitResult:
    steps: int = 0
    examples: int = 0
    seconds: float = 0.0
    loss: float = float("nan")  #: mean loss of the last epoch's minibatches


class Replica:
    """One model replica: a model, a loss and the servers (see adamps.torch.optimizer.Connection
    for the server arguments)."""

    def __init__(
        self,
        model: nn.Module,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        *,
        lr: float = 0.01,
        local_lr: float | None = None,
        n_push: int = 1,
        n_fetch: int = 1,
        workers: int = 1,
        compress: Any = False,
        asynchronous: bool = False,
        connection: Connection | None = None,
        **server: Any,
    ) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.model = model
        self.loss_fn = loss_fn
        #: the servers (a Connection made by the caller, e.g. after waiting for replica 0)
        self.conn = connection if connection is not None else Connection(model, lr=lr, **server)
        self.workers = [
            self.conn.worker(
                local_lr=lr if local_lr is None else local_lr,
                n_push=n_push,
                n_fetch=n_fetch,
                compress=compress,
                asynchronous=asynchronous,
            )  # fmt: skip
            for _ in range(workers)
        ]
        self._trainable = [p for p in self.conn.params if p.param.requires_grad]

    @property
    def counts(self) -> PushCounts:
        return self.conn.counts

    def train_step(self, w: int, x: Any, y: Any) -> float:
        """One minibatch on worker `w` (its own thread): forward, gradients, Downpour step."""
        loss = self.loss_fn(self.model(x), y)
        grads = torch.autograd.grad(loss, [p.param for p in self._trainable], allow_unused=True)
        self.workers[w].step({p.tensor: g for p, g in zip(self._trainable, grads, strict=True)})
        return float(loss.detach())

    def fit_epoch(self, batches: Iterable[Sequence[Any]], on_batch: Any = None) -> FitResult:
        """One pass over `batches` by all workers; pushes every worker's rest at the end."""
        self.model.train()
        it = iter(batches)
        lock = threading.Lock()
        res = FitResult()
        losses: list[float] = []
        errors: list[BaseException] = []

        def run(w: int) -> None:
            try:
                while not errors:
                    with lock:
                        batch = next(it, None)
                    if batch is None:
                        break
                    x, y = batch[0], batch[1]
                    loss = self.train_step(w, x, y)
                    with lock:
                        losses.append(loss)
                        res.steps += 1
                        res.examples += len(y)
                    if on_batch is not None:
                        on_batch(len(y), loss)
                self.workers[w].flush()
            except BaseException as exc:  # noqa: BLE001 - raised in the caller's thread
                errors.append(exc)

        t0 = time.perf_counter()
        if len(self.workers) == 1:
            run(0)
        else:
            threads = [
                threading.Thread(target=run, args=(w,), name=f"hogwild-{w}", daemon=True)
                for w in range(len(self.workers))
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        if errors:
            raise errors[0]
        self.workers[0].fetch()  # the model ends at the servers' values
        self.workers[0].flush()
        res.seconds = time.perf_counter() - t0
        res.loss = sum(losses) / len(losses) if losses else float("nan")
        return res

    def fit(self, loader: Iterable[Sequence[Any]], epochs: int = 1) -> list[FitResult]:
        """`epochs` passes over `loader` (a DataLoader or any re-iterable of (x, y))."""
        return [self.fit_epoch(loader) for _ in range(epochs)]

    @torch.no_grad()
    def evaluate(self, batches: Iterable[Sequence[Any]]) -> float:
        """Accuracy (argmax of the model's output) over `batches`, with the current weights."""
        was = self.model.training
        self.model.eval()
        right = total = 0
        for x, y, *_ in batches:
            right += int((self.model(x).argmax(1) == y).sum())
            total += len(y)
        self.model.train(was)
        return right / max(1, total)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The model's state_dict with the servers' parameter values (buffers: this replica's)."""
        return self.conn.server_state_dict()

    def close(self) -> None:
        """Pushes what is left, stops the workers' background threads, closes the connections."""
        try:
            for w in self.workers:
                w.close()
        finally:
            self.conn.close()
