"""A follower partition (k > 0) of a partitioned replica (trainer/partitioned.py;
what it shares with the leader: trainer/partition_member.py).

It connects to the leader's control link, creates its own tensors (replica 0) when the leader
says start, pulls them, then runs the rounds the leader sends with its own Hogwild pool: its
workers exchange the boundary activations and errors with the other partitions' workers, its
push thread pushes its own slices' updates, its fetch thread pulls its own slices every
``n_fetch`` minibatches per worker (Downpour, as in an unpartitioned replica). On "end" it
waits until its pushes are acknowledged. When the leader's link closes without an "end" (the
leader or another partition died), it stops with an error.
"""

from __future__ import annotations

import logging
import socket
import time

from prometheus_client import CollectorRegistry

from trainer.config import TrainConfig
from trainer.downpour import Replica, ReplicaResult
from trainer.exchange import parse_addr, token_digest
from trainer.fetcher import Fetcher
from trainer.loop import Loop
from trainer.packing import PackPlan, collect_round
from trainer.partition_member import Control, PartitionMember

log = logging.getLogger(__name__)


class PartitionFollower(PartitionMember, Replica):
    def __init__(self, cfg: TrainConfig, registry: CollectorRegistry | None = None) -> None:
        super().__init__(cfg, registry)
        self._partition_init()
        self.ctl: Control | None = None
        self.metrics_port: int | None = None  #: set by trainer/main.py once it serves

    def _connect(self) -> Control:
        cfg = self.cfg
        host, port = parse_addr(cfg.partition_addrs[0])
        deadline = time.monotonic() + cfg.wait_timeout
        while True:
            try:
                sock = socket.create_connection((host, port), timeout=5)
                break
            except OSError:
                if time.monotonic() > deadline or self._stopping.is_set():
                    raise TimeoutError(f"partition 0 ({host}:{port}) did not answer") from None
                time.sleep(0.2)
        sock.settimeout(None)
        ctl = Control(sock)
        ctl.send(
            {
                "op": "hello",
                "partition": cfg.partition,
                "replica": cfg.replica,
                "model": self.spec,
                "digest": token_digest(cfg.token),
                "metrics": f"{cfg.host}:{self.metrics_port}" if self.metrics_port else None,
            }
        )
        return ctl

    def run(self) -> ReplicaResult:
        cfg = self.cfg
        self._setup_cluster()
        assert self.client is not None
        self.ctl = ctl = self._connect()
        try:
            msg = ctl.recv()
            if msg.get("op") != "start":
                raise RuntimeError(f"control link: expected 'start', got {msg.get('op')!r}")
            if cfg.replica == 0:
                self._create_tensors()
            self.client.pull([t.name for t in self.tensors], out=self._views(self.model.params))
            ctl.send({"op": "ready"})
            self._follow(ctl)
        finally:
            ctl.close()
            self.client.close()
        return self.result

    def _follow(self, ctl: Control) -> None:
        cfg = self.cfg
        plan = PackPlan.of(self.model, cfg.n_push * cfg.batch_size)
        factory = self._worker_factory(plan)
        assert self.pusher is not None
        pusher = Loop("push", self.pusher.loop)
        fetcher = Fetcher(self.client, self.model)
        sched = self.schedule
        sched.mark_warm()  # the leader says when to fetch: each round carries its warm mark
        t_start = time.perf_counter()
        with self._pool(factory, plan) as pool:
            pusher.start()
            fetcher.thread.start()
            try:
                while True:
                    if self._stopping.is_set():
                        raise KeyboardInterrupt
                    msg = ctl.recv()
                    op = msg.get("op")
                    if op == "end":
                        if not self.pushq.join(cfg.wait_timeout, pusher.is_alive):
                            self._check_threads(pusher)
                            raise TimeoutError("pushes not acknowledged in time")
                        ctl.send({"op": "ended"})
                        break
                    if op != "round":
                        raise RuntimeError(f"control link: unexpected {op!r}")
                    self._check_threads(pusher, fetcher.thread)
                    tasks = [[(b["x"], b["y"]) for b in t] for t in msg["tasks"]]
                    outs = pool.run(tasks)
                    self.pushq.put(collect_round(pool.buffers, plan, outs))
                    sched.after_round(sum(len(t) for t in tasks))
                    images = sum(len(b[1]) for t in tasks for b in t)
                    self.result.images += images
                    self.m.images.inc(images)
                    ctl.send({"op": "done"})
                    if fetcher.ready():
                        self._install(pool.params, fetcher.take())
                        self.last_staleness = sched.staleness(fetcher.requested_at)
                        self.fetches += 1
                        self.m.fetches.inc()
                    if msg.get("warm") and sched.want_fetch(fetcher.pending):
                        fetcher.request(sched.step)
            finally:
                self.result.seconds = time.perf_counter() - t_start
                self._stopping.set()
                fetcher.stop()
                self.pushq.put(None)
                for t in (pusher, fetcher.thread):
                    t.join(5)
                self.result.bytes_pushed = self.pusher.bytes_pushed
                self.result.pushes = self.pusher.pushes
                self.result.sent_fraction = self.pusher.sent_fraction

    def stop(self) -> None:
        super().stop()
        if self.ctl is not None:
            self.ctl.close()  # unblocks the wait for the next round
