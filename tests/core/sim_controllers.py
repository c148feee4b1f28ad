"""The controllers of the replication simulation (tests/core/test_replication_sim.py): the group
as it ships, over a simulated Raft.

Each of the three nodes holds the controllers' real replicated state machine
(``controller.state.ReplicatedCluster`` around a ``ClusterModel``), its real leader loop
(``controller.leader.LeaderDuties``: silences, declare_dead, reconcile, sweeps) and its real
handling of the servers' calls (``controller.server_calls.ServerCalls``, what the HTTP handlers
of ``controller/service.py`` call once they read the request's JSON). What is simulated is what
pysyncobj and aiohttp do:

* Raft (``SimGroup``): one log; the leader proposes an entry (after the dry run
  ``RaftNode.commit`` makes), the entry is pickled as the journal carries it and applied in
  order, on the leader at once (a majority is always connected here) and on a follower when it
  becomes leader (it applies the log up to the end before it is ready). A leader change
  moves the leader's duties to another node: its soft state is the one it kept from its own
  earlier terms, and the leader loop restarts every silence clock, as on a real election.
* HTTP: a server's call arrives as the path and JSON body the real controllers' client
  (``adamps.client.controller.ControllerOps``) builds; the answer or the error (the
  ``ProtocolError``'s code and fields) goes back as JSON.
* time: the controllers' clocks (`wall` and `mono`) are the simulation's true time.

Every coroutine of the real code completes without waiting here (a commit applies at once), so
each call is run to its end in one step (``run_now``); one that waited would be a simulation
bug, and raises.
"""

from __future__ import annotations

import json
import pickle
from collections.abc import Callable, Coroutine
from typing import Any

from adamps import metrics
from adamps.core.lease import LeaseTerms
from adamps.wire.protocol import ProtocolError
from controller.config import ControllerConfig
from controller.ctl_metrics import ControllerMetrics
from controller.leader import LeaderDuties
from controller.raft_node import DRY_RUN_OPS, NotLeader
from controller.renewals import round_answer
from controller.server_calls import ServerCalls
from controller.state import ClusterModel, ReplicatedCluster, dry_run


def run_now(coro: Coroutine[Any, Any, Any]) -> Any:
    """Runs a coroutine that never waits (every commit here applies at once) to its end."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value
    coro.close()
    raise AssertionError("a simulated controller call waited for something")


class SimGroup:
    """The Raft group: its log, its term and which node leads."""

    def __init__(self, cfg: ControllerConfig, now: Callable[[], float], n: int = 3) -> None:
        self.cfg = cfg
        #: committed entries, (op, args) as the journal carries them
        self.log: list[tuple[str, tuple[Any, ...]]] = []
        self.term = 1
        self.leader = 0
        self.nodes = [SimNode(self, i, now) for i in range(n)]

    @property
    def lead(self) -> SimNode:
        return self.nodes[self.leader]

    def change_leader(self, i: int) -> None:
        """An election won by node `i`: it applies the log to its end, then leads."""
        self.term += 1
        self.leader = i
        self.nodes[i].catch_up()


class SimNode:
    """One controller: the real state machine, leader loop and call handling; RaftNode's face
    (`is_leader`, `is_ready`, `term`, `commit`) over `SimGroup`."""

    def __init__(self, group: SimGroup, i: int, now: Callable[[], float]) -> None:
        cfg = group.cfg
        self.group, self.i = group, i
        self.terms = LeaseTerms(cfg.lease_duration, cfg.lease_skew, cfg.lease_margin)
        self.cluster = ReplicatedCluster(
            ClusterModel(cfg.n_buckets, self.terms, cfg.replication, cfg.min_servers)
        )
        #: entries of the group's log this node applied
        self.applied = 0
        m = ControllerMetrics(metrics.new_registry())
        self.leader = LeaderDuties(cfg, self.cluster, self, m, mono=now, wall=now)
        self.calls = ServerCalls(
            cfg, self.terms, self.cluster, self.leader, self.commit, self.renew, m, wall=now
        )

    @property
    def model(self) -> ClusterModel:
        return self.cluster.read(lambda m: m)

    @property
    def term(self) -> int:
        return self.group.term

    def is_leader(self) -> bool:
        return self.group.leader == self.i

    def is_ready(self) -> bool:
        return self.applied == len(self.group.log)

    def catch_up(self) -> Any:
        res = None
        for op, args in self.group.log[self.applied :]:
            res = getattr(self.cluster, op)(*args, _doApply=True)
            self.applied += 1
        return res

    async def commit(self, op: str, *args: Any) -> dict[str, Any]:
        """RaftNode.commit: the dry run, then the entry appended and applied."""
        if not self.is_leader():
            raise NotLeader()
        if op in DRY_RUN_OPS:
            dry = self.cluster.read(lambda m: dry_run(m, op, args))
            if not dry.get("ok"):
                return dry
        self.group.log.append(pickle.loads(pickle.dumps((op, args))))
        return self.catch_up()

    async def renew(self, sid: str) -> dict[str, Any]:
        """RenewalRounds.renew for a leader with no round in flight: a round of one server."""
        res = await self.commit("x_renew_round", [sid], self.leader.wall())
        return round_answer(res, sid)

    def handle(self, path: str, body: bytes) -> dict[str, Any]:
        """One server's call as the service routes it; its JSON answer, or {"error": {...}}."""
        parts = path.strip("/").split("/")
        req = json.loads(body)
        try:
            if parts[0] == "servers" and parts[2] == "register":
                res = run_now(self.calls.register(parts[1], req))
            elif parts[0] == "servers" and parts[2] == "heartbeat":
                res = run_now(self.calls.heartbeat(parts[1], req))
            elif parts[0] == "buckets":
                res = run_now(self.calls.bucket_op(int(parts[1]), parts[2], req))
            else:  # pragma: no cover
                raise AssertionError(path)
        except ProtocolError as exc:
            return {"error": exc.to_dict()}
        return json.loads(json.dumps(res))

    def step(self) -> None:
        """One pass of the leader loop (``LeaderDuties.run`` between two sleeps)."""
        try:
            run_now(self.leader.step())
        except (ProtocolError, NotLeader):
            pass
        self.leader.stepped()
