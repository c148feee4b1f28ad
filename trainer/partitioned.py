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
import struct
import time
from collections.abc import Callable, Collection
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge

from adamps import protocol
from trainer.config import TrainConfig
from trainer.downpour import Replica
from trainer.exchange import Exchange, PeerLost, connect_mesh, parse_addr, token_digest
from trainer.hogwild import Hogwild
from trainer.model import Model
from trainer.packing import DownpourWorker, PackPlan
from trainer.partition import PartitionModel, assemble, max_message_bytes, slice_params

log = logging.getLogger(__name__)

_LEN = struct.Struct("!Q")
#: a control message is at most a round of minibatches: bounded before it is read
MAX_CONTROL_BYTES = 256 << 20


def transport_of(cfg: TrainConfig) -> str:
    """'shm' when every partition is on one host (unless told otherwise), else 'tcp'."""
    if cfg.partition_transport != "auto":
        return cfg.partition_transport
    hosts = {parse_addr(a)[0] for a in cfg.partition_addrs}
    return "shm" if len(hosts) == 1 else "tcp"


def worker_addrs(addrs: list[str]) -> list[str]:
    """Worker w of partition j listens on partition j's port + 1 + w (port itself: control)."""
    out = []
    for a in addrs:
        host, port = parse_addr(a)
        out.append(f"{host}:{port + 1}")
    return out


# -- the workers ----------------------------------------------------------------------------


class PartitionWorker(DownpourWorker):
    """A Downpour worker whose model is partition k's slice; it exchanges with worker w of the
    other partitions. Per round it leaves the bytes it sent and the seconds it waited for its
    peers in its ``xstat<w>`` buffer."""

    def __init__(
        self,
        spec: dict[str, Any],
        local_lr: float,
        plan: PackPlan,
        setup: dict[str, Any],
        worker_id: int,
        params: np.ndarray,
        buffers: dict[str, np.ndarray],
    ) -> None:
        links = connect_mesh(
            setup["k"],
            setup["addrs"],
            worker_id,
            setup["transport"],
            setup["token"],
            setup["capacity"],
            timeout=setup["timeout"],
            bind=setup["bind"],
        )
        self.exchange = Exchange(setup["k"], setup["parts"], links)
        self.model: Any = PartitionModel(
            spec, setup["k"], setup["parts"], self.exchange, params=params
        )
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
        self.xstat = buffers[f"xstat{worker_id}"]

    def __call__(self, batches: list[tuple[np.ndarray, np.ndarray]]) -> tuple[float, int, int]:
        b0, w0 = self.exchange.bytes_sent, self.exchange.wait_seconds
        out = super().__call__(batches)
        self.xstat[0] = self.exchange.bytes_sent - b0
        self.xstat[1] = self.exchange.wait_seconds - w0
        return out


def partition_worker_factory(
    spec: dict[str, Any],
    local_lr: float,
    plan: PackPlan,
    setup: dict[str, Any],
    worker_id: int,
    params: np.ndarray,
    buffers: dict[str, np.ndarray],
) -> PartitionWorker:
    """Hogwild factory (module level: picklable through functools.partial)."""
    return PartitionWorker(spec, local_lr, plan, setup, worker_id, params, buffers)


class PartitionMetrics:
    def __init__(self, registry: CollectorRegistry, k: int) -> None:
        self.bytes = Counter(
            "adamps_trainer_partition_bytes_exchanged",
            "bytes this partition sent to the other partitions of its replica (activations "
            "and errors crossing the cut)",
            ["partition"],
            registry=registry,
        ).labels(str(k))
        self.wait = Counter(
            "adamps_trainer_partition_wait_seconds",
            "seconds this partition's workers waited for the other partitions",
            ["partition"],
            registry=registry,
        ).labels(str(k))
        self.rounds = Gauge(
            "adamps_trainer_partition_rounds", "rounds run by this partition", registry=registry
        )


class _Pool:
    """A Hogwild pool that counts the exchange of each round; the leader's also drives the
    followers (send the round, run it here, wait for theirs)."""

    def __init__(self, pool: Hogwild, owner: Any) -> None:
        self.pool = pool
        self.owner = owner
        self.params = pool.params
        self.buffers = pool.buffers

    def __enter__(self) -> _Pool:
        self.pool.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.pool.__exit__(*exc)

    def run(self, tasks: list[Any]) -> list[Any]:
        send = getattr(self.owner, "send_round", None)
        if send is not None:
            send(tasks)
        outs = self.pool.run(tasks)
        self.owner.count_round(len(tasks))
        wait = getattr(self.owner, "wait_round", None)
        if wait is not None:
            wait()
        return outs


# -- the control link between the leader and the followers -----------------------------------


class Control:
    """Framed protocol messages on a TCP connection (numpy arrays inside, no pickle)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def send(self, msg: dict[str, Any]) -> None:
        body = protocol.encode(msg)
        self.sock.sendall(_LEN.pack(len(body)) + body)

    def _exact(self, n: int) -> bytearray:
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        while got < n:
            r = self.sock.recv_into(view[got:])
            if r == 0:
                raise PeerLost("the other partition closed the control link")
            got += r
        return buf

    def recv(self, limit: int = MAX_CONTROL_BYTES) -> dict[str, Any]:
        (n,) = _LEN.unpack(self._exact(_LEN.size))
        if n > limit:
            raise ValueError(f"control message of {n} bytes (at most {limit})")
        return protocol.decode(self._exact(n))

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


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


def _expect(msg: dict[str, Any], op: str) -> dict[str, Any]:
    if msg.get("op") == "error":
        raise RuntimeError(f"a partition failed: {msg.get('error')}")
    if msg.get("op") != op:
        raise RuntimeError(f"control link: expected {op!r}, got {msg.get('op')!r}")
    return msg


def _setup(cfg: TrainConfig, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "k": cfg.partition,
        "parts": cfg.partitions,
        "addrs": worker_addrs(cfg.partition_addrs),
        "transport": transport_of(cfg),
        "token": cfg.token,
        "capacity": max_message_bytes(spec, cfg.partitions, cfg.batch_size),
        "timeout": cfg.wait_timeout,
        "bind": bind_host(cfg),
    }


def bind_host(cfg: TrainConfig) -> str:
    """Where this partition listens: everywhere when its HTTP host is (a container), else on
    its own partition address's host."""
    if cfg.host in ("0.0.0.0", "::"):
        return cfg.host
    return parse_addr(cfg.partition_addrs[cfg.partition])[0]


class _PartitionMixin:
    """What a leader and a follower share: own tensors, the partition workers, the pool."""

    cfg: TrainConfig
    spec: dict[str, Any]
    registry: CollectorRegistry

    def _partition_init(self) -> None:
        cfg = self.cfg
        self.model: Any = PartitionModel(self.spec, cfg.partition, cfg.partitions)
        from adamps.layout import TensorSpec

        self.tensors = [TensorSpec(n, tuple(s)) for n, s in self.model.tensors()]
        #: every partition's tensors: the layout at the controllers is the whole model's
        self.all_tensors = [
            TensorSpec(n, tuple(s))
            for k in range(cfg.partitions)
            for n, s in PartitionModel(self.spec, k, cfg.partitions, _layout_only=True).tensors()
        ]
        self.pm = PartitionMetrics(self.registry, cfg.partition)
        self.exchanged_bytes = 0
        self.wait_seconds = 0.0
        self.rounds = 0
        self._xstat: dict[str, np.ndarray] = {}

    def _setup_cluster(self) -> None:
        own = self.tensors
        self.tensors = self.all_tensors  # the layout covers every partition's tensors
        try:
            super()._setup_cluster()  # type: ignore[misc]
        finally:
            self.tensors = own

    def _create_tensors(self) -> None:
        """Replica 0's partitions each create their own slices of the unpartitioned model's
        seeded initial weights: K = 1 and K = 2 start from the same model."""
        assert self.client is not None  # type: ignore[attr-defined]
        init = Model(self.spec)
        init.init_params(self.cfg.seed)
        values = slice_params(init, self.cfg.partition, self.cfg.partitions)
        optimizer: dict[str, Any] = {"kind": self.cfg.optimizer, "lr": self.cfg.server_lr}
        if self.cfg.optimizer == "adagrad":
            optimizer["initial_accumulator"] = self.cfg.adagrad_initial
        for t in self.tensors:
            self.client.create(  # type: ignore[attr-defined]
                t, init={"kind": "values", "values": values[t.name]}, optimizer=optimizer
            )

    def _worker_factory(self, plan: PackPlan) -> Callable[..., Any]:
        import functools

        setup = _setup(self.cfg, self.spec)
        return functools.partial(
            partition_worker_factory, self.spec, self.cfg.local_lr, plan, setup
        )

    def _pool(self, factory: Callable[..., Any], plan: PackPlan) -> Any:
        cfg = self.cfg
        buffers = plan.buffers(cfg.workers)
        buffers.update({f"xstat{w}": 2 for w in range(cfg.workers)})
        pool = Hogwild(
            factory, cfg.workers, self.model.params, mode=cfg.worker_mode, buffers=buffers
        )
        self._live_pool = _Pool(pool, self)
        return self._live_pool

    def count_round(self, workers: int) -> None:
        buffers = self._live_pool.buffers
        sent = sum(float(buffers[f"xstat{w}"][0]) for w in range(workers))
        waited = sum(float(buffers[f"xstat{w}"][1]) for w in range(workers))
        self.exchanged_bytes += int(sent)
        self.wait_seconds += waited
        self.rounds += 1
        self.pm.bytes.inc(sent)
        self.pm.wait.inc(waited)
        self.pm.rounds.set(self.rounds)

    def partition_status(self) -> dict[str, Any]:
        return {
            "partition": self.cfg.partition,
            "partitions": self.cfg.partitions,
            "transport": transport_of(self.cfg),
            "tensors": [t.name for t in self.tensors],
            "bytes_exchanged": self.exchanged_bytes,
            "wait_seconds": round(self.wait_seconds, 3),
            "rounds": self.rounds,
        }


class PartitionLeader(_PartitionMixin, Replica):
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
            _expect(ctl.recv(), "ready")

    def send_round(self, tasks: list[Any]) -> None:
        wire = [[{"x": np.asarray(x), "y": np.asarray(y)} for x, y in t] for t in tasks]
        msg = {"op": "round", "tasks": wire, "warm": self.schedule.warm_marked}
        for ctl in self.followers.values():
            ctl.send(msg)

    def wait_round(self) -> None:
        for ctl in self.followers.values():
            _expect(ctl.recv(), "done")

    def _end_followers(self) -> None:
        """Every follower's pushes acknowledged (so the servers hold the whole replica's work)."""
        if self._ended:
            return
        self._ended = True
        for ctl in self.followers.values():
            ctl.send({"op": "end"})
        for ctl in self.followers.values():
            _expect(ctl.recv(), "ended")

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
                "optimizer": {"kind": cfg.optimizer, "lr": cfg.server_lr},
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
    from trainer.partition_follower import PartitionFollower

    return PartitionFollower(cfg, registry)
