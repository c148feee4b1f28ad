"""A Sandblaster trainer (DistBelief 4.2): asks the coordinator for portions of a batch, computes
their gradients with the same model engine as Downpour (trainer/model.py), and pushes them to
the vectors on the parameter servers.

- Parameters are fetched once per batch (an evaluation of the coordinator's line search), when
  the first portion of a new evaluation arrives.
- A portion's push is its own exactly-once pair (the coordinator's portion id, seq 1): the
  gradient into ``<tensor>@<grad>`` and the loss into the run's loss tensor, each already
  divided by the batch size, so the servers' sum is the batch's mean. A copy of the same portion
  from a backup task, or pushed again by a restarted trainer, is dropped by the servers.
- Results are sent every ``push_every`` portions (and whenever there is no new portion), then
  reported to the coordinator; a trainer that dies loses at most that many portions, which
  the coordinator gives to others.
- ``slowdown`` (a test flag) makes this trainer that many times slower: the straggler of the
  backup-task benchmark.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from adamps.client import ControllerRouting, push_checks
from adamps.client.rpc import RpcError, SyncRpc
from adamps.layout import VECTOR_SEP, Layout, TensorSpec
from adamps.metered import MeteredClient
from trainer.model import Model

log = logging.getLogger("trainer.sandblaster")


@dataclass
class SandblasterResult:
    portions: int = 0
    images: int = 0
    seconds: float = 0.0
    fetches: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    compute_seconds: float = 0.0
    evals: list[Any] = field(default_factory=list)


class SandblasterTrainer:
    """One trainer; ``run()`` until the coordinator says stop (or ``stop()``)."""

    def __init__(
        self,
        coordinator: str,
        controllers: list[str],
        token: str,
        name: str | None = None,
        slowdown: float = 1.0,
    ) -> None:
        self.name = name or f"t-{uuid.uuid4().hex[:8]}"
        self.slowdown = slowdown
        self.coord = SyncRpc(coordinator, token, timeout=30.0)
        cfg = self._retry(lambda: self.coord.get_json("/sandblaster/config"))
        self.cfg = cfg
        from dataserver.sources import load_source

        data = load_source(cfg["source"], holdout=0.2, seed=0)
        self.data = data
        self.model = Model(cfg["model"])
        self.x = self.model.prepare(data.train_x)
        self.y = np.asarray(data.train_y)
        if len(self.y) != cfg["n_examples"]:
            raise ValueError(
                f"the coordinator counts {cfg['n_examples']} examples in {cfg['source']!r}, "
                f"this trainer loaded {len(self.y)}"
            )
        self.tensors = [TensorSpec(n, tuple(s)) for n, s in cfg["tensors"]]
        #: server tensor name -> the model's name (the run's prefix removed)
        self.model_name = {t.name: t.name[len(cfg.get("prefix", "")) :] for t in self.tensors}
        specs = [*self.tensors, TensorSpec(cfg["loss_tensor"], (1,))]
        layout = Layout(specs, cfg["n_buckets"], cfg["max_shard_elems"])
        self.client = MeteredClient(ControllerRouting(controllers), layout, token, retry_for=60.0)
        self._stop = threading.Event()
        self.result = SandblasterResult()
        self._params_of: tuple[int, int] | None = None
        self._vector_specs: dict[str, None] = {}

    def _retry(self, fn: Any, seconds: float = 60.0) -> Any:
        deadline = time.monotonic() + seconds
        while True:
            try:
                return fn()
            except (ConnectionError, TimeoutError, RpcError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def stop(self) -> None:
        self._stop.set()

    def _fetch(self, ev: tuple[int, int]) -> None:
        values, _ = self.client.pull([t.name for t in self.tensors])
        for t in self.tensors:
            self.model.param(self.model_name[t.name])[...] = values[t.name]
        self._params_of = ev
        self.result.fetches += 1

    def _compute(self, p: dict[str, Any]) -> dict[str, np.ndarray]:
        """The portion's gradient and loss, divided by the batch size: shard id -> delta."""
        t0 = time.perf_counter()
        a, b, n = p["start"], p["stop"], p["n"]
        loss = self.model.loss_and_grad(self.x[a:b], self.y[a:b], scale=(b - a) / n)
        grad = p["grad"]
        layout = self.client.layout
        deltas: dict[str, np.ndarray] = {}
        for t in self.tensors:
            vname = f"{t.name}{VECTOR_SEP}{grad}"
            if vname not in layout.tensors:
                layout = self.client.layout = layout.with_tensor(TensorSpec(vname, t.shape))
            g = np.ascontiguousarray(self.model.grad(self.model_name[t.name]), dtype=np.float32)
            for s, part in zip(layout.shards_of[vname], layout.split(vname, g), strict=True):
                deltas[s.id] = part
        loss_shard = layout.shards_of[self.cfg["loss_tensor"]][0].id
        deltas[loss_shard] = np.array([loss * (b - a) / n], np.float32)
        spent = time.perf_counter() - t0
        if self.slowdown > 1:
            time.sleep(spent * (self.slowdown - 1))
        self.result.compute_seconds += spent
        self.result.images += b - a
        return deltas

    def _push(self, p: dict[str, Any], deltas: dict[str, np.ndarray]) -> None:
        """One exactly-once push per portion: (the portion's client id, seq 1), checked whole
        before any server is sent its part (issue 39: a NaN must not leave it applied in part)."""
        client = self.client
        deltas = push_checks.shards(client.layout, deltas)
        done: set[str] = set()

        def go(routing: Any) -> None:
            todo = [client.layout.shards[sid] for sid in deltas if sid not in done]
            for url, group in client._by_server(todo, routing).items():
                client._rpc(url).call(
                    "push_dense",
                    shards={s.id: deltas[s.id] for s in group},
                    client=p["client"],
                    seq=1,
                )
                done.update(s.id for s in group)

        client._with_retry(go)

    def run(self) -> SandblasterResult:
        t0 = time.monotonic()
        buffered: list[tuple[dict[str, Any], dict[str, np.ndarray]]] = []
        report: list[list[int]] = []
        push_every = int(self.cfg.get("push_every", 1))
        while not self._stop.is_set():
            reply = self._retry(
                lambda done=report: self.coord.post_json(
                    "/sandblaster/work", {"trainer": self.name, "done": done}
                )
            )
            report = []
            portion = reply.get("portion")
            if portion is None or (
                buffered and tuple(portion["eval"]) != tuple(buffered[0][0]["eval"])
            ):
                for p, deltas in buffered:  # nothing new, or a new batch: send what we hold
                    self._push(p, deltas)
                    report.append([*p["eval"], p["pid"]])
                buffered = []
            if reply.get("stop"):
                break
            if portion is None:
                if not report:
                    time.sleep(float(reply.get("wait", 0.05)))
                continue
            ev = (portion["eval"][0], portion["eval"][1])
            if self._params_of != ev:
                self._fetch(ev)
            buffered.append((portion, self._compute(portion)))
            self.result.portions += 1
            if len(buffered) >= push_every:
                for p, deltas in buffered:
                    self._push(p, deltas)
                    report.append([*p["eval"], p["pid"]])
                buffered = []
        self.result.seconds = time.monotonic() - t0
        self.result.bytes_sent = self.client.meter.sent
        self.result.bytes_received = self.client.meter.received
        return self.result

    def heldout_accuracy(self) -> float:
        """Accuracy on the held-out images with the servers' current parameters."""
        self._fetch((-1, -1))
        return self.model.accuracy(self.model.prepare(self.data.test_x), self.data.test_y)

    def close(self) -> None:
        self.client.close()
        self.coord.close()


def serve_sandblaster(cfg: Any) -> int:
    """`adamps train --coordinator URL`: one Sandblaster trainer until the coordinator stops.
    Replica 0 then measures the held-out accuracy of the servers' parameters."""
    import json
    import signal

    from adamps import config as aconfig
    from adamps import metrics as am
    from trainer.metrics_server import MetricsServer

    trainer = SandblasterTrainer(
        cfg.coordinator, cfg.controllers, cfg.token, name=f"train-{cfg.replica}-{uuid.uuid4().hex[:6]}",
        slowdown=cfg.slowdown,
    )  # fmt: skip
    started = time.time()

    def status() -> dict[str, Any]:
        r = trainer.result
        return {
            "role": "trainer", "algorithm": "sandblaster", "config": aconfig.to_dict(cfg),
            "uptime_seconds": time.time() - started, "replica": cfg.replica, "name": trainer.name,
            "portions": r.portions, "images": r.images, "fetches": r.fetches,
        }  # fmt: skip

    server = None
    if cfg.metrics_port >= 0:
        server = MetricsServer(am.new_registry(), cfg.token, status, cfg.host, cfg.metrics_port)
    signal.signal(signal.SIGTERM, lambda *_: trainer.stop())
    try:
        r = trainer.run()
        acc = {str(cfg.epochs): trainer.heldout_accuracy()} if cfg.replica == 0 else {}
    finally:
        trainer.close()
        if server is not None:
            server.close()
    print(json.dumps({
        "replica": cfg.replica, "algorithm": "sandblaster", "portions": r.portions,
        "images": r.images, "seconds": round(r.seconds, 2), "fetches": r.fetches,
        "bytes_sent": r.bytes_sent, "bytes_received": r.bytes_received,
        "compute_seconds": round(r.compute_seconds, 2), "heldout_accuracy": acc,
    }), flush=True)  # fmt: skip
    return 0
