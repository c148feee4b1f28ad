"""``Replica(model, loss_fn).fit(loader)``: a Downpour replica with Hogwild workers.

    replica = adamps.torch.Replica(model, nn.functional.cross_entropy,
                                   controllers=["127.0.0.1:7101"], lr=0.05, workers=2)
    replica.fit(loader, epochs=3)            # any iterable of (inputs, targets)
    torch.save(replica.state_dict(), "model.pt")   # the servers' values

The workers are threads sharing the one model's parameter memory without locks (Hogwild): torch
releases the GIL inside its kernels, so they compute side by side. Worker 0 runs the model
itself; every other worker a copy of it whose parameters are other tensors on the *same memory*
(``copy.data = param.data``): each tensor keeps its own autograd version counter, so one worker's
in-place step does not invalidate another's graph (autograd would refuse the backward pass), yet
every step lands in the one copy of the weights. Each worker takes the next minibatch from the
shared iterator, computes its gradients with ``torch.autograd.grad`` (its own tensors: ``.grad``
would be shared) and runs its own Downpour rule (adamps/torch/downpour.py): local step, push every
``n_push`` of its steps, fetch every ``n_fetch``. While one worker waits on the network the others
compute. ``staleness`` is "off" here by default (every push at lr): the Hogwild workers share
one memory, and the staleness study (docs/training.md, "Several replicas") measured replicas in
their own loops, where ``DownpourOptimizer`` defaults to "auto". Buffers (BatchNorm's statistics) are per worker copy; the model's (worker 0's) are the
replica's.
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from adamps.torch.downpour import PushCounts
from adamps.torch.embedding import take_row_leaves
from adamps.torch.optimizer import Connection
from adamps.torch.params import Param


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
        staleness: str = "off",
        connection: Connection | None = None,
        **server: Any,
    ) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.model = model
        self.loss_fn = loss_fn
        #: the servers (a Connection made by the caller, e.g. after waiting for replica 0)
        self.conn = connection if connection is not None else Connection(model, lr=lr, **server)
        #: each worker's module (worker 0: the model) and its Params on the shared memory
        self.modules: list[nn.Module] = [model]
        self.params: list[list[Param]] = [self.conn.params]
        for _ in range(1, workers):
            twin, twin_params = self._twin()
            self.modules.append(twin)
            self.params.append(twin_params)
        self.workers = [
            self.conn.worker(
                local_lr=lr if local_lr is None else local_lr,
                n_push=n_push,
                n_fetch=n_fetch,
                compress=compress,
                asynchronous=asynchronous,
                params=self.params[w],
                staleness=staleness,
            )  # fmt: skip
            for w in range(workers)
        ]

    def _twin(self) -> tuple[nn.Module, list[Param]]:
        """A copy of the model whose parameters share the model's memory (not its tensors). The
        act/err hooks are copied with it and record into the same per-thread store."""
        twin = copy.deepcopy(self.model)
        by_name = dict(twin.named_parameters())
        out = []
        with torch.no_grad():
            for p in self.conn.params:
                t = by_name[p.name]
                t.data = p.param.data  # same storage, the twin's own version counter
                out.append(Param(p.name, p.tensor, t))
        return twin, out

    @property
    def counts(self) -> PushCounts:
        return self.conn.counts

    def train_step(self, w: int, x: Any, y: Any) -> float:
        """One minibatch on worker `w` (its own thread): forward, gradients, Downpour step."""
        trainable = [p for p in self.params[w] if p.param.requires_grad]
        loss = self.loss_fn(self.modules[w](x), y)
        # the embedding modules' row leaves: computing their gradients pushes them
        leaves = take_row_leaves(self.conn.tables)
        grads = torch.autograd.grad(loss, [p.param for p in trainable] + leaves, allow_unused=True)[
            : len(trainable)
        ]
        self.workers[w].step({p.tensor: g for p, g in zip(trainable, grads, strict=True)})
        return float(loss.detach())

    def fit_epoch(self, batches: Iterable[Sequence[Any]], on_batch: Any = None) -> FitResult:
        """One pass over `batches` by all workers; pushes every worker's rest at the end."""
        for m in self.modules:
            m.train()
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
