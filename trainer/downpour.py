"""Downpour SGD (DistBelief 4.1) with Project Adam's trainer (3.2): one model replica.

A replica is one process holding a local copy of the weights, shared without locks by its
Hogwild workers (trainer/hogwild.py: processes over shared memory by default). The main thread
deals minibatches from the data servers to the workers in *rounds* (each worker trains
``n_push`` minibatches per round, plain SGD on the local copy) and hands the round's updates to
background threads, so compute never waits on the network:

- the **push thread** sends them to the parameter servers. Convolution layers and every bias
  push the accumulated delta (the sum of the gradients since the last push). A fully connected
  layer's M x N weight pushes its k activation and error vectors instead (Adam 3.2.6; the
  server computes ``e.T @ a``) whenever ``k * (M + N) < M * N``, else the dense delta. The
  queue is bounded: when the network falls behind, a new round is merged into the last queued
  push (deltas added, vectors stacked) instead of blocking the workers;
- with ``--compress`` the push thread sends Strom's threshold-quantized updates instead
  (trainer/compress.py: a residual per tensor with error feedback, +-tau per sent element),
  whichever of vectors, compressed and dense is smallest per tensor;
- the **fetch thread** pulls the current parameters every ``n_fetch`` minibatches per worker;
  the main thread installs them between two rounds, plus the pushes still queued and the
  compression residuals (local updates the servers do not have yet), and measures their
  staleness (replica steps taken between the request and the install);
- the **board thread** reports progress and reads the other replicas' (Adam 3.2.5): an epoch is
  complete once ``epoch_fraction`` of the replicas finished it; a replica still inside a
  complete epoch moves on to the next. With controllers the board is their ``/progress``;
  in static mode (``--ps`` only) it is a small tensor on the parameter servers that replicas
  add to (SGD with lr = -1 adds exactly; pushes are applied exactly once).

The server-side optimizer (Adagrad by default: DistBelief found Downpour + Adagrad best, or
SGD) is fixed when replica 0 creates the tensors. Warm start: replica 0 trains ``warm_start``
minibatches alone; the others wait for its mark on the board, then pull and join. Replica 0
evaluates the held-out set with the servers' current weights at each epoch end and exports the
final weights (trainer/export.py).

The workers compute ``scale * gradient`` with ``scale = -local_lr`` (one pass per SGD step, see
Model.sgd_step); the push thread rescales by ``-1 / local_lr`` so the servers get gradients.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import json
import logging
import math
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge

from adamps import metrics as am
from adamps.client import ControllerRouting, PSClient, StaticRouting
from adamps.layout import Layout, TensorSpec
from adamps.rpc import get_json
from trainer import export
from trainer.config import TrainConfig
from trainer.hogwild import Hogwild
from trainer.layers import Dense
from trainer.model import Model, resolve_spec

log = logging.getLogger(__name__)

BOARD_TENSOR = "adamps.board"


def board_tensor(run: str = "") -> str:
    """The static-mode board tensor of a training run."""
    return f"{BOARD_TENSOR}.{run}" if run else BOARD_TENSOR


# -- pure rules ------------------------------------------------------------------------------


def required_replicas(n_replicas: int, fraction: float) -> int:
    """How many replicas must finish an epoch for it to be complete (at least one)."""
    return max(1, min(n_replicas, math.ceil(fraction * n_replicas - 1e-9)))


def completed_epoch(finished: Mapping[Any, int], n_replicas: int, fraction: float) -> int:
    """The last complete epoch (0 = none): the largest e such that enough replicas have
    finished e or a later epoch. ``finished`` maps replica -> its last finished epoch."""
    last = sorted((int(v) for v in finished.values()), reverse=True)
    last += [0] * (n_replicas - len(last))
    return last[required_replicas(n_replicas, fraction) - 1]


def use_vectors(k: int, m: int, n: int) -> bool:
    """Send k activation/error vector pairs instead of the M x N delta (Adam 3.2.6)?"""
    return k * (m + n) < m * n


# -- what a round produces, and the coalescing push queue -------------------------------------


@dataclass
class PushItem:
    """Updates of one or more rounds, in the workers' units (scale * gradient)."""

    #: tensor -> summed flat delta: conv weights, biases, and fc weights whose vectors were
    #: folded (too many rows to be worth sending as vectors)
    dense: dict[str, np.ndarray]
    #: fc weight -> list of (a [k,N], e [k,M]) blocks, stacked when sent
    vectors: dict[str, list[tuple[np.ndarray, np.ndarray]]]
    steps: int = 0  #: minibatches it covers

    def merge(self, other: PushItem) -> None:
        """Adds another item's updates (the other item is consumed). Stacks of vectors that
        would no longer be smaller than the matrix are folded into a dense delta at once, so
        a long backlog costs bounded memory."""
        for name, d in other.dense.items():
            if name in self.dense:
                self.dense[name] += d
            else:
                self.dense[name] = d
        for name, blocks in other.vectors.items():
            mine = self.vectors.setdefault(name, [])
            mine.extend(blocks)
            if mine:
                k = sum(b[0].shape[0] for b in mine)
                if not use_vectors(k, mine[0][1].shape[1], mine[0][0].shape[1]):
                    self.fold(name)
        self.steps += other.steps

    def fold(self, name: str) -> None:
        """Replaces the vectors of fc weight ``name`` by their dense delta e.T @ a."""
        a, e = stack(self.vectors.pop(name, []))
        if a is None:
            return
        g = (e.T @ a).reshape(-1)
        if name in self.dense:
            self.dense[name] += g
        else:
            self.dense[name] = g


def stack(blocks: Sequence[tuple[np.ndarray, np.ndarray]]) -> tuple[Any, Any]:
    """The blocks' activation and error vectors as two matrices ((None, None) if empty)."""
    if not blocks:
        return None, None
    if len(blocks) == 1:
        return blocks[0]
    return np.concatenate([b[0] for b in blocks]), np.concatenate([b[1] for b in blocks])


class PushQueue:
    """A FIFO of PushItems and markers (callables run by the push thread in order) that never
    blocks the producer: beyond ``limit`` items a new PushItem is merged into the last one."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._items: collections.deque[Any] = collections.deque()
        self._cond = threading.Condition()
        self._busy = 0  #: items taken by the consumer and not yet done
        self.merged = 0  #: items merged because the queue was full

    def put(self, item: PushItem | Callable[[], None] | None) -> None:
        with self._cond:
            last = self._items[-1] if self._items else None
            if (
                isinstance(item, PushItem)
                and isinstance(last, PushItem)
                and len(self._items) >= self.limit
            ):
                last.merge(item)
                self.merged += 1
            else:
                self._items.append(item)
            self._cond.notify_all()

    def get(self) -> Any:
        with self._cond:
            while not self._items:
                self._cond.wait()
            self._busy += 1
            return self._items.popleft()

    def done(self) -> None:
        with self._cond:
            self._busy -= 1
            self._cond.notify_all()

    def __len__(self) -> int:
        with self._cond:
            return len(self._items)

    def pending(self) -> list[PushItem]:
        """The PushItems not yet taken by the consumer (only the producer may merge into them,
        so the caller, being the producer, can read them without the lock)."""
        with self._cond:
            return [x for x in self._items if isinstance(x, PushItem)]

    def join(self, timeout: float, alive: Callable[[], bool] = lambda: True) -> bool:
        """Waits until everything queued was processed; False on timeout or a dead consumer."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._items or self._busy:
                left = deadline - time.monotonic()
                if left <= 0 or not alive():
                    return False
                self._cond.wait(min(left, 0.2))
        return True


# -- the workers (run inside Hogwild worker processes or threads) ----------------------------


@dataclass(frozen=True)
class PackPlan:
    """Where each worker leaves its updates in the shared buffers."""

    #: (tensor, slice of the flat parameters, offset in the accumulator)
    dense: tuple[tuple[str, slice, int], ...]
    n_dense: int
    #: (fc weight, M, N, offset of its a block, offset of its e block) in the vector buffer
    fc: tuple[tuple[str, int, int, int, int], ...]
    max_rows: int
    n_vec: int

    @classmethod
    def of(cls, model: Model, max_rows: int) -> PackPlan:
        fc_names = {f"{layer.name}.w" for layer in model.layers if isinstance(layer, Dense)}
        slices = model.slices()
        dense, off = [], 0
        fc, voff = [], 0
        for name, shape in model.tensors():
            if name in fc_names:
                m, n = shape
                fc.append((name, m, n, voff, voff + max_rows * n))
                voff += max_rows * (m + n)
            else:
                dense.append((name, slices[name], off))
                off += int(np.prod(shape))
        return cls(tuple(dense), off, tuple(fc), max_rows, voff)

    def buffers(self, n_workers: int) -> dict[str, int]:
        out = {}
        for w in range(n_workers):
            out[f"acc{w}"] = self.n_dense
            out[f"vec{w}"] = self.n_vec
        return out


class DownpourWorker:
    """A worker's step function: SGD on the shared local weights (no locks) for the minibatches
    of one round, leaving the accumulated conv/bias deltas and the fc vectors in its buffers."""

    def __init__(
        self,
        spec: dict[str, Any],
        local_lr: float,
        plan: PackPlan,
        worker_id: int,
        params: np.ndarray,
        buffers: dict[str, np.ndarray],
    ) -> None:
        self.model = Model(spec, params=params)
        self.scale = -local_lr
        self.plan = plan
        self.acc = buffers[f"acc{worker_id}"]
        vec = buffers[f"vec{worker_id}"]
        self.vec = {
            name: (
                vec[ao : ao + plan.max_rows * n].reshape(plan.max_rows, n),
                vec[eo : eo + plan.max_rows * m].reshape(plan.max_rows, m),
            )
            for name, m, n, ao, eo in plan.fc
        }
        self.dense = [
            (self.model.grads[sl], self.acc[off : off + (sl.stop - sl.start)])
            for _name, sl, off in plan.dense
        ]

    def __call__(self, batches: list[tuple[np.ndarray, np.ndarray]]) -> tuple[float, int, int]:
        """Train on the batches; return (sum of batch losses, batches, rows of vectors)."""
        model = self.model
        total = 0.0
        rows = 0
        for x, y in batches:
            total += model.loss_and_grad(model.prepare(x), y, scale=self.scale)
            model.params += model.grads  # the local step (scale already holds -lr)
            for g, acc in self.dense:
                acc += g
            k = len(y)
            for name, (a, e) in model.fc_vectors().items():
                abuf, ebuf = self.vec[name]
                abuf[rows : rows + k] = a
                ebuf[rows : rows + k] = e
            rows += k
        return total, len(batches), rows


def downpour_worker_factory(
    spec: dict[str, Any],
    local_lr: float,
    plan: PackPlan,
    worker_id: int,
    params: np.ndarray,
    buffers: dict[str, np.ndarray],
) -> DownpourWorker:
    """Hogwild factory (module level, so picklable through functools.partial)."""
    return DownpourWorker(spec, local_lr, plan, worker_id, params, buffers)


def collect_round(
    buffers: Mapping[str, np.ndarray], plan: PackPlan, outs: Sequence[tuple[float, int, int]]
) -> PushItem:
    """Takes a round's updates out of the workers' buffers (while the workers are idle) and
    clears the accumulators. ``outs`` are the workers' (loss, batches, rows) replies."""
    dense: dict[str, np.ndarray] = {}
    vectors: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
    for w, (_loss, n_batches, rows) in enumerate(outs):
        if n_batches == 0:
            continue
        acc = buffers[f"acc{w}"]
        for name, sl, off in plan.dense:
            part = acc[off : off + (sl.stop - sl.start)]
            if name in dense:
                dense[name] += part
            else:
                dense[name] = part.copy()
        acc[...] = 0.0
        vec = buffers[f"vec{w}"]
        for name, m, n, ao, eo in plan.fc:
            a = vec[ao : ao + rows * n].reshape(rows, n).copy()
            e = vec[eo : eo + rows * m].reshape(rows, m).copy()
            vectors.setdefault(name, []).append((a, e))
    return PushItem(dense, vectors, sum(o[1] for o in outs))


def push_parts(
    item: PushItem, inv: float, shapes: Mapping[str, tuple[int, ...]]
) -> list[tuple[Any, ...]]:
    """What the push thread sends for one item: ("fc", tensor, a, e) or ("dense", tensor,
    gradient), gradients rescaled from the workers' units by ``inv`` (= -1 / local_lr). A fully
    connected weight goes as vectors while k * (M + N) < M * N, else as e.T @ a."""
    parts: list[tuple[Any, ...]] = []
    dense = dict(item.dense)
    for name, blocks in item.vectors.items():
        a, e = stack(blocks)
        if a is None:
            continue
        m, n = shapes[name]
        if name not in dense and use_vectors(a.shape[0], m, n):
            parts.append(("fc", name, a, e * inv))
        else:
            g = (e.T @ a).reshape(-1)
            dense[name] = dense[name] + g if name in dense else g
    for name, d in dense.items():
        parts.append(("dense", name, (d * inv).reshape(shapes[name])))
    return parts


# -- boards: where replicas meet (warm start, epochs finished) --------------------------------


class Board:
    """Warm-start mark and per-replica finished epochs, shared by the replicas."""

    def mark_warm(self) -> None:
        raise NotImplementedError

    def warm_done(self) -> bool:
        raise NotImplementedError

    def report(self, epoch: int, progress: float, done: bool) -> None:
        raise NotImplementedError

    def finished(self) -> dict[str, int]:
        """replica -> the last epoch it finished (0: none)."""
        raise NotImplementedError


class PsBoard(Board):
    """A float32 vector on the parameter servers: element r = the last epoch replica r
    finished, element n = 1 once replica 0's warm start is done. Replicas add to it (SGD with
    lr = -1); every push is applied exactly once, so the counts are exact."""

    def __init__(self, client: PSClient, replica: int, n_replicas: int, run: str = "") -> None:
        self.client = client
        self.replica = replica
        self.n = n_replicas
        self.tensor = board_tensor(run)
        client.create(
            TensorSpec(self.tensor, (n_replicas + 1,)),
            init={"kind": "zeros"},
            optimizer={"kind": "sgd", "lr": -1.0},
        )
        self._values = self._pull()
        self._last = int(self._values[replica])

    def _pull(self) -> np.ndarray:
        return self.client.pull([self.tensor])[0][self.tensor]

    def _add(self, index: int, amount: float) -> None:
        delta = np.zeros(self.n + 1, np.float32)
        delta[index] = amount
        self.client.push_dense(self.tensor, delta)

    def mark_warm(self) -> None:
        if self._pull()[self.n] < 1:
            self._add(self.n, 1.0)

    def warm_done(self) -> bool:
        return bool(self._pull()[self.n] >= 1)

    def report(self, epoch: int, progress: float, done: bool) -> None:
        if done and epoch > self._last:
            self._add(self.replica, float(epoch - self._last))
            self._last = epoch

    def finished(self) -> dict[str, int]:
        values = self._pull()
        return {str(r): int(values[r]) for r in range(self.n)}


class ControllerBoard(Board):
    """The controllers' /progress (Adam 3.2.5: progress is recorded at the controller). The
    warm-start mark is replica 0's report for epoch 0. With a run name, replicas report as
    "<run>/<replica>" so that runs do not see each other's progress."""

    def __init__(self, controllers: Sequence[str], token: str, replica: int, run: str = "") -> None:
        self.controllers = list(controllers)
        self.token = token
        self.prefix = f"{run}/" if run else ""
        self.replica = self.prefix + str(replica)
        self._local = threading.local()

    def _ctl(self) -> Any:
        from adamps.controller_client import ControllerClient

        ctl = getattr(self._local, "ctl", None)
        if ctl is None:
            ctl = self._local.ctl = ControllerClient(self.controllers, self.token, retry_for=30.0)
        return ctl

    def mark_warm(self) -> None:
        self._ctl().report_progress(0, self.prefix + "0", 1.0, True)

    def warm_done(self) -> bool:
        replicas = self._ctl().progress(0).get("replicas", {})
        return bool(replicas.get(self.prefix + "0", {}).get("done"))

    def report(self, epoch: int, progress: float, done: bool) -> None:
        self._ctl().report_progress(epoch, self.replica, float(progress), done)

    def finished(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for epoch, replicas in self._ctl().progress().get("epochs", {}).items():
            e = int(epoch)
            if e < 1:
                continue
            for r, p in replicas.items():
                if p.get("done") and r.startswith(self.prefix) and "/" not in r[len(self.prefix) :]:
                    out[r] = max(out.get(r, 0), e)
        return out


# -- metrics -----------------------------------------------------------------------------------


class TrainerMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.images = Counter(
            "adamps_trainer_images", "training images processed", registry=registry
        )
        self.loss = Gauge(
            "adamps_trainer_loss", "mean training loss of the last rounds", registry=registry
        )
        self.rate = Gauge(
            "adamps_trainer_images_per_second",
            "training images per second (last seconds)",
            registry=registry,
        )
        self.staleness = Gauge(
            "adamps_trainer_fetch_staleness_steps",
            "replica steps taken between the request and the install of the last fetched parameters",
            registry=registry,
        )
        self.bytes_pushed = Counter(
            "adamps_trainer_bytes_pushed",
            "array bytes pushed, by kind",
            ["kind"],
            registry=registry,
        )
        self.pushes = Counter(
            "adamps_trainer_pushes", "tensor pushes, by kind", ["kind"], registry=registry
        )
        self.fetches = Counter(
            "adamps_trainer_fetches", "parameter fetches installed", registry=registry
        )
        self.merged = Counter(
            "adamps_trainer_pushes_merged",
            "rounds merged into a queued push (network behind)",
            registry=registry,
        )
        self.queue = Gauge(
            "adamps_trainer_push_queue", "pushes waiting for the push thread", registry=registry
        )
        self.accuracy = Gauge(
            "adamps_trainer_heldout_accuracy",
            "held-out accuracy at the last epoch end (replica 0)",
            registry=registry,
        )
        self.epoch = Gauge("adamps_trainer_epoch", "epoch this replica trains", registry=registry)
        self.completed = Gauge(
            "adamps_trainer_completed_epoch", "last epoch complete by the epoch-end rule", registry=registry
        )  # fmt: skip
        self.comp_choices = Counter(
            "adamps_trainer_compression_choices",
            "compression: per pushed tensor, the form sent (the smallest of vectors, "
            "compressed, dense)",
            ["form"],
            registry=registry,
        )
        self.comp_saved = Counter(
            "adamps_trainer_compression_bytes_saved",
            "compression: bytes the same pushes would have taken uncompressed (dense deltas, fc "
            "vectors) minus the bytes sent",
            registry=registry,
        )
        self.comp_sent = Counter(
            "adamps_trainer_compression_elements_sent",
            "compression: tensor elements sent (a vectors or dense push sends all of its tensor)",
            registry=registry,
        )
        self.comp_elements = Counter(
            "adamps_trainer_compression_elements",
            "compression: tensor elements offered to the compressor (sent or kept in the residual)",
            registry=registry,
        )
        self.comp_fraction = Gauge(
            "adamps_trainer_compression_sent_fraction",
            "compression: fraction of the elements sent by the last push",
            registry=registry,
        )
        self.comp_residual = Gauge(
            "adamps_trainer_compression_residual_norm",
            "compression: L2 norm of a tensor's residual (gradient not sent yet)",
            ["tensor"],
            registry=registry,
        )
        self.comp_tau = Gauge(
            "adamps_trainer_compression_tau",
            "compression: the threshold of a tensor's last compressed push",
            ["tensor"],
            registry=registry,
        )
        for kind in ("dense", "fc", "compressed"):
            self.bytes_pushed.labels(kind)
            self.pushes.labels(kind)
        for form in ("vectors", "compressed", "dense"):
            self.comp_choices.labels(form)


# -- the background threads --------------------------------------------------------------------


class _Loop(threading.Thread):
    """A daemon thread whose exception is kept for the main thread to raise."""

    def __init__(self, name: str, target: Callable[[], None]) -> None:
        super().__init__(name=name, daemon=True)
        self._target_fn = target
        self.error: BaseException | None = None
        self.cpu_seconds = 0.0

    def run(self) -> None:
        try:
            self._target_fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread
            log.exception("%s thread failed", self.name)
            self.error = exc
        finally:
            self.cpu_seconds = time.thread_time()  #: CPU this thread used (where time goes)


class Fetcher:
    """Pulls every tensor into a staging buffer when asked; the main thread installs it."""

    def __init__(self, client: PSClient, model: Model) -> None:
        self.client = client
        self.names = [n for n, _ in model.tensors()]
        self.staging = np.zeros(model.n_params, np.float32)
        sl = model.slices()
        self.out = {n: self.staging[sl[n]].reshape(s) for n, s in model.tensors()}
        self._want = threading.Event()
        self._ready = threading.Event()
        self._stop = False
        self.requested_at = 0  #: replica step of the pending request
        self.pending = False
        self.thread = _Loop("fetch", self._run)

    def request(self, step: int) -> None:
        self.requested_at = step
        self.pending = True
        self._ready.clear()
        self._want.set()

    def ready(self) -> bool:
        return self.pending and self._ready.is_set()

    def take(self) -> np.ndarray:
        self.pending = False
        return self.staging

    def _run(self) -> None:
        while True:
            self._want.wait()
            self._want.clear()
            if self._stop:
                return
            self.client.pull(self.names, out=self.out)
            self._ready.set()

    def stop(self) -> None:
        self._stop = True
        self._want.set()


# -- the replica -----------------------------------------------------------------------------


@dataclass
class EpochStats:
    loss_sum: float = 0.0
    batches: int = 0
    images: int = 0
    seconds: float = 0.0
    moved_on: bool = False
    t_data: float = 0.0  #: seconds the main loop waited for minibatches
    t_compute: float = 0.0  #: seconds in the workers' rounds
    t_install: float = 0.0  #: seconds installing fetched parameters


@dataclass
class ReplicaResult:
    epochs: dict[int, EpochStats] = field(default_factory=dict)
    accuracy: dict[int, float] = field(default_factory=dict)  #: replica 0 only
    images: int = 0
    seconds: float = 0.0
    out: str | None = None
    cpu_threads: dict[str, float] = field(default_factory=dict)
    #: array payload bytes pushed (dense deltas, vectors, compressed updates)
    bytes_pushed: int = 0
    #: pushes (queue items sent, each one or more rounds of the workers)
    pushes: int = 0
    #: elements sent / elements offered by the compressor (None without --compress)
    sent_fraction: float | None = None


class Replica:
    """One model replica training with Downpour SGD. ``run()`` returns when it is done."""

    def __init__(self, cfg: TrainConfig, registry: CollectorRegistry | None = None) -> None:
        from dataserver.client import DataClient

        self.cfg = cfg
        self.spec = resolve_spec(cfg.model)
        self.model = Model(self.spec)  # evaluation model and the layout's source
        self.registry = registry if registry is not None else am.new_registry()
        self.m = TrainerMetrics(self.registry)
        self.data = DataClient(cfg.dataservers, cfg.token)
        self.tensors = [TensorSpec(n, tuple(s)) for n, s in self.model.tensors()]
        self.layout: Layout | None = None
        self.client: PSClient | None = None
        self.board: Board | None = None
        self.pushq = PushQueue(cfg.push_queue)
        #: Strom's compression with a residual per tensor (push thread only), with --compress
        self.compressor: Any = None
        #: elements sent, elements offered to the compressor (push thread only)
        self._comp_totals = [0, 0]
        self.result = ReplicaResult()
        self.step = 0  #: replica steps (minibatches of all workers) so far
        self.epoch = 0
        self.completed = 0  #: last complete epoch seen on the board
        self.finished_epoch = 0  #: last epoch this replica finished, its pushes acknowledged
        self.reported_epoch = 0  #: last finished epoch reported to the board
        self.warm_marked = cfg.replica != 0
        self.last_staleness: int | None = None
        #: fetches installed so far (also the adamps_trainer fetch counter; read here, not there)
        self.fetches = 0
        self._stopping = threading.Event()
        self._n_train: int | None = None
        self._rate_window: collections.deque[tuple[float, int]] = collections.deque(maxlen=64)
        self._loss_window: collections.deque[float] = collections.deque(maxlen=32)
        self.recent_loss = float("nan")
        self._merged_seen_before = 0

    # -- setup ---------------------------------------------------------------------------------

    def _setup_cluster(self) -> None:
        cfg = self.cfg
        if cfg.controllers:
            from adamps.controller_client import ControllerClient

            ctl = ControllerClient(cfg.controllers, cfg.token, retry_for=cfg.wait_timeout)
            try:
                self.layout = self._controller_layout(ctl)
            finally:
                ctl.close()
            routing: Any = ControllerRouting(cfg.controllers)
        else:
            status = get_json(cfg.ps[0], "/status")
            n_buckets = int(status["n_buckets"])
            max_elems = int(status.get("config", {}).get("max_shard_elems", 262_144))
            self.layout = Layout(self.tensors, n_buckets, max_elems)
            routing = StaticRouting(cfg.ps, n_buckets)
        self.client = PSClient(routing, self.layout, cfg.token, retry_for=60.0)
        if cfg.compress:
            from trainer.compress import Compressor

            self.compressor = Compressor(
                self.layout.shards_of,
                fraction=cfg.compress_fraction,
                taus=cfg.compress_tau,
                coding=cfg.compress_coding,
            )
        if cfg.controllers:
            self.board = ControllerBoard(cfg.controllers, cfg.token, cfg.replica, cfg.run)
        else:
            self.board = PsBoard(self.client, cfg.replica, cfg.n_replicas, cfg.run)
        earlier = self.board.finished()
        if any(earlier.values()):
            log.warning(
                "the board already records finished epochs %s (an earlier run%s?): complete "
                "epochs are skipped; give a new --run name to start a new run on these servers",
                earlier, f" named {cfg.run!r}" if cfg.run else "",
            )  # fmt: skip

    def _controller_layout(self, ctl: Any) -> Layout:
        """Replica 0 stores the model's layout at the controllers; the others read it there, so
        every replica derives the same shards and buckets."""
        want = {t.name: t.shape for t in self.tensors}
        deadline = time.monotonic() + self.cfg.wait_timeout
        while True:
            if self.cfg.replica == 0:
                n_buckets = int(ctl.routing()["n_buckets"])
                layout = Layout(self.tensors, n_buckets)
                ctl.set_layout(layout.to_dict())
                return layout
            got = ctl.layout()
            if got is not None:
                layout = Layout.from_dict(got["layout"])
                if {n: t.shape for n, t in layout.tensors.items()} == want:
                    return layout
            if time.monotonic() > deadline:
                raise TimeoutError("no layout of this model at the controllers (is replica 0 up?)")
            time.sleep(0.2)

    def _create_tensors(self) -> None:
        """Replica 0 defines every tensor with its initial values and the optimizer."""
        assert self.client is not None
        init = Model(self.spec)
        init.init_params(self.cfg.seed)
        optimizer: dict[str, Any] = {"kind": self.cfg.optimizer, "lr": self.cfg.server_lr}
        if self.cfg.optimizer == "adagrad":
            optimizer["initial_accumulator"] = self.cfg.adagrad_initial
        for t in self.tensors:
            self.client.create(
                t, init={"kind": "values", "values": init.param(t.name)}, optimizer=optimizer
            )

    def _wait_warm(self) -> None:
        assert self.board is not None
        deadline = time.monotonic() + self.cfg.wait_timeout
        logged = False
        while not self.board.warm_done():
            if not logged:
                log.info("waiting for replica 0 (tensors created, warm start done)")
                logged = True
            if time.monotonic() > deadline:
                raise TimeoutError("replica 0 did not finish its warm start in time")
            if self._stopping.wait(0.2):
                raise KeyboardInterrupt
        log.info("replica 0's warm start is done: joining")

    # -- threads ---------------------------------------------------------------------------------

    def _push_loop(self) -> None:
        assert self.client is not None
        inv = -1.0 / self.cfg.local_lr
        shapes = {t.name: t.shape for t in self.tensors}
        while True:
            item = self.pushq.get()
            try:
                if item is None:
                    return
                if callable(item):
                    item()
                    continue
                self._push(item, inv, shapes)
            finally:
                self.pushq.done()
                self.m.queue.set(len(self.pushq))

    def _push(self, item: PushItem, inv: float, shapes: Mapping[str, tuple[int, ...]]) -> None:
        client = self.client
        assert client is not None
        dense: dict[str, np.ndarray] = {}
        compressed: dict[str, dict[str, Any]] = {}
        parts = push_parts(item, inv, shapes)
        self.result.pushes += 1
        if self.compressor is not None:
            parts, st = self.compressor.compress(parts)
            self._count_compression(st)
        for kind, name, *arrays in parts:
            if kind == "fc":
                client.push_fc(name, *arrays)
                self.m.pushes.labels("fc").inc()
            elif kind == "compressed":
                compressed.update(arrays[0].shards)
                self.m.bytes_pushed.labels(kind).inc(arrays[0].nbytes)
                self.result.bytes_pushed += arrays[0].nbytes
                continue
            else:
                dense[name] = arrays[0]
            nbytes = sum(x.nbytes for x in arrays)
            self.m.bytes_pushed.labels(kind).inc(nbytes)
            self.result.bytes_pushed += nbytes
        if compressed:
            client.push_compressed(compressed)
            self.m.pushes.labels("compressed").inc()
        if dense:
            client.push_dense_many(dense)
            self.m.pushes.labels("dense").inc()

    def _count_compression(self, st: Any) -> None:
        assert self.compressor is not None
        m = self.m
        for form, n in st.choices.items():
            m.comp_choices.labels(form).inc(n)
        m.comp_saved.inc(max(0, st.bytes_uncompressed - st.bytes_sent))
        m.comp_sent.inc(st.sent_elements)
        m.comp_elements.inc(st.elements)
        if st.elements:
            m.comp_fraction.set(st.sent_elements / st.elements)
        self._comp_totals[0] += st.sent_elements
        self._comp_totals[1] += st.elements
        self.result.sent_fraction = self._comp_totals[0] / max(1, self._comp_totals[1])
        for name, tc in self.compressor.tensors.items():
            m.comp_residual.labels(name).set(tc.residual_norm())
            m.comp_tau.labels(name).set(tc.last_tau)

    def _finished(self, epoch: int) -> None:
        """Push-thread marker: every push of the epoch is acknowledged."""
        self.finished_epoch = max(self.finished_epoch, epoch)

    def _board_loop(self) -> None:
        """The only writer of this replica's progress (so a progress report can never
        overwrite a later 'done'), and the reader of everybody's."""
        assert self.board is not None
        while not self._stopping.wait(self.cfg.progress_interval):
            finished = self.finished_epoch
            if finished > self.reported_epoch:
                self.board.report(finished, 1.0, True)
                self.reported_epoch = finished
            elif self.cfg.controllers and self.epoch > finished and self._n_train:
                share = self._n_train / self.cfg.n_replicas
                done = self.result.epochs.get(self.epoch, EpochStats()).images
                self.board.report(self.epoch, min(1.0, done / share), False)
            self.completed = max(
                self.completed,
                completed_epoch(
                    self.board.finished(), self.cfg.n_replicas, self.cfg.epoch_fraction
                ),
            )
            self.m.completed.set(self.completed)

    def _check_threads(self, *threads: _Loop) -> None:
        for t in threads:
            if t.error is not None:
                raise RuntimeError(f"the {t.name} thread failed: {t.error!r}") from t.error
            if not t.is_alive():
                raise RuntimeError(f"the {t.name} thread stopped")

    # -- the training loop ---------------------------------------------------------------------

    def stop(self) -> None:
        """Asks run() to stop (from a signal handler or another thread)."""
        self._stopping.set()

    def run(self) -> ReplicaResult:
        cfg = self.cfg
        self._setup_cluster()
        assert self.client is not None and self.board is not None
        with contextlib.suppress(Exception):
            self._n_train = int(get_json(cfg.dataservers[0], "/status")["n_train_total"])
        test_x, test_y = self._heldout() if cfg.replica == 0 else (None, None)
        if cfg.replica == 0:
            self._create_tensors()
        else:
            self._wait_warm()
        params, _ = self.client.pull(
            [t.name for t in self.tensors], out=self._views(self.model.params)
        )
        plan = PackPlan.of(self.model, cfg.n_push * cfg.batch_size)
        factory = self._worker_factory(plan)
        pusher = _Loop("push", self._push_loop)
        boarder = _Loop("board", self._board_loop)
        fetcher = Fetcher(self.client, self.model)
        t_start = time.perf_counter()
        with self._pool(factory, plan) as pool:
            for t in (pusher, boarder, fetcher.thread):
                t.start()
            threads = (pusher, boarder, fetcher.thread)
            try:
                if cfg.replica == 0 and cfg.warm_start == 0:
                    self._mark_warm()
                for epoch in range(1, cfg.epochs + 1):
                    if epoch <= self.completed:
                        log.info("epoch %d is already complete: skipped", epoch)
                        continue
                    self._train_epoch(epoch, pool, plan, fetcher, threads, test_x, test_y)
                    if not self.result.epochs[epoch].moved_on:
                        self.pushq.put(functools.partial(self._finished, epoch))
                if not self.warm_marked:
                    self._mark_warm()  # fewer minibatches than the warm start: let the others go
                if not self.pushq.join(cfg.wait_timeout, pusher.is_alive):
                    self._check_threads(pusher)
                    raise TimeoutError("pushes not acknowledged in time")
                self.result.seconds = time.perf_counter() - t_start
                deadline = time.monotonic() + cfg.wait_timeout
                while self.reported_epoch < self.finished_epoch:  # the board thread reports it
                    self._check_threads(*threads)
                    if time.monotonic() > deadline:
                        raise TimeoutError("could not report the last epoch's end")
                    time.sleep(0.05)
                self._check_threads(*threads)
                if cfg.replica == 0:
                    self._finish(test_x, test_y, threads)
            finally:
                self._stopping.set()
                fetcher.stop()
                self.pushq.put(None)
                for t in (pusher, boarder, fetcher.thread):
                    t.join(5)
                self.result.cpu_threads = {
                    "main": round(time.thread_time(), 2),
                    **{t.name: round(t.cpu_seconds, 2) for t in (pusher, boarder, fetcher.thread)},
                }
                log.info("CPU seconds by thread of the main process: %s", self.result.cpu_threads)
        self.client.close()
        return self.result

    # Hooks of a partitioned replica (trainer/partitioned.py): its workers and its pool.
    def _worker_factory(self, plan: PackPlan) -> Callable[..., Any]:
        return functools.partial(downpour_worker_factory, self.spec, self.cfg.local_lr, plan)

    def _pool(self, factory: Callable[..., Any], plan: PackPlan) -> Any:
        cfg = self.cfg
        buffers = plan.buffers(cfg.workers)
        return Hogwild(
            factory, cfg.workers, self.model.params, mode=cfg.worker_mode, buffers=buffers
        )

    def _mark_warm(self) -> None:
        assert self.board is not None
        self.warm_marked = True
        board = self.board

        def mark() -> None:
            board.mark_warm()
            log.info("warm start done after %d steps: the other replicas may join", self.step)

        self.pushq.put(mark)  # after every push before it is acknowledged

    def _views(self, flat: np.ndarray) -> dict[str, np.ndarray]:
        sl = self.model.slices()
        return {n: flat[sl[n]].reshape(s) for n, s in self.model.tensors()}

    def _rounds(
        self, it: Iterator[Any], per_round: int
    ) -> Iterator[list[tuple[np.ndarray, np.ndarray]]]:
        while True:
            batch = []
            for b in it:
                batch.append((b.x, b.y))
                if len(batch) == per_round:
                    break
            if not batch:
                return
            yield batch

    def _train_epoch(
        self,
        epoch: int,
        pool: Hogwild,
        plan: PackPlan,
        fetcher: Fetcher,
        threads: tuple[_Loop, ...],
        test_x: np.ndarray | None,
        test_y: np.ndarray | None,
    ) -> None:
        cfg = self.cfg
        W = cfg.workers
        self.epoch = epoch
        self.m.epoch.set(epoch)
        stats = self.result.epochs.setdefault(epoch, EpochStats())
        steps_since_fetch = 0
        bar = _progress_bar(epoch, self._n_train, cfg)
        it = self.data.epoch(
            cfg.replica, cfg.n_replicas, epoch, batch_size=cfg.batch_size, prefetch=16
        )
        t_epoch = time.perf_counter()
        try:
            t_mark = time.perf_counter()
            for batches in self._rounds(it, W * cfg.n_push):
                if self._stopping.is_set():
                    raise KeyboardInterrupt
                self._check_threads(*threads)
                t1 = time.perf_counter()
                outs = pool.run([batches[w::W] for w in range(W)])
                t2 = time.perf_counter()
                self.pushq.put(collect_round(pool.buffers, plan, outs))
                stats.t_data += t1 - t_mark
                stats.t_compute += t2 - t1
                n_img = sum(len(b[1]) for b in batches)
                loss = sum(o[0] for o in outs)
                self._account(stats, len(batches), n_img, loss)
                if bar is not None:
                    bar.update(n_img)
                    bar.set_postfix(loss=f"{self.recent_loss:.3f}", refresh=False)
                if not self.warm_marked and self.step >= cfg.warm_start:
                    self._mark_warm()
                # Downpour fetch: ask every n_fetch minibatches per worker, install when there
                steps_since_fetch += cfg.n_push
                if fetcher.ready():
                    t3 = time.perf_counter()
                    self._install(pool.params, fetcher.take())
                    stats.t_install += time.perf_counter() - t3
                    self.last_staleness = self.step - fetcher.requested_at
                    self.m.staleness.set(self.last_staleness)
                    self.m.fetches.inc()
                    self.fetches += 1
                if not fetcher.pending and steps_since_fetch >= cfg.n_fetch and self.warm_marked:
                    fetcher.request(self.step)
                    steps_since_fetch = 0
                if cfg.replica == 0:
                    self._evaluate_completed(test_x, test_y)
                t_mark = time.perf_counter()
                if self.completed >= epoch:
                    stats.moved_on = True
                    log.info("epoch %d is complete (%.0f%% of the replicas finished it): moving on",
                             epoch, 100 * cfg.epoch_fraction)  # fmt: skip
                    break
        finally:
            stats.seconds += time.perf_counter() - t_epoch
            it.close()
            if bar is not None:
                bar.close()
        log.info(
            "epoch %d: %d images, loss %.4f, %.0f images/s%s; fetches %d, staleness %s steps, "
            "rounds merged into queued pushes %d; seconds waiting for data %.2f, in rounds %.2f, "
            "installing fetches %.2f",
            epoch, stats.images, stats.loss_sum / max(stats.batches, 1),
            stats.images / max(stats.seconds, 1e-9), " (moved on)" if stats.moved_on else "",
            self.fetches, self.last_staleness, self.pushq.merged,
            stats.t_data, stats.t_compute, stats.t_install,
        )  # fmt: skip

    def _install(self, params: np.ndarray, fetched: np.ndarray) -> None:
        """Fetched parameters become the local copy, plus the local updates still waiting in
        the push queue: they are not on the servers yet, and dropping them would make the
        replica compute them again (with a backlog of pushes, in effect a larger learning
        rate). The push in flight is counted as arrived."""
        params[...] = fetched
        sl = self.model.slices()
        shapes = dict(self.model.tensors())
        if self.compressor is not None:
            # Compressed pushes: the residuals are local updates not on the servers either
            # (gradient units; the workers' units are -local_lr * gradient).
            self.compressor.add_residuals(params, sl, -self.cfg.local_lr)
        for item in self.pushq.pending():
            for name, d in item.dense.items():
                params[sl[name]] += d
            for name, blocks in item.vectors.items():
                a, e = stack(blocks)
                if a is not None:
                    params[sl[name]].reshape(shapes[name])[...] += e.T @ a

    def _account(self, stats: EpochStats, batches: int, images: int, loss: float) -> None:
        self.step += batches
        stats.batches += batches
        stats.images += images
        stats.loss_sum += loss
        self.result.images += images
        self.m.images.inc(images)
        self._loss_window.append(loss / max(batches, 1))
        self.recent_loss = sum(self._loss_window) / len(self._loss_window)
        self.m.loss.set(self.recent_loss)
        now = time.monotonic()
        self._rate_window.append((now, self.result.images))
        t0, n0 = self._rate_window[0]
        if now > t0:
            self.m.rate.set((self.result.images - n0) / (now - t0))
        self.m.queue.set(len(self.pushq))
        merged = self.pushq.merged
        self.m.merged.inc(merged - self._merged_seen_before)
        self._merged_seen_before = merged

    # -- evaluation and the end (replica 0) ------------------------------------------------------

    def _heldout(self) -> tuple[np.ndarray, np.ndarray]:
        xs, ys = [], []
        for b in self.data.epoch(0, 1, 0, batch_size=1000, split="test"):
            xs.append(b.x)
            ys.append(b.y)
        return self.model.prepare(np.concatenate(xs)), np.concatenate(ys)

    def _evaluate_completed(self, test_x: np.ndarray | None, test_y: np.ndarray | None) -> None:
        done = min(self.completed, self.cfg.epochs)
        if test_x is None or not done or done in self.result.accuracy:
            return
        self._evaluate(done, test_x, test_y)

    def _evaluate(self, epoch: int, test_x: np.ndarray, test_y: np.ndarray) -> float:
        assert self.client is not None
        self.client.pull([t.name for t in self.tensors], out=self._views(self.model.params))
        acc = self.model.accuracy(test_x, test_y)
        self.result.accuracy[epoch] = acc
        self.m.accuracy.set(acc)
        st = self.result.epochs.get(epoch, EpochStats())
        rec = {
            "time": time.time(),
            "epoch": epoch,
            "loss": round(st.loss_sum / max(st.batches, 1), 6),
            "accuracy": acc,
            "images_per_s": round(st.images / max(st.seconds, 1e-9), 1),
            "replicas": self.cfg.n_replicas,
        }
        log.info("epoch %d complete: held-out accuracy %.4f (server weights)", epoch, acc)
        if self.cfg.history:
            with open(self.cfg.history, "a") as fh:
                fh.write(json.dumps(rec) + "\n")
        return acc

    def _finish(self, test_x: Any, test_y: Any, threads: tuple[_Loop, ...]) -> None:
        """Replica 0: wait for the last epoch to complete, evaluate the epochs not yet
        evaluated, export the final weights."""
        cfg = self.cfg
        deadline = time.monotonic() + cfg.wait_timeout
        while self.completed < cfg.epochs:
            self._check_threads(*threads)
            self._evaluate_completed(test_x, test_y)
            if time.monotonic() > deadline:
                raise TimeoutError(f"epoch {cfg.epochs} did not complete in time")
            time.sleep(0.1)
        if cfg.epochs in self.result.accuracy:  # evaluated early: pull what the servers hold now
            self.client.pull([t.name for t in self.tensors], out=self._views(self.model.params))
        else:
            self._evaluate(cfg.epochs, test_x, test_y)
        if cfg.out:
            views = self._views(self.model.params)
            meta = {
                "epochs": cfg.epochs,
                "replicas": cfg.n_replicas,
                "optimizer": {"kind": cfg.optimizer, "lr": cfg.server_lr},
                "heldout_accuracy": self.result.accuracy.get(cfg.epochs),
            }
            self.result.out = str(export.save(cfg.out, self.spec, views, meta))
            log.info("final weights written to %s", self.result.out)


def _progress_bar(epoch: int, n_train: int | None, cfg: TrainConfig) -> Any:
    """A tqdm bar on a terminal; None otherwise (plain log lines then)."""
    if not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    total = None if n_train is None else math.ceil(n_train / cfg.n_replicas)
    return tqdm(total=total, desc=f"epoch {epoch}/{cfg.epochs}", unit="img", leave=True)
