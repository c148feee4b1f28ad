"""What every partition process of a partitioned replica shares (trainer/partitioned.py has
the leader, trainer/partition_follower.py the follower): its workers, which exchange boundary
activations and errors; its Hogwild pool; the control link between leader and followers; and
`PartitionMember`, the part of a replica both roles add to ``trainer.downpour.Replica``.
Its own module so that the leader and the follower both build on it without importing each
other (an import cycle before, issue 26)."""

from __future__ import annotations

import logging
import socket
import struct
from collections.abc import Callable
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge

from adamps.wire import protocol
from trainer.config import TrainConfig
from trainer.exchange import Exchange, PeerLost, connect_mesh, parse_addr
from trainer.hogwild import Hogwild
from trainer.model import Model
from trainer.packing import DownpourWorker, PackPlan
from trainer.partition import PartitionModel, max_message_bytes, slice_params

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


def expect_op(msg: dict[str, Any], op: str) -> dict[str, Any]:
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


class PartitionMember:
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
        optimizer = self.cfg.optimizer_spec()
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
