"""`adamps train --torch PKG.MODULE:FACTORY`: one replica of a user's PyTorch model.

The same process shape as the numpy trainer (trainer/main.py serves its /metrics and /status,
handles signals and prints the summary line): only the replica differs. The rules:

- the factory is called with ``torch.manual_seed(--seed)``; replica 0 checks the model and
  creates the run's tensors from its values (a resumed run keeps the servers' values), trains
  ``--warm-start`` minibatches alone (DistBelief 4.1) and marks the board; the other replicas
  wait for that mark, then pull and join;
- the model (or its adamps.torch.Task: loss, data sets, metric) is checked on one batch before
  any tensor is created (adamps/torch/task.py: a one-line ModelError, exit 2);
- each epoch every replica trains its share of the data servers' epoch, or of the task's own
  train set (``--replica`` of ``--n-replicas``) with ``--workers`` Hogwild threads, pushes what is left and reports the epoch
  done on the board (the controllers' ``/progress``, or a board tensor with ``--ps``); a replica
  restarted after a crash skips the epochs it already reported and redoes the one it was in;
- replica 0 evaluates the held-out split with the servers' values at each of its epoch ends,
  waits at the end until every replica reported the last epoch, evaluates the final weights and
  writes ``--out`` (a state_dict: ``torch.save``; parameters the servers' values, buffers its own).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Any

import torch
from prometheus_client import CollectorRegistry

from adamps.client.rpc import get_json
from adamps.layout import Layout
from adamps.torch import data as tdata
from adamps.torch.optimizer import Connection
from adamps.torch.replica import Replica
from adamps.torch.task import check, dataset_batches, score, test_batches
from trainer.config import TrainConfig
from trainer.downpour import ReplicaResult
from trainer.metrics import TrainerMetrics

log = logging.getLogger("trainer.torch")


class TorchTrainer:
    """The replica object trainer/main.py serves: ``run()``, ``stop()`` and what /status reads."""

    def __init__(self, cfg: TrainConfig, registry: CollectorRegistry) -> None:
        self.cfg = cfg
        self.m = TrainerMetrics(registry)
        self.result = ReplicaResult()
        self.epoch = 0
        self.completed = 0
        self.step = 0
        self.last_staleness = None
        self.pushq: list[Any] = []  # /status's push_queue: pushes are sent by the workers
        self._stopping = threading.Event()
        if "OMP_NUM_THREADS" not in os.environ:
            # parallelism comes from replicas and Hogwild workers: one intra-op thread each,
            # else every replica's kernels fight over the same cores
            torch.set_num_threads(1)
        self.task = tdata.build_task(cfg.torch, cfg.seed)
        self.model = self.task.model
        self.data: Any = None  #: the data servers' client, unless the task brings its data
        if self.task.own_data:  # checked before any connection; else on a data servers' batch
            check(self.task, cfg.torch, cfg.seed, cfg.batch_size)
        else:
            from dataserver.client import DataClient

            self.data = DataClient(cfg.dataservers, cfg.token)
        self.replica: Replica | None = None
        self.train_cpu_s = 0.0
        self.eval_cpu_s = 0.0  #: CPU of replica 0's held-out evaluations inside the training

    def stop(self) -> None:
        self._stopping.set()

    # -- the board -------------------------------------------------------------------------------

    def _board(self) -> Any:
        from trainer.board import ControllerBoard, PsBoard

        cfg = self.cfg
        run = cfg.run or "default"
        if cfg.controllers:
            # Under the run's name (its token reports only there), the torch engine's own keys.
            return ControllerBoard(cfg.controllers, cfg.token, cfg.replica, run, engine="torch")
        from adamps.client import PSClient, StaticRouting

        n_buckets = int(get_json(cfg.ps[0], "/status")["n_buckets"])
        client = PSClient(StaticRouting(cfg.ps, n_buckets), Layout([], n_buckets), cfg.token)
        return PsBoard(client, cfg.replica, cfg.n_replicas, run, engine="torch")

    def _wait(self, what: str, ready: Any) -> None:
        deadline = time.monotonic() + self.cfg.wait_timeout
        while not ready():
            if time.monotonic() > deadline:
                raise TimeoutError(f"gave up waiting for {what}")
            if self._stopping.wait(0.2):
                raise KeyboardInterrupt

    # -- the run ---------------------------------------------------------------------------------

    def _sample(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One minibatch of the data servers' held-out images: what the model is checked on."""
        with self.data.epoch(0, 1, 0, batch_size=self.cfg.batch_size, split="test") as it:
            return next(tdata.dataserver_batches(it))

    def _batches(self, epoch: int) -> Any:
        cfg, task = self.cfg, self.task
        if task.own_data:
            return dataset_batches(
                task.train, cfg.replica, cfg.n_replicas, epoch, cfg.batch_size, cfg.seed
            )
        return tdata.dataserver_batches(
            self.data.epoch(cfg.replica, cfg.n_replicas, epoch, batch_size=cfg.batch_size)
        )

    def _heldout(self) -> Any:
        """Replica 0's held-out set, as a list of batches scored again at each epoch end."""
        if self.task.own_data:
            return list(test_batches(self.task.test))
        return [tdata.heldout(self.data)]

    def run(self) -> ReplicaResult:
        cfg = self.cfg
        if not self.task.own_data:  # before any tensor is created: a one-line ModelError
            check(self.task, cfg.torch, cfg.seed, cfg.batch_size, self._sample())
        board = self._board()
        me = str(board.replica)
        if cfg.replica != 0:
            log.info("waiting for replica 0 (tensors created, warm start done)")
            self._wait("replica 0's warm start", board.warm_done)
        lr = cfg.server_lr
        conn = Connection(
            self.model, controllers=cfg.controllers, ps=cfg.ps, run=cfg.run or None,
            token=cfg.token, lr=lr, optimizer=cfg.optimizer, adagrad_initial=cfg.adagrad_initial,
            optimizer_args=cfg.optimizer_params, create=cfg.replica == 0, http_only=cfg.http_only,
        )  # fmt: skip
        compress: Any = False
        if cfg.compress:
            compress = {"fraction": cfg.compress_fraction, "taus": cfg.compress_tau,
                        "coding": cfg.compress_coding}  # fmt: skip
        rep = self.replica = Replica(
            self.model, self.task.loss_fn, lr=lr, local_lr=cfg.local_lr,
            n_push=cfg.n_push, n_fetch=cfg.n_fetch, workers=cfg.workers, compress=compress,
            connection=conn, asynchronous=True,
        )  # fmt: skip
        test = self._heldout() if cfg.replica == 0 else None
        warm = {"marked": cfg.replica != 0 or board.warm_done()}
        lock = threading.Lock()

        window: list[tuple[float, int]] = []  #: (time, images so far) of recent minibatches

        failovers = rep.conn.remote.client.failovers
        seen = {"failovers": 0}

        def on_batch(n: int, loss: float) -> None:
            with lock:
                if failovers.count > seen["failovers"]:  # each one is logged by the client
                    self.m.failovers.inc(failovers.count - seen["failovers"])
                    seen["failovers"] = failovers.count
                self.step += 1
                self.result.images += n
                self.m.images.inc(n)
                self.m.loss.set(loss)
                now = time.monotonic()
                window.append((now, self.result.images))
                while len(window) > 2 and now - window[0][0] > 5.0:
                    window.pop(0)
                if len(window) > 1 and now > window[0][0]:
                    self.m.rate.set((window[-1][1] - window[0][1]) / (now - window[0][0]))
                if not warm["marked"] and self.step >= cfg.warm_start:
                    warm["marked"] = True
                    board.mark_warm()
                    log.info("warm start done (%d minibatches): the other replicas join", self.step)
            if self._stopping.is_set():
                raise KeyboardInterrupt

        t0, cpu0 = time.perf_counter(), time.process_time()
        try:
            for epoch in range(1, cfg.epochs + 1):
                if board.finished().get(me, 0) >= epoch:
                    log.info("epoch %d already reported done by this replica: skipped", epoch)
                    continue
                self.epoch = epoch
                self.m.epoch.set(epoch)
                res = rep.fit_epoch(self._batches(epoch), on_batch)
                board.report(epoch, 1.0, True)
                self.completed = epoch
                done = board.finished()
                if len(done) >= cfg.n_replicas:  # every replica's last epoch, for the views
                    self.m.completed.set(min(done.values()))
                log.info("epoch %d: %d minibatches, loss %.4f, %.1f s", epoch, res.steps,
                         res.loss, res.seconds)  # fmt: skip
                if test is not None:
                    self._evaluate(epoch, test, res)
            if not warm["marked"]:
                board.mark_warm()
            self.result.seconds = time.perf_counter() - t0
            #: CPU of this process (every thread) while training: startup, the held-out
            #: evaluations and the final wait excluded
            self.train_cpu_s = time.process_time() - cpu0 - self.eval_cpu_s
            if cfg.replica == 0 and test is not None:
                self._finish(board, test)
        finally:
            rep.close()
            c = rep.counts
            self.result.bytes_pushed, self.result.pushes = c.bytes_pushed, c.pushes
            # one line benchmarks/torch_replica.py reads: what the nn.Linear weights cost
            log.info("torch pushes %s", json.dumps({
                "images": self.result.images, "train_cpu_s": round(self.train_cpu_s, 3),
                "pushes": c.pushes, "fetches": c.fetches,
                "bytes_pushed": c.bytes_pushed, "linear_bytes": c.fc_bytes,
                "linear_dense_bytes": c.fc_dense_bytes, "forms": c.forms,
                "failovers": failovers.count,
            }))  # fmt: skip
        return self.result

    def _evaluate(self, epoch: int, test: Any, res: Any) -> float:
        """Held-out accuracy (the task's metric) with the servers' values (pulled into the
        model)."""
        assert self.replica is not None
        c0 = time.process_time()
        self.replica.conn.remote.pull()
        acc = score(self.model, test, self.task.metric_fn)
        self.eval_cpu_s += time.process_time() - c0
        self.result.accuracy[epoch] = acc
        self.m.accuracy.set(acc)
        log.info("epoch %d: held-out accuracy %.4f (server weights)", epoch, acc)
        if self.cfg.history:
            rec = {
                "time": time.time(), "epoch": epoch, "loss": round(res.loss, 6), "accuracy": acc,
                "images_per_s": round(res.examples / max(res.seconds, 1e-9), 1),
                "replicas": self.cfg.n_replicas,
            }  # fmt: skip
            with open(self.cfg.history, "a") as fh:
                fh.write(json.dumps(rec) + "\n")
        return acc

    def _finish(self, board: Any, test: Any) -> None:
        """Replica 0: every replica's last epoch in, then the final weights evaluated and saved."""
        cfg = self.cfg

        def all_done() -> bool:
            done = board.finished()
            return len(done) >= cfg.n_replicas and min(done.values()) >= cfg.epochs

        self._wait(f"every replica to finish epoch {cfg.epochs}", all_done)
        self.m.completed.set(cfg.epochs)
        assert self.replica is not None
        self.replica.conn.remote.pull()
        acc = score(self.model, test, self.task.metric_fn)
        self.result.accuracy[cfg.epochs] = acc
        self.m.accuracy.set(acc)
        log.info("all replicas done: held-out accuracy %.4f (final server weights)", acc)
        if cfg.out:
            torch.save(self.replica.state_dict(), cfg.out)
            self.result.out = cfg.out
            log.info("final state_dict written to %s", cfg.out)


def make_torch_replica(cfg: TrainConfig, registry: CollectorRegistry) -> TorchTrainer:
    return TorchTrainer(cfg, registry)
