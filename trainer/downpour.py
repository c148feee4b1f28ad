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
  (adamps/compression/error_feedback.py: a residual per tensor with error feedback, +-tau per sent element),
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

The parts live in modules of their own: trainer/schedule.py (the rules: rounds, fetches, the
epoch-end rule; pure), trainer/packing.py (what a round produces and a push sends),
trainer/push_queue.py, trainer/pusher.py (the push thread), trainer/fetcher.py,
trainer/board.py, trainer/metrics.py. This module is the replica: its main loop and the board
thread.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import json
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry

from adamps import metrics as am
from adamps.client import ControllerRouting, PSClient, StaticRouting
from adamps.client.rpc import get_json
from adamps.layout import Layout, TensorSpec
from adamps.progress import Progress
from trainer import export, tensor_setup
from trainer.board import Board, ControllerBoard, PsBoard
from trainer.config import TrainConfig
from trainer.fetcher import Fetcher
from trainer.hogwild import Hogwild
from trainer.loop import Loop
from trainer.metrics import TrainerMetrics
from trainer.model import Model, fuse_layers, in_namespace, resolve_spec
from trainer.packing import PackPlan, add_pending, collect_round, downpour_worker_factory
from trainer.push_queue import PushQueue
from trainer.pusher import Pusher
from trainer.schedule import Schedule, completed_epoch

log = logging.getLogger(__name__)


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
        # A run's tensors live in its namespace (issue 25): "<run>..<layer>.<w|b>" on the
        # servers and in the layout, so runs with the same layer names never share a tensor.
        self.spec = in_namespace(resolve_spec(cfg.model), cfg.run)
        if cfg.fuse_tensors:  # small layers in placement groups: few buckets a round
            self.spec = fuse_layers(self.spec, cfg.run)
        self.model = Model(self.spec)  # evaluation model and the layout's source
        self.registry = registry if registry is not None else am.new_registry()
        self.m = TrainerMetrics(self.registry)
        self.data = DataClient(cfg.dataservers, cfg.token)
        self.tensors = [TensorSpec(n, tuple(s)) for n, s in self.model.tensors()]
        self.layout: Layout | None = None
        self.client: PSClient | None = None
        self.board: Board | None = None
        self.pushq = PushQueue(cfg.push_queue)
        #: Strom's compression with a residual per tensor, with --compress: the push thread
        #: compresses; the main thread adds the residuals to installed fetches
        self.compressor: Any = None
        self.pusher: Pusher | None = None
        self.result = ReplicaResult()
        #: the Downpour rules and their counts (steps, epochs complete, finished, reported)
        self.schedule = Schedule.of(cfg)
        #: epochs complete before this replica started: its earlier incarnation evaluated them
        self._evaluated_upto = 0
        self.last_staleness: int | None = None
        #: fetches installed so far (also the adamps_trainer fetch counter; read here, not there)
        self.fetches = 0
        self._stopping = threading.Event()
        self._n_train: int | None = None
        self._rate_window: collections.deque[tuple[float, int]] = collections.deque(maxlen=64)
        self._loss_window: collections.deque[float] = collections.deque(maxlen=32)
        self.recent_loss = float("nan")
        self._merged_seen_before = 0
        #: called in turn once a round is queued for the push thread: an elastic replica's
        #: slice ends (trainer/elastic.py), a consistency mode's step gate (trainer/consistency.py)
        self.round_hooks: list[Callable[[], None]] = []
        if cfg.consistency not in ("", "async"):  # the step gate fetches every step instead
            self.schedule.n_fetch = 1 << 62
            self.schedule.warm_start = 0  # the replicas start together: no warm start alone

    @property
    def step(self) -> int:
        """Replica steps (minibatches of all workers) so far."""
        return self.schedule.step

    @property
    def epoch(self) -> int:
        return self.schedule.epoch

    @property
    def completed(self) -> int:
        """The last complete epoch seen on the board."""
        return self.schedule.completed

    # -- setup ---------------------------------------------------------------------------------

    def _setup_cluster(self) -> None:
        cfg = self.cfg
        if cfg.controllers:
            from adamps.client.controller import ControllerClient

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
        self.client = PSClient(
            routing, self.layout, cfg.token, retry_for=60.0, data_plane=not cfg.http_only
        )
        if cfg.compress:
            from adamps.compression.error_feedback import Compressor

            self.compressor = Compressor(
                self.layout.shards_of,
                fraction=cfg.compress_fraction,
                taus=cfg.compress_tau,
                coding=cfg.compress_coding,
            )
        self.pusher = Pusher(
            self.client, self.pushq, self.m, cfg.local_lr,
            {t.name: t.shape for t in self.tensors}, self.compressor,
        )  # fmt: skip
        if cfg.elastic:  # the run's progress is the data server's slice table
            from trainer.elastic import elastic_board

            self.board = elastic_board(self)
        elif cfg.controllers:
            self.board = ControllerBoard(cfg.controllers, cfg.token, cfg.replica, cfg.run)
        else:
            self.board = PsBoard(self.client, cfg.replica, cfg.n_replicas, cfg.run)
        earlier = self.board.finished()
        if not cfg.elastic:  # evaluated by this replica's earlier incarnation, if any: not again
            self._evaluated_upto = completed_epoch(earlier, cfg.n_replicas, cfg.epoch_fraction)
        if any(earlier.values()):
            log.warning(
                "the board already records finished epochs %s (an earlier run%s?): complete "
                "epochs are skipped; give a new --run name to start a new run on these servers",
                earlier, f" named {cfg.run!r}" if cfg.run else "",
            )  # fmt: skip

    def _controller_layout(self, ctl: Any) -> Layout:
        return tensor_setup.controller_layout(self.cfg, self.tensors, ctl)

    def _create_tensors(self) -> None:
        """Replica 0 defines every tensor with its initial values and the optimizer."""
        assert self.client is not None
        tensor_setup.create_tensors(self.cfg, self.spec, self.tensors, self.client)

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

    # -- the board thread ------------------------------------------------------------------------

    def _board_loop(self) -> None:
        """The only writer of this replica's progress (so a progress report can never
        overwrite a later 'done'), and the reader of everybody's."""
        assert self.board is not None
        sched = self.schedule
        while not self._stopping.wait(self.cfg.progress_interval):
            done = self.result.epochs.get(sched.epoch, EpochStats()).images
            report = sched.next_report(done, self._n_train)
            if report is not None:
                self.board.report(report.epoch, report.progress, report.done)
                sched.reported(report)
            self.m.completed.set(self.board.observe(sched))

    def _check_threads(self, *threads: Loop) -> None:
        for t in threads:
            t.check()

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
            if cfg.init and test_x is not None and test_y is not None:
                # "epoch 0" of the history: where a run started from a checkpoint begins
                self._evaluate(0, test_x, test_y)
        else:
            self._wait_warm()
        params, _ = self.client.pull(
            [t.name for t in self.tensors], out=self._views(self.model.params)
        )
        plan = PackPlan.of(self.model, cfg.n_push * cfg.batch_size)
        factory = self._worker_factory(plan)
        assert self.pusher is not None
        sched = self.schedule
        pusher = Loop("push", self.pusher.loop)
        boarder = Loop("board", self._board_loop)
        fetcher = Fetcher(self.client, self.model)
        t_start = time.perf_counter()
        with self._pool(factory, plan) as pool:
            for t in (pusher, boarder, fetcher.thread):
                t.start()
            threads = (pusher, boarder, fetcher.thread)
            try:
                if sched.warm_due():
                    self._mark_warm()
                if cfg.consistency not in ("", "async"):
                    from trainer.consistency import StepGate

                    gate = StepGate(self, pool.params, pusher)
                    gate.join()
                    self.round_hooks.append(gate.after_round)
                for epoch in range(1, cfg.epochs + 1) if not cfg.elastic else ():
                    if sched.skip(epoch):
                        log.info("epoch %d is already complete: skipped", epoch)
                        continue
                    self._train_epoch(epoch, pool, plan, fetcher, threads, test_x, test_y)
                    if not self.result.epochs[epoch].moved_on:
                        self.pushq.put(functools.partial(sched.epoch_finished, epoch))
                if cfg.elastic:
                    from trainer.elastic import train_slices

                    train_slices(self, lambda e, it: self._train_epoch(
                        e, pool, plan, fetcher, threads, test_x, test_y, it))  # fmt: skip
                if not sched.warm_marked:
                    self._mark_warm()  # fewer minibatches than the warm start: let the others go
                if not self.pushq.join(cfg.wait_timeout, pusher.is_alive):
                    self._check_threads(pusher)
                    raise TimeoutError("pushes not acknowledged in time")
                self.result.seconds = time.perf_counter() - t_start
                deadline = time.monotonic() + cfg.wait_timeout
                while not sched.all_reported:  # the board thread reports the last epoch
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
                self.result.bytes_pushed = self.pusher.bytes_pushed
                self.result.pushes = self.pusher.pushes
                self.result.sent_fraction = self.pusher.sent_fraction
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
        self.schedule.mark_warm()
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
        threads: tuple[Loop, ...],
        test_x: np.ndarray | None,
        test_y: np.ndarray | None,
        it: Any = None,
    ) -> None:
        """Trains ``epoch``'s batches: this replica's static share, or ``it`` (an elastic
        replica's leased slices, whose ends ``self.after_round`` reports behind the pushes)."""
        cfg = self.cfg
        sched = self.schedule
        W = cfg.workers
        sched.start_epoch(epoch)
        self.m.epoch.set(epoch)
        stats = self.result.epochs.setdefault(epoch, EpochStats())
        bar = self._progress_bar(epoch)
        if it is None:
            it = self.data.epoch(
                cfg.replica, cfg.n_replicas, epoch, batch_size=cfg.batch_size, prefetch=16
            )
        t_epoch = time.perf_counter()
        try:
            t_mark = time.perf_counter()
            for batches in self._rounds(it, sched.round_size):
                if self._stopping.is_set():
                    raise KeyboardInterrupt
                self._check_threads(*threads)
                t1 = time.perf_counter()
                outs = pool.run([batches[w::W] for w in range(W)])
                t2 = time.perf_counter()
                self.pushq.put(collect_round(pool.buffers, plan, outs))
                for hook in self.round_hooks:
                    hook()
                stats.t_data += t1 - t_mark
                stats.t_compute += t2 - t1
                n_img = sum(len(b[1]) for b in batches)
                loss = sum(o[0] for o in outs)
                sched.after_round(len(batches))
                self._account(stats, len(batches), n_img, loss)
                bar.update(n_img, f"loss={self.recent_loss:.3f}")
                if sched.warm_due():
                    self._mark_warm()
                # Downpour fetch: ask every n_fetch minibatches per worker, install when there
                if fetcher.ready():
                    t3 = time.perf_counter()
                    self._install(pool.params, fetcher.take())
                    stats.t_install += time.perf_counter() - t3
                    self.last_staleness = sched.staleness(fetcher.requested_at)
                    self.m.staleness.set(self.last_staleness)
                    self.m.fetches.inc()
                    self.fetches += 1
                if sched.want_fetch(fetcher.pending):
                    fetcher.request(sched.step)
                if cfg.replica == 0:
                    self._evaluate_completed(test_x, test_y)
                t_mark = time.perf_counter()
                if sched.move_on(epoch):
                    stats.moved_on = True
                    log.info("epoch %d is complete (%.0f%% of the replicas finished it): moving on",
                             epoch, 100 * cfg.epoch_fraction)  # fmt: skip
                    break
        finally:
            stats.seconds += time.perf_counter() - t_epoch
            if hasattr(it, "close"):
                it.close()
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

    def _progress_bar(self, epoch: int) -> Progress:
        """The epoch's bar of images (this replica's share of the training set) on stderr: live
        on a terminal, a plain line every few seconds in a log."""
        n = self._n_train
        total = None if n is None else math.ceil(n / self.cfg.n_replicas)
        return Progress(f"epoch {epoch}/{self.cfg.epochs}", total, "img")

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
        add_pending(params, self.pushq.pending(), sl, shapes)

    def _account(self, stats: EpochStats, batches: int, images: int, loss: float) -> None:
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
        """Evaluate every epoch completed since the last call. The board can report two epochs
        complete between two calls (a loaded machine, or a replica that was in its last rounds):
        each still gets its line in --history, with the servers' weights as they are now."""
        if test_x is None:
            return
        for epoch in range(self._evaluated_upto + 1, min(self.completed, self.cfg.epochs) + 1):
            if epoch not in self.result.accuracy:
                self._evaluate(epoch, test_x, test_y)

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

    def _finish(self, test_x: Any, test_y: Any, threads: tuple[Loop, ...]) -> None:
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
        # the epochs this replica skipped or moved on from before it evaluated them (the board
        # reported them complete between two rounds, or before an epoch's first round)
        self._evaluate_completed(test_x, test_y)
        if cfg.epochs in self.result.accuracy:  # evaluated early: pull what the servers hold now
            self.client.pull([t.name for t in self.tensors], out=self._views(self.model.params))
        else:
            self._evaluate(cfg.epochs, test_x, test_y)
        if cfg.out:
            views = self._views(self.model.params)
            meta = {
                "epochs": cfg.epochs,
                "replicas": cfg.n_replicas,
                "optimizer": cfg.optimizer_spec(),
                "heldout_accuracy": self.result.accuracy.get(cfg.epochs),
            }
            self.result.out = str(export.save(cfg.out, self.spec, views, meta))
            log.info("final weights written to %s", self.result.out)
