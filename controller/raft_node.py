"""One controller's Raft node (pysyncobj): who leads, whether it has a quorum, and the proposal
of a write, which waits for the entry to commit and apply here.

A write that cannot commit within `commit_timeout`, or that is asked while this node has no
majority, fails fast with ``no_quorum``; the caller may retry (every operation is safe to retry:
the replicated methods check epochs and states). A write whose apply would refuse is not
proposed: it is first run on a copy of the applied state (``DRY_RUN_OPS``).
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from pysyncobj import FAIL_REASON, SyncObjConf

from adamps.wire.protocol import ProtocolError
from controller.config import ControllerConfig
from controller.ctl_metrics import ControllerMetrics
from controller.raft_journal import GuardedSyncObj, make_guarded_node
from controller.raft_timing import append_period
from controller.raft_transport import RaftLimits, transport_class
from controller.state import ReplicatedCluster, dry_run

#: operations asked for by clients: dry-run on a copy of the state before they are proposed
#: (those whose apply can refuse; register, rebalance and report_progress always succeed once
#: their arguments passed the handlers' checks, so they skip the copy)
DRY_RUN_OPS = frozenset(
    {
        "drain",
        "role_change",
        "verified_caught_up",
        "write_off",
        "release",
        "drop_secondary",
        "set_layout",
    }
)
#: the refusals of replicated methods that keep their code on the wire (others: conflict)
ERROR_CODES = {
    "stale_epoch", "conflict", "not_found", "unknown_bucket", "bad_request", "internal",
    # runs (controller/run_ops.py)
    "exists", "forbidden", "quota_exceeded", "too_large",
}  # fmt: skip


def ok_or_raise(res: dict[str, Any]) -> dict[str, Any]:
    """A replicated method's refusal becomes the matching 4xx error."""
    if res.get("ok"):
        return res
    code = res.get("error", "conflict")
    extra = {k: v for k, v in res.items() if k not in ("ok", "error", "message")}
    raise ProtocolError(
        code if code in ERROR_CODES else "conflict", res.get("message", code), **extra
    )


class NotLeader(Exception):
    pass


class RaftNode:
    """This controller's member of the Raft group, replicating `cluster`."""

    def __init__(
        self, cfg: ControllerConfig, cluster: ReplicatedCluster, m: ControllerMetrics
    ) -> None:
        self.cfg = cfg
        self.cluster = cluster
        self.m = m
        conf = raft_conf(
            password=cfg.password,
            journal_file=os.path.join(cfg.data_dir, "raft.journal"),
            dump_file=os.path.join(cfg.data_dir, "raft.dump"),
            raftMinTimeout=cfg.election_min,
            raftMaxTimeout=cfg.election_max,
            leaderFallbackTimeout=cfg.leader_fallback,
            logCompactionMinEntries=cfg.compaction_entries,
            logCompactionMinTime=cfg.compaction_seconds,
            bindAddress=f"{cfg.bind_host}:{cfg.raft_addresses[cfg.member].rsplit(':', 1)[1]}"
            if cfg.bind_host
            else None,
        )
        raft = cfg.raft_addresses
        self.self_raft = raft[cfg.member]
        self.http_of = dict(zip(raft, cfg.http_addresses, strict=True))
        self.node = make_node(
            self.self_raft,
            [a for a in raft if a != self.self_raft],
            self.cluster,
            conf,
            cfg.raft_limits,
        )

    @property
    def last_applied(self) -> int:
        """The index of the last entry applied on this node."""
        return self.node.raftLastApplied

    @property
    def term(self) -> int:
        return self.node.raftCurrentTerm

    @property
    def commit_index(self) -> int:
        return self.node.raftCommitIndex

    def is_ready(self) -> bool:
        """This node has applied the log it found at start (a new leader has caught up)."""
        return self.node.isReady()

    def is_leader(self) -> bool:
        return self.node.leads()  # not getStatus()'s dump (GuardedSyncObj.leads)

    def leader_raft(self) -> str | None:
        leader = self.node.leader_node()
        return None if leader is None else leader.address

    def journal(self) -> dict[str, Any]:
        """Whether this node can write its Raft journal (controller/raft_journal.py)."""
        return self.node.journal.state()

    def check_journal(self) -> None:
        """Raises 503 `unavailable` while this node stands aside (it cannot write its journal):
        it neither applies new entries nor can it wait for a forwarded write to apply here, so
        clients ask another controller (adamps.client.controller retries `unavailable` there)."""
        error = self.node.journal_error()
        if error is not None:
            raise ProtocolError(
                "unavailable",
                f"this controller stands aside: {error}; ask another controller",
                retry_after=1.0,
            )

    def has_quorum(self) -> bool:
        try:
            return bool(self.node.hasQuorum)
        except RuntimeError:  # a set changed size under us (the Raft thread): ask again
            return bool(self.node.hasQuorum)

    def raft_status(self) -> dict[str, Any]:
        leader = self.leader_raft()
        return {
            "self": self.self_raft,
            "role": "leader" if self.is_leader() else ("follower" if leader else "candidate"),
            "leader": leader,
            "leader_http": self.http_of.get(leader) if leader else None,
            "term": self.node.raftCurrentTerm,
            "commit_index": self.node.raftCommitIndex,
            "last_applied": self.node.raftLastApplied,
            "has_quorum": self.has_quorum(),
            "ready": self.node.isReady(),
            "members": self.cfg.members,
            "journal": self.journal(),
        }

    async def commit(self, op: str, *args: Any, ride: bool = False) -> dict[str, Any]:
        """Proposes `op(*args)` on this node (the leader) and waits for it to commit and apply.
        `ride`: its entry goes out with the leader's next heartbeat, at most one append period
        later, not in an append of its own (controller/raft_riding.py: the renewal rounds)."""
        if not self.is_leader():
            raise NotLeader()
        if not self.has_quorum():
            self.m.writes.labels(op, "no_quorum").inc()
            raise ProtocolError(
                "no_quorum", "the leader is not connected to a majority of controllers"
            )
        if op in DRY_RUN_OPS:
            # A Raft entry whose apply would refuse is not proposed (issue 12): the operation is
            # first run on a copy of this leader's applied state. Only an entry committed in
            # between can still make the real apply refuse (then a no-op on every replica).
            # In a thread: an operation not about one bucket (set_layout, drain) copies the
            # whole state, 0.1 s with a layout of 4096 tensors (issue 39's loop-lag probe).
            dry = await asyncio.to_thread(self.cluster.read, lambda m: dry_run(m, op, args))
            if not dry.get("ok"):
                self.m.writes.labels(op, "refused").inc()
                return dry
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()

        def done(result: Any, err: int) -> None:
            def settle() -> None:
                if not fut.done():
                    fut.set_result((result, err))

            loop.call_soon_threadsafe(settle)

        t0 = time.perf_counter()
        if ride:
            self.node.ride_next_append(lambda: getattr(self.cluster, op)(*args, callback=done))
        else:
            getattr(self.cluster, op)(*args, callback=done)
        try:
            result, err = await asyncio.wait_for(fut, self.cfg.commit_timeout)
        except TimeoutError:
            self.m.writes.labels(op, "no_quorum").inc()
            raise ProtocolError(
                "no_quorum",
                f"{op} did not commit within {self.cfg.commit_timeout}s (no majority?); outcome unknown",
            ) from None
        if err != FAIL_REASON.SUCCESS:
            self.m.writes.labels(op, "failed").inc()
            raise ProtocolError(
                "no_quorum", f"{op} was not committed (raft reason {err}); retry", raft_error=err
            )
        self.m.write_s.observe(time.perf_counter() - t0)
        self.m.writes.labels(op, "ok" if result.get("ok") else "refused").inc()
        return result

    def close(self) -> None:
        self.node.destroy()


def raft_conf(
    *,
    password: str,
    journal_file: str,
    dump_file: str,
    fast: bool = True,
    **overrides: Any,
) -> SyncObjConf:
    """pysyncobj settings: always a password, a journal AND a full dump, fast elections.

    Timings: a follower starts an election 0.6-1.4 s after the last append from the leader, so a
    new leader is normally in place within ~1-2 s of a crash, well inside a server's 5 s lease;
    a leader that hears from no majority for 1 s steps down (the default 30 s would let a
    cut-off leader believe it leads). The election timeout was 0.3-0.9 s: its heartbeats every
    75 ms were most of what an idle cluster cost (issue 36); the tests' clusters keep it
    (adamps.up.cluster.FAST_CONTROLLER_OPTS, beside their 2 s leases). A connection is
    dropped after ``connectionTimeout`` of silence, never shorter than an election timeout
    (pysyncobj asserts it).

    Idle costs little (issue 36): the tick thread waits for a message, a command or this node's
    next deadline (controller/raft_timing.py): a leader's next append (Raft's heartbeats, four
    per shortest election timeout: ``appendEntriesPeriod`` is derived from ``raftMinTimeout``
    unless given), a follower's election deadline, and at most ``autoTickPeriod`` (pysyncobj's
    reconnections, every ``connectionRetryTime``). A command does not wait for the tick:
    unbatched, it wakes the thread through pysyncobj's pipe and is appended and sent at once;
    its commit index reaches the followers with the next append, at most one
    ``appendEntriesPeriod`` later (``GuardedSyncObj._SyncObj__applyLogEntries``: not an append of
    its own per entry).
    """
    if not password:
        raise ValueError("pysyncobj needs a password: its port carries pickled data")
    if not journal_file or not dump_file:
        raise ValueError("both a journal file and a full-dump file are required")
    opts: dict[str, Any] = {
        "password": password,
        "journalFile": journal_file,
        "fullDumpFile": dump_file,
        # Forked dumps (issue 40): the Raft thread forks, and the child pickles and gzips the
        # state as it was at the fork (copy-on-write) and exits; the Raft thread goes on at
        # once. In-thread dumps of 100,000 buckets took 5-8 s of it every 5 s (a deepcopy
        # under the model's lock, then pickle and gzip). The child runs no other thread's
        # code: it pickles, writes the file, and leaves with os._exit.
        "useFork": True,
        "commandsWaitLeader": False,
        "dynamicMembershipChange": False,
    }
    if fast:
        opts.update(
            raftMinTimeout=0.6,
            raftMaxTimeout=1.4,
            connectionTimeout=1.5,
            connectionRetryTime=0.3,
            leaderFallbackTimeout=1.0,
            # the longest wait of the tick thread (a shorter one when a deadline is sooner)
            autoTickPeriod=0.3,
            appendEntriesUseBatch=False,
        )
    opts.update(overrides)
    if "connectionTimeout" in opts and "connectionTimeout" not in overrides:
        # an election_max above 1.5 s was refused by pysyncobj's assertion at start
        opts["connectionTimeout"] = max(opts["connectionTimeout"], opts.get("raftMaxTimeout", 0))
    if "appendEntriesPeriod" not in opts and "raftMinTimeout" in opts:
        opts["appendEntriesPeriod"] = append_period(opts["raftMinTimeout"])
    return SyncObjConf(**opts)


def make_node(
    self_addr: str,
    partners: list[str],
    cluster: ReplicatedCluster,
    conf: SyncObjConf,
    limits: RaftLimits | None = None,
) -> GuardedSyncObj:
    """A Raft node on `self_addr` (host:port) replicating `cluster` with `partners`, on the
    bounded transport (bound to its own address; controller/raft_transport.py), that stands
    aside while it cannot write its journal (controller/raft_journal.py)."""
    return make_guarded_node(
        self_addr,
        partners,
        conf=conf,
        consumers=[cluster],
        transportClass=transport_class(limits or RaftLimits()),
    )
