"""The leader's duties (soft state, never replicated): it remembers when each parameter server
last sent a heartbeat, turns a silence longer than `server_timeout` into a committed
`declare_dead`, proposes a `reconcile` whenever some lease may be granted (a dead primary's lease
has certainly expired, or a hand-off target has caught up), and sweeps dead servers nothing
refers to any more. A new leader starts every server's silence clock afresh, so a leader change
never declares anybody dead by itself."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from adamps.wire import ride
from adamps.wire.protocol import ProtocolError
from controller.config import ControllerConfig
from controller.ctl_metrics import ControllerMetrics
from controller.raft_node import NotLeader, RaftNode
from controller.state import DEAD, ClusterModel, ReplicatedCluster

log = logging.getLogger("controller.service")

#: seconds between two updates of the gauges (idle costs little, issue 36: they read the whole
#: record; a scrape comes every few seconds at most, and the step's own decisions need none)
METRICS_EVERY = 1.0


class LeaderDuties:
    """The leader loop and its soft state. Event-loop thread only.

    Its clocks are arguments (`mono` for silences, `wall` for the entries' `now`) and `raft` is
    anything with RaftNode's `is_leader`, `is_ready`, `term` and `commit`: the replication
    simulation (tests/core/test_replication_sim.py) runs this class over a simulated Raft and
    virtual time, calling `step` where `run` sleeps."""

    def __init__(
        self,
        cfg: ControllerConfig,
        cluster: ReplicatedCluster,
        raft: RaftNode | Any,
        m: ControllerMetrics,
        mono: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.cfg = cfg
        self.cluster = cluster
        self.raft = raft
        self.m = m
        self.mono = mono
        self.wall = wall
        #: leader soft state: server id -> monotonic time of its last heartbeat
        self.last_seen: dict[str, float] = {}
        #: leader soft state: bucket -> server -> [epoch, seq] last reported
        self.reports: dict[int, dict[str, list[int]]] = {}
        self._was_leader = False
        #: monotonic time the leader loop's last step ended (a long gap: this node was stalled)
        self._last_step = mono()
        #: seconds the loop planned to sleep after that step (`run`; the simulation's virtual
        #: clock steps every reconcile_interval)
        self._planned = cfg.reconcile_interval

    def heard_from(self, sid: str) -> None:
        """A heartbeat or registration of server `sid` arrived now."""
        self.last_seen[sid] = self.mono()

    def record_report(self, b: int, sid: str, position: list[int]) -> None:
        """Server `sid` reported its copy of bucket `b` at [epoch, seq]."""
        self.reports.setdefault(b, {})[sid] = position

    def reports_of(self, b: int) -> dict[str, list[int]]:
        return self.reports.get(b, {})

    async def run(self) -> None:
        metrics_due = 0.0
        while True:
            try:
                await self.step()
                if self.mono() >= metrics_due:
                    metrics_due = self.mono() + METRICS_EVERY
                    self.m.update(
                        self.raft.is_leader(),
                        self.raft.term,
                        self.raft.commit_index,
                        self.cluster,
                        self.raft.journal(),
                    )
            except asyncio.CancelledError:
                raise
            except ProtocolError as exc:
                log.info("leader step: %s", exc)
            except NotLeader:
                pass
            except Exception:
                log.exception("leader step failed")
            self.stepped()
            # At most reconcile_interval apart, with another timer's wake-up when one is due in
            # its second half (issue 36: a follower's loop woke four times a second for this)
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            self._planned = await ride.sleep(self.cfg.reconcile_interval) - t0

    def stepped(self) -> None:
        """A step ended (whatever its outcome): measured from here, the step's own waits
        (commits) are no stall."""
        self._last_step = self.mono()

    async def step(self) -> None:
        """One pass of the leader's decisions (nothing when this node does not lead)."""
        leader = self.raft.is_leader() and self.raft.is_ready()
        if not leader:
            self._was_leader = False
            return
        mono = self.mono()
        gap = mono - self._last_step - self._planned
        stalled = gap > self.cfg.server_timeout / 2
        if not self._was_leader:
            # A new leader knows no heartbeat yet: everybody's silence clock starts now.
            self._was_leader = True
            self.last_seen = {}
            log.info("this node leads (term %d)", self.raft.term)
        elif stalled:
            # This node itself was stopped or starved (a pause, a flooded port): the heartbeats
            # of that time were never read, so their absence says nothing about the servers.
            log.warning("leader loop stalled %.1fs: every server's silence clock restarts", gap)
            self.last_seen = {}
        servers = self.cluster.read(lambda m: {s: r["state"] for s, r in m.servers.items()})
        for sid, state in servers.items():
            if state == DEAD:
                self.last_seen.pop(sid, None)
                continue
            seen = self.last_seen.setdefault(sid, mono)
            if mono - seen > self.cfg.server_timeout:
                log.warning("server %s silent for %.1fs: declaring it dead", sid, mono - seen)
                await self.raft.commit("declare_dead", sid, self.wall(), self.reports_copy())
                self.m.dead.inc()
                self.last_seen.pop(sid, None)
        now = self.wall()
        if self.cluster.read(lambda m: m.grants_due(now) or m.holds_due(now)):
            await self.raft.commit("reconcile", now, self.reports_copy())
        dead_before = now - self.cfg.dead_server_ttl
        for sid in self.cluster.read(lambda m: expired_dead(m, dead_before)):
            await self.raft.commit("sweep_dead", sid, dead_before, now)

    def reports_copy(self) -> dict[int, dict[str, list[int]]]:
        return {b: dict(r) for b, r in self.reports.items()}


def expired_dead(m: ClusterModel, dead_before: float) -> list[str]:
    return [
        s
        for s, r in m.servers.items()
        if r["state"] == DEAD and r["since"] <= dead_before and not m.refers_to(s)
    ]
