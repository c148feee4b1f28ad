"""One Downpour replica as K partition processes (issue 15; Adam 3.2 and 4.4.2, DistBelief 3).

Each partition process holds a vertical slice of the model (trainer/partition.py) and is,
towards the parameter servers, a replica of its own slice: it pulls and pushes only its own
tensors (``conv1-p0of2.w`` ...), with the act/err pushes of its fully connected slices, through
the same push and fetch threads as an unpartitioned replica (trainer/downpour.py). Towards the
data servers and the epoch board, the K partitions are one replica:

- **partition 0, the leader,** is a ``Replica``: it reads the minibatches, keeps the epochs, the
  warm start, the 75% rule and the board, evaluates and exports (assembling every partition's
  tensors). Its Hogwild pool is wrapped: each round's minibatches go first to the followers
  over the control link, and the round ends when every follower has run it;
- **a follower** (partition k > 0) runs the rounds it is sent with its own Hogwild pool.

Worker w of every partition trains the same minibatches: the workers exchange the boundary
activations and errors (trainer/exchange.py) directly, worker w with worker w, so Hogwild
runs within each partition. A partition that dies closes its links: its peers' exchanges and
the leader's control link fail at once, every partition of the replica exits non-zero, and the
launcher (trainer/partition_launch.py) restarts the replica from the servers' parameters.
"""

from __future__ import annotations

import hmac
import logging
import socket
import time
from collections.abc import Collection
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry

from adamps.wire import protocol
from trainer.config import TrainConfig
from trainer.downpour import Replica
from trainer.exchange import PeerLost, parse_addr, token_digest
from trainer.model import Model
from trainer.partition import assemble
from trainer.partition_follower import PartitionFollower
from trainer.partition_member import Control, PartitionMember, bind_host, expect_op

log = logging.getLogger(__name__)


def hello_partition(hello: Any, digest: bytes, partitions: int, taken: Collection[int]) -> int:
    """The partition a follower's hello names, once its token digest is right; ValueError for
    anything else. Every field is type-checked before use: a digest of 2^40 passed to bytes()
    allocated a terabyte, a list as partition raised TypeError, and either stopped the leader's
    accept loop (issue 28)."""
    if not isinstance(hello, dict):
        raise ValueError("a hello must be a map")
    got = hello.get("digest")
    if not isinstance(got, bytes) or not hmac.compare_digest(got, digest):
        raise ValueError("hello without the cluster token's digest")
    k = hello.get("partition")
    if isinstance(k, bool) or not isinstance(k, int) or not 0 < k < partitions:
        raise ValueError(f"hello names partition {k!r}, not one of 1..{partitions - 1}")
    if k in taken:
        raise ValueError(f"partition {k} is connected already")
    return k


class PartitionLeader(PartitionMember, Replica):
    """Partition 0: the replica as the data servers and the board see it."""

    def __init__(self, cfg: TrainConfig, registry: CollectorRegistry | None = None) -> None:
        super().__init__(cfg, registry)
        self._partition_init()
        self.full = Model(self.spec)  # evaluation: every partition's tensors assembled
        self.followers: dict[int, Control] = {}
        #: partition -> host:port of its /metrics and /status (as it told us)
        self.follower_metrics: dict[str, str | None] = {}
        self._ended = False

    # -- the followers -----------------------------------------------------------------------

    def partition_status(self) -> dict[str, Any]:
        return {**super().partition_status(), "followers": dict(self.follower_metrics)}

    def _accept_followers(self) -> None:
        cfg = self.cfg
        _host, port = parse_addr(cfg.partition_addrs[0])
        digest = token_digest(cfg.token)
        deadline = time.monotonic() + cfg.wait_timeout
        with socket.create_server((bind_host(cfg), port)) as srv:
            while len(self.followers) < cfg.partitions - 1:
                srv.settimeout(max(0.1, deadline - time.monotonic()))
                try:
                    sock, _ = srv.accept()
                except TimeoutError:
                    raise TimeoutError("the other partitions did not connect in time") from None
                ctl = Control(sock)
                try:
                    sock.settimeout(10)
                    hello = ctl.recv(limit=1 << 16)  # before the token is checked: small
                    k = hello_partition(hello, digest, cfg.partitions, self.followers)
                    if hello.get("replica") != cfg.replica or hello.get("model") != self.spec:
                        raise ValueError(f"partition {k} trains another replica or model")
                except (OSError, ValueError, PeerLost, protocol.ProtocolError) as exc:
                    log.warning("refused a partition's connection: %s", exc)
                    ctl.close()
                    continue
                sock.settimeout(None)
                self.followers[k] = ctl
                self.follower_metrics[str(k)] = hello.get("metrics")
                log.info("partition %d connected", k)

    def _start_followers(self) -> None:
        for ctl in self.followers.values():
            ctl.send({"op": "start"})
        for ctl in self.followers.values():
            expect_op(ctl.recv(), "ready")

    def send_round(self, tasks: list[Any]) -> None:
        wire = [[{"x": np.asarray(x), "y": np.asarray(y)} for x, y in t] for t in tasks]
        msg = {"op": "round", "tasks": wire, "warm": self.schedule.warm_marked}
        for ctl in self.followers.values():
            ctl.send(msg)

    def wait_round(self) -> None:
        for ctl in self.followers.values():
            expect_op(ctl.recv(), "done")

    def _end_followers(self) -> None:
        """Every follower's pushes acknowledged (so the servers hold the whole replica's work)."""
        if self._ended:
            return
        self._ended = True
        for ctl in self.followers.values():
            ctl.send({"op": "end"})
        for ctl in self.followers.values():
            expect_op(ctl.recv(), "ended")

    # -- Replica's steps -----------------------------------------------------------------------

    def _setup_cluster(self) -> None:
        self._accept_followers()
        super()._setup_cluster()

    def _create_tensors(self) -> None:
        super()._create_tensors()
        self._start_followers()

    def _wait_warm(self) -> None:
        super()._wait_warm()
        self._start_followers()

    def run(self) -> Any:
        try:
            result = super().run()
            self._end_followers()
            return result
        finally:
            for ctl in self.followers.values():
                ctl.close()  # a follower still waiting sees the link close and stops

    def _pull_full(self) -> Model:
        assert self.client is not None
        names = [t.name for t in self.all_tensors]
        got, _ = self.client.pull(names)
        self.full = assemble(self.spec, self.cfg.partitions, got)
        return self.full

    def _evaluate(self, epoch: int, test_x: np.ndarray, test_y: np.ndarray) -> float:
        full = self._pull_full()
        acc = full.accuracy(test_x, test_y)
        self.result.accuracy[epoch] = acc
        self.m.accuracy.set(acc)
        log.info("epoch %d complete: held-out accuracy %.4f (server weights, %d partitions)",
                 epoch, acc, self.cfg.partitions)  # fmt: skip
        if self.cfg.history:
            import json

            st = self.result.epochs.get(epoch)
            rec = {
                "time": time.time(),
                "epoch": epoch,
                "loss": round(st.loss_sum / max(st.batches, 1), 6) if st else None,
                "accuracy": acc,
                "images_per_s": round(st.images / max(st.seconds, 1e-9), 1) if st else None,
                "replicas": self.cfg.n_replicas,
                "partitions": self.cfg.partitions,
            }
            with open(self.cfg.history, "a") as fh:
                fh.write(json.dumps(rec) + "\n")
        return acc

    def _finish(self, test_x: Any, test_y: Any, threads: tuple[Any, ...]) -> None:
        cfg = self.cfg
        self._end_followers()
        deadline = time.monotonic() + cfg.wait_timeout
        while self.completed < cfg.epochs:
            self._check_threads(*threads)
            self._evaluate_completed(test_x, test_y)
            if time.monotonic() > deadline:
                raise TimeoutError(f"epoch {cfg.epochs} did not complete in time")
            time.sleep(0.1)
        if cfg.epochs in self.result.accuracy:  # evaluated early: export what is there now
            self._pull_full()
        else:
            self._evaluate(cfg.epochs, test_x, test_y)
        if cfg.out:
            from trainer import export

            full = self.full
            views = {n: full.param(n) for n, _ in full.tensors()}
            meta = {
                "epochs": cfg.epochs,
                "replicas": cfg.n_replicas,
                "partitions": cfg.partitions,
                "optimizer": cfg.optimizer_spec(),
                "heldout_accuracy": self.result.accuracy.get(cfg.epochs),
            }
            self.result.out = str(export.save(cfg.out, self.spec, views, meta))
            log.info("final weights written to %s", self.result.out)


def make_replica(cfg: TrainConfig, registry: CollectorRegistry | None = None) -> Replica:
    """The replica object of this process: unpartitioned, a leader or a follower."""
    if cfg.partitions <= 1:
        return Replica(cfg, registry)
    if cfg.partition == 0:
        return PartitionLeader(cfg, registry)
    return PartitionFollower(cfg, registry)
