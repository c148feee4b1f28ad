"""The coordinator's work: L-BFGS through vector operations on the servers, and the portions of
each evaluation handed to trainers (DistBelief 4.2, figure 2 right).

Threads: the optimizer runs in its own thread (``run``), blocking in ``evaluate`` until the
trainers have pushed every portion; the HTTP handlers (service.py) call ``work`` and ``config``
from the event loop. Both meet under ``self.cond``.

Durable state: one JSON record on the servers (record.py), written after every evaluation and
iteration and when an evaluation starts. Restarted with the same run name, the coordinator
replays the current iteration (lbfgs.py explains why that is exact); an evaluation already
started is not zeroed again and its portions keep their ids, so the servers drop every gradient
they already hold (a portion's push is one (client, seq) pair: ``sb.<run>.<k>.<j>.<grad>.<pid>``,
1; the vector is in it so that an evaluation zeroed into another vector, as after the L2 term
moved to ``graw``, never has its portions taken for those of a previous one).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge

from adamps.client import ControllerRouting, PSClient
from adamps.client.rpc import RpcError
from adamps.layout import Layout, TensorSpec
from adamps.metered import MeteredClient
from coordinator.config import CoordinatorConfig
from coordinator.heldout import HeldoutMeter
from coordinator.lbfgs import Lbfgs, LbfgsConfig, LbfgsState, Regularized
from coordinator.portions import Schedule, portion_bounds
from coordinator.psvectors import PsVectors
from coordinator.record import ServerRecord
from trainer.model import Model, resolve_spec

log = logging.getLogger("coordinator")

#: seconds a trainer is told to wait when there is no portion for it
WAIT = 0.05


class CoordinatorMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.iteration = Gauge(
            "adamps_coordinator_iteration", "L-BFGS iteration", registry=registry
        )
        self.loss = Gauge(
            "adamps_coordinator_loss", "f(x_k) of the current iterate", registry=registry
        )
        self.evaluations = Counter(
            "adamps_coordinator_evaluations", "objective evaluations (batches) completed",
            registry=registry,
        )  # fmt: skip
        self.portions = Counter(
            "adamps_coordinator_portions",
            "portion events: assigned, done, duplicate, backup, reassigned",
            ["event"],
            registry=registry,
        )
        self.ps_bytes = Counter(
            "adamps_coordinator_ps_bytes", "bytes to and from the parameter servers",
            ["direction"], registry=registry,
        )  # fmt: skip
        self.trainers = Gauge(
            "adamps_coordinator_trainers", "trainers heard from within trainer_timeout",
            registry=registry,
        )  # fmt: skip


class _Evaluated:
    """The engine's vectors, evaluated by its trainers: a complete VectorOps."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine.vectors, name)

    def evaluate(self, grad: str, key: tuple[int, int]) -> float:
        return self.engine.evaluate(grad, key)


class Engine:
    """One Sandblaster run. ``record``, ``schedule`` and ``eval`` are guarded by ``cond``."""

    def __init__(self, cfg: CoordinatorConfig, registry: CollectorRegistry) -> None:
        self.cfg = cfg
        self.m = CoordinatorMetrics(registry)
        self.spec = resolve_spec(cfg.model)
        self.model = Model(self.spec, _layout_only=True)
        #: the run's parameter tensors on the servers: the model's names behind a prefix, so
        #: that a Sandblaster run shares servers with Downpour runs of the same model
        self.prefix = f"sb.{cfg.run}."
        self.tensors = [TensorSpec(self.prefix + n, s) for n, s in self.model.tensors()]
        from dataserver.sources import load_source

        source = load_source(cfg.source, holdout=0.2, seed=0)
        self.n_examples = len(source.train_y)
        layout = Layout(self.tensors, cfg.n_buckets, cfg.max_shard_elems)
        self.client = MeteredClient(
            ControllerRouting(cfg.controllers), layout, cfg.token, retry_for=120.0
        )
        #: held-out accuracy of each iterate (its own client: its vectors stay out of the
        #: optimizer's layout and byte counts)
        self.heldout: HeldoutMeter | None = None
        if cfg.heldout or cfg.history:
            meter_client = PSClient(
                ControllerRouting(cfg.controllers), layout, cfg.token, retry_for=120.0
            )
            self.heldout = HeldoutMeter(
                self.spec, source, meter_client, self.tensors, self.prefix, cfg.history
            )
        # A fresh client id per process: a restarted coordinator's writes are new operations
        # (the iteration replays from its start), never mistaken for the dead one's.
        self.vectors = PsVectors(
            self.client, self.tensors, f"coord.{cfg.run}.{uuid.uuid4().hex[:8]}"
        )
        self.loss_spec = TensorSpec(f"sandblaster.{cfg.run}.loss", (1,))
        self.cond = threading.Condition()
        self.record: dict[str, Any] = {}
        self.schedule: Schedule | None = None
        #: the evaluation in progress: (k, j, grad vector)
        self.eval: tuple[int, int, str] | None = None
        self.state: LbfgsState | None = None
        self.stopped = threading.Event()
        self.error: str | None = None
        #: (iteration, coordinator<->servers bytes, trainer-API bytes) at each iteration's end
        self.per_iteration: list[dict[str, Any]] = []
        self.api_bytes = 0
        self._mark = self._mark_iter = (0, 0)
        self._api_mark = 0
        self.resumed = False
        #: the last evaluations (batches): duration, images, backups, portions per trainer
        self.evals: list[dict[str, Any]] = []
        #: portion events over this process's evaluations
        self.totals = {"portions": 0, "backups": 0, "duplicates": 0, "reassigned": 0}

    # -- setup ------------------------------------------------------------------------------

    def setup(self) -> None:
        """Creates the parameters (same seed, same values: idempotent), the loss and the
        record tensors; loads the record a previous coordinator of this run left."""
        params = Model(self.spec)
        params.init_params(self.cfg.seed)
        for t in self.tensors:
            self.client.create(
                t,
                init={
                    "kind": "values",
                    "values": np.ascontiguousarray(params.param(t.name[len(self.prefix) :])),
                },
                optimizer={"kind": "sgd", "lr": -1.0},
            )
        self.client.create(
            self.loss_spec, init={"kind": "zeros"}, optimizer={"kind": "sgd", "lr": -1.0}
        )
        self.store = ServerRecord(self.vectors, self.cfg.run)
        self.record = self.store.load() or {}
        self.resumed = bool(self.record)
        if self.resumed:
            lb = self.record.get("lbfgs") or {}
            log.info("resuming run %s at iteration %s", self.cfg.run, lb.get("k", 0))
        self._mark = self._mark_iter = (self.client.meter.sent, self.client.meter.received)

    def _save(self) -> None:
        self.store.save(self.record)

    # -- the optimizer thread ---------------------------------------------------------------

    def run(self) -> None:
        try:
            lcfg = LbfgsConfig(
                m=self.cfg.m, max_iter=self.cfg.max_iter, max_evals=self.cfg.max_evals,
                gtol=self.cfg.gtol,
            )  # fmt: skip
            saved = self.record.get("lbfgs")
            state = LbfgsState.from_dict(saved) if saved else None
            opt = Lbfgs(Regularized(_Evaluated(self), self.cfg.l2), lcfg, state, self._on_state)
            self.state = opt.state
            opt.run()
            log.info("run %s stopped: %s after %d iterations, f=%.6g",
                     self.cfg.run, opt.state.stopped, opt.state.k, opt.state.f)  # fmt: skip
        except Exception as exc:
            log.exception("the optimizer failed")
            self.error = repr(exc)
        finally:
            self.stopped.set()
            with self.cond:
                self.cond.notify_all()

    def _on_state(self, st: LbfgsState) -> None:
        prev_k = (self.record.get("lbfgs") or {}).get("k", st.k)
        self.state = st
        self.record["lbfgs"] = st.to_dict()
        self._save()
        self.m.iteration.set(st.k)
        if st.f is not None:
            self.m.loss.set(st.f)
        sent, received = self.client.meter.sent, self.client.meter.received
        self.m.ps_bytes.labels("sent").inc(sent - self._mark[0])
        self.m.ps_bytes.labels("received").inc(received - self._mark[1])
        if st.k != prev_k:  # an iteration ended (the first one includes x_0's evaluation)
            measured = {}
            if self.heldout is not None:
                try:
                    rec = self.heldout.record(st.k, st.f)
                    measured = {"heldout_accuracy": rec["heldout_accuracy"]}
                except (ConnectionError, TimeoutError, RpcError) as exc:  # a figure, not a step
                    log.warning("held-out accuracy of iterate %d not measured: %s", st.k, exc)
            self.per_iteration.append({
                "iteration": st.k, "f": st.f, **measured,
                "ps_bytes_sent": sent - self._mark_iter[0],
                "ps_bytes_received": received - self._mark_iter[1],
                "api_bytes": self.api_bytes - self._api_mark,
            })  # fmt: skip
            self._mark_iter = (sent, received)
            self._api_mark = self.api_bytes
            del self.per_iteration[:-1000]
        self._mark = (sent, received)

    def evaluate(self, grad: str, key: tuple[int, int]) -> float:
        """f at ``param``, its gradient into ``grad``: the trainers compute the portions."""
        k, j = key
        marker = [k, j, grad]
        if self.record.get("eval") != marker:
            self.vectors.scale(grad, 0.0)
            self.vectors.write(
                self.client.layout.shards_of[self.loss_spec.name],
                {"kind": "scale", "y": "", "alpha": 0.0},
            )
            self.record["eval"] = marker
            self._save()
        t0 = time.monotonic()
        with self.cond:
            self.schedule = Schedule(self.cfg.portions, self.cfg.backup)
            self.eval = (k, j, grad)
            self.cond.notify_all()
            while not self.schedule.complete:
                self.cond.wait(0.5)
                self._expire()
            s = self.schedule
            for key, n in (
                ("duplicates", s.duplicates),
                ("backups", s.backups),
                ("reassigned", s.reassigned),
                ("portions", len(s.portions)),
            ):
                self.totals[key] += n  # fmt: skip
            self.m.portions.labels("duplicate").inc(s.duplicates)
            self.m.portions.labels("backup").inc(s.backups)
            self.m.portions.labels("reassigned").inc(s.reassigned)
            self.eval = None
            self.evals.append({
                "iteration": k, "trial": j, "seconds": round(time.monotonic() - t0, 4),
                "images": self.n_examples, "backups": s.backups, "duplicates": s.duplicates,
                "by_trainer": {t: sum(1 for p in s.portions if p.done_by == t)
                               for t in {p.done_by for p in s.portions}},
            })  # fmt: skip
            del self.evals[:-1000]
        self.m.evaluations.inc()
        values, _ = self.client.pull([self.loss_spec.name])
        return float(values[self.loss_spec.name][0])

    def _expire(self) -> None:
        if self.schedule is not None:
            lost = self.schedule.expire(time.monotonic(), self.cfg.trainer_timeout)
            for t in lost:
                log.warning("trainer %s silent for %.1f s: its portions go to others",
                            t, self.cfg.trainer_timeout)  # fmt: skip
            self.m.trainers.set(len(self.schedule.seen))

    # -- the trainers' API (event loop) -----------------------------------------------------

    def config(self) -> dict[str, Any]:
        return {
            "run": self.cfg.run,
            "model": self.spec,
            "source": self.cfg.source,
            "tensors": [[t.name, list(t.shape)] for t in self.tensors],
            "prefix": self.prefix,
            "n_buckets": self.cfg.n_buckets,
            "max_shard_elems": self.cfg.max_shard_elems,
            "loss_tensor": self.loss_spec.name,
            "n_examples": self.n_examples,
            "push_every": self.cfg.push_every,
        }

    def work(self, trainer: str, done: list[Any]) -> dict[str, Any]:
        """Records `trainer`'s pushed portions and gives it its next one (or a wait/stop)."""
        now = time.monotonic()
        with self.cond:
            s, ev = self.schedule, self.eval
            if s is not None and ev is not None:
                for item in done:
                    if list(item[:2]) == [ev[0], ev[1]]:
                        first = s.report(trainer, int(item[2]), now)
                        if first:
                            self.m.portions.labels("done").inc()
                if s.complete:
                    self.cond.notify_all()
            if self.stopped.is_set():
                return {"stop": True}
            if s is None or ev is None or s.complete:
                return {"wait": WAIT}
            pid = s.request(trainer, now)
            if pid is None:
                return {"wait": WAIT}
            self.m.portions.labels("assigned").inc()
            k, j, grad = ev
            start, stop = portion_bounds(self.n_examples, self.cfg.portions, pid)
            return {
                "portion": {
                    "eval": [k, j],
                    "grad": grad,
                    "pid": pid,
                    "start": start,
                    "stop": stop,
                    "n": self.n_examples,
                    "client": f"sb.{self.cfg.run}.{k}.{j}.{grad}.{pid}",
                }
            }

    def status(self) -> dict[str, Any]:
        st = self.state
        with self.cond:
            s = self.schedule
            sched = None if s is None else {
                "eval": self.eval, "done": s.n_done, "portions": len(s.portions),
                "outstanding": s.outstanding(), "backups": s.backups,
                "duplicates": s.duplicates, "reassigned": s.reassigned,
                "trainers": sorted(s.seen),
            }  # fmt: skip
        return {
            "run": self.cfg.run,
            "resumed": self.resumed,
            "iteration": None if st is None else st.k,
            "f": None if st is None else st.f,
            "gnorm": None if st is None else st.gnorm,
            "losses": [] if st is None else st.losses,
            "stopped": None if st is None else st.stopped,
            "error": self.error,
            "schedule": sched,
            "totals": dict(self.totals),
            "ps_bytes": {"sent": self.client.meter.sent, "received": self.client.meter.received},
            "api_bytes": self.api_bytes,
            "per_iteration": self.per_iteration,
            "evals": self.evals,
            "params": sum(t.size for t in self.tensors),
            "shards": len(self.vectors.shards),
        }
