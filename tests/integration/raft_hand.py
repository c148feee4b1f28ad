"""Three real Raft nodes (``GuardedSyncObj`` over the controller's replicated state) on
loopback, ticked by hand: the tests of pysyncobj's behaviour under the controller's overrides
drive them step by step instead of racing its tick thread."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from adamps.core.lease import LeaseTerms
from adamps.up.procs import free_port
from controller.raft_journal import make_guarded_node
from controller.raft_node import raft_conf
from controller.state import ClusterModel, ReplicatedCluster


@dataclass
class HandTicked:
    addrs: list[str]
    #: each node's replicated state, in the order of `nodes`
    clusters: list[ReplicatedCluster]
    nodes: list[Any]

    def tick_until(self, cond: Callable[[], bool], timeout: float = 20.0) -> None:
        """Ticks every node until `cond()` holds; fails with the nodes' status past `timeout`."""
        deadline = time.monotonic() + timeout
        while not cond():
            assert time.monotonic() < deadline, [n.getStatus() for n in self.nodes]
            for n in self.nodes:
                n.doTick(0.0)
            time.sleep(0.001)

    def leader(self) -> int:
        """The index of the node that leads now (one must)."""
        return next(i for i, n in enumerate(self.nodes) if n._isLeader())

    def destroy(self) -> None:
        for n in self.nodes:
            n.destroy()


def hand_ticked(tmp_path: Path, n: int = 3) -> HandTicked:
    """`n` nodes with journals and dumps under `tmp_path`, none ticking on its own."""
    addrs = [f"127.0.0.1:{free_port()}" for _ in range(n)]
    clusters, nodes = [], []
    for i, addr in enumerate(addrs):
        conf = raft_conf(
            password="pw",
            journal_file=str(tmp_path / f"n{i}.journal"),
            dump_file=str(tmp_path / f"n{i}.dump"),
            autoTick=False,
        )
        cluster = ReplicatedCluster(ClusterModel(8, LeaseTerms(1.0, 0.1, 0.2)))
        clusters.append(cluster)
        nodes.append(
            make_guarded_node(addr, [a for a in addrs if a != addr], conf=conf, consumers=[cluster])
        )
    return HandTicked(addrs, clusters, nodes)
