"""Randomized simulation of bucket replication: the pure core, the real controller model, a faithful
but simple model of the asyncio shell, an unreliable network, and a nemesis (etcd-io/raft's network
test shape: no sockets, no threads, time passed in).

Every seed builds a small cluster (4-5 servers, 2 buckets, 3 copies each) and runs it for a few
hundred steps of 50 ms. Within a step, the due messages, the servers' timers, the controller
leader's loop and the clients run in a random order. The network drops, delays (hence reorders),
duplicates and partitions messages; the nemesis crashes servers (memory lost, restart from the last
flushed cut of store + position + dedup table, sometimes without it), pauses them (memory kept,
timers frozen, messages queued), crashes or pauses all of them at once, partitions them, drains,
adds servers, rebalances and changes the controller leader (its soft state is lost). Clients push
unique update ids under (client, seq) and retry an unknown outcome with the same key; a push counts
as acknowledged when a server answers it so (whether or not the answer reaches the client).

After every step the invariants of issue 11 are checked:

1. leases: the committed lease record passes `check_history`; a server acts as primary (accepts a
   push, starts a round, serves a snapshot) only under the lease epoch the record gives it, and no
   later epoch is granted before the holder's own deadline (`HolderLeases`, on its skewed clock);
2. every acknowledged push is held (applied, or prepared without a hole) by every promotable copy:
   each live member of the controller's replica set and each live candidate, except, for a copy
   reloaded from its disk after a crash, the pushes acknowledged after that cut (the loss window);
3. copies at equal (committed_epoch, committed) hold equal values (applied lists), and no copy
   ever applies an update twice.

At the end the nemesis stops, everything heals and settles: every acknowledged push is then applied
exactly once on every member (minus the loss-window ones, which were never applied twice either),
and no push that failed with a definite error is applied anywhere.

Pushes are acknowledged as the servers' `ack` option says: at the decision point of two-phase
commit (every member prepared the batch, the primary applied it: the default) in three seeds of
four, once every member committed it in the fourth (``ADAMPS_SIM_ACK=prepared|committed`` runs
every seed in one mode).

On failure the seed and the last events are printed. ``ADAMPS_SIM_SEEDS=N`` runs N seeds (default
200); ``ADAMPS_SIM_STEPS`` sets the steps per seed (default 300); ``ADAMPS_SIM_SEED=S`` runs one.

Bugs found (each one a strict xfail test at the end of this file; the simulation runs with the
suggested fix emulated, ``ADAMPS_SIM_UNPATCHED=1,2,...|all`` leaves them as the code has them):

1. `add_learner` counts the learner as committed at the snapshot's seq before it installed it: it
   is reported caught up, and becomes a promotable member, holding nothing.
2. A primary handed off becomes `joining` without `on_assignment` (the shell sets the
   assignment): it keeps its round in flight, and replays it if promoted later (wedged bucket, or
   a push applied twice).
3. A caught-up report whose outcome is unknown (reply lost, or the client's retry refused as a
   duplicate) makes the primary forget a learner the controller made a member.
4. A caught-up report is not tied to the join it reports on: one sent before the copy restarted
   or transferred again is accepted for the new, empty copy.
5. (The shell, not the core.) A round's pushes are acknowledged after the lease ended, even
   after the next epoch was granted: two copies acknowledge in overlapping lease time.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import random
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from adamps.core.lease import HolderLeases, LeaseTerms, check_history
from adamps.core.replication import Assignment, Batch, BucketReplica, Reject
from controller.state import DEAD, LIVE, ClusterModel

# -- timings (the defaults of the real configs, scaled by about 1/4) ------------------------------

TERMS = LeaseTerms(duration=1.25, skew=0.1, margin=0.1)
DT = 0.05  # one simulation step
HEARTBEAT = 0.25
SERVER_TIMEOUT = 0.75
RECONCILE = 0.06
MEMBER_TIMEOUT = 0.5
PING = 0.08
FAILOVER_AFTER = 0.75
FLUSH = 0.25
CTL_ATTEMPT = 1.25  # AsyncControllerClient: per-attempt timeout ...
CTL_RETRY_FOR = 1.25  # ... and retries for this long
PUSH_TIMEOUT = 3.0  # the client's
LOG_LIMIT = 16  # replication_log: small, so lagging members need state transfers
#: chance that a restarted server finds one copy's cut on its disk corrupted (issue 29)
CORRUPT_P = 0.15
N_BUCKETS = 2
CTL = "ctl"

SEEDS = int(os.environ.get("ADAMPS_SIM_SEEDS", "200"))
STEPS = int(os.environ.get("ADAMPS_SIM_STEPS", "300"))
ONE_SEED = os.environ.get("ADAMPS_SIM_SEED")
ACK = os.environ.get("ADAMPS_SIM_ACK", "")  # "prepared" | "committed": every seed in that mode

logging.getLogger("controller.state").setLevel(logging.ERROR)


class Violation(AssertionError):
    pass


#: The simulation found bugs (each reproduced by its own strict xfail test at the end of this
#: file). To explore past them it runs with the fix each test suggests, emulated here in the
#: core's subclass, the shell model and the controller's handler. ADAMPS_SIM_UNPATCHED lists the
#: bugs to leave as the code has them ("1,4"), or "all" (then seeds fail within a few runs).
_UNFIXED = os.environ.get("ADAMPS_SIM_UNPATCHED", "")
UNFIXED = {1, 2, 3, 4, 5} if _UNFIXED == "all" else {int(x) for x in _UNFIXED.split(",") if x}


class PatchedReplica(BucketReplica):
    def add_learner(self, member: str, join: int = 0) -> Reject | None:
        # Bug 1 (test_learner_is_not_caught_up_before_it_installed_the_snapshot): the learner
        # counts as having committed `committed` from the moment the snapshot is taken, so it is
        # reported caught up (and becomes a promotable member) before it installed anything.
        # Fix: wait for the learner's own commit ack.
        prev = self.learners.get(member)
        rej = super().add_learner(member, join)
        if rej is None:
            if 1 not in UNFIXED:
                self.acked_commit[member] = -1
            if prev in ("reporting", "reported") and 4 not in UNFIXED:
                # Bug 4, the primary's side: a new snapshot for a learner whose report is in
                # flight (it went silent and transfers again) resets it to "syncing", and
                # Replicator._unresponsive then forgets it while the controller may still accept
                # the report. Fix: keep the state (the rounds wait for it until the answer).
                self.learners[member] = prev
        return rej


Replica = BucketReplica if UNFIXED >= {1, 4} else PatchedReplica


# -- network ---------------------------------------------------------------------------------------


@dataclass(order=True)
class Msg:
    at: float
    n: int
    src: str = field(compare=False)
    dst: str = field(compare=False)
    kind: str = field(compare=False)
    body: dict[str, Any] = field(compare=False)


class Network:
    def __init__(self, sim: Sim) -> None:
        self.sim = sim
        self.rng = sim.rng
        self.queue: list[Msg] = []
        self.n = itertools.count()
        self.drop = 0.0
        self.dup = 0.0
        self.slow = 0.0
        #: cut links: frozenset({a, b})
        self.cut: set[frozenset[str]] = set()

    def blocked(self, a: str, b: str) -> bool:
        return frozenset((a, b)) in self.cut

    def send(self, src: str, dst: str, kind: str, body: dict[str, Any]) -> None:
        # controller traffic is HTTP to a Raft group that retries: lost far less often
        drop = self.drop / 4 if CTL in (src, dst) else self.drop
        if self.blocked(src, dst) or self.rng.random() < drop:
            return
        # HTTP requests are never duplicated by the network, except the peers' (a resent
        # repl_multi) and the controller's (its client retries): clients' pushes are not
        dup = self.dup if kind not in ("push", "push_reply") else 0.0
        copies = 2 if self.rng.random() < dup else 1
        for _ in range(copies):
            delay = self.rng.uniform(0.0, 0.03)
            if self.rng.random() < self.slow:
                delay += self.rng.uniform(0.05, 0.8)
            heapq.heappush(
                self.queue, Msg(self.sim.now + delay, next(self.n), src, dst, kind, body)
            )

    def due(self) -> list[Msg]:
        out = []
        while self.queue and self.queue[0].at <= self.sim.now:
            out.append(heapq.heappop(self.queue))
        return out


# -- the fake store and disk -----------------------------------------------------------------------


@dataclass
class Cut:
    """One flush: values, position and dedup table of a copy, taken at one instant."""

    values: list[int]
    epoch: int
    seq: int
    dedup: list[list[Any]]
    at: int  # when the cut was taken (the simulation's event counter)
    prepared: tuple[Batch, ...] = ()  # held prepared at the cut (written with it)


@dataclass
class Rpc:
    deadline: float  # local clock
    on_reply: Callable[[dict[str, Any]], None]
    on_fail: Callable[[str], None]
    # controller calls are retried until `retry_until` (AsyncControllerClient)
    retry: tuple[str, str, dict[str, Any]] | None = None
    retry_until: float = 0.0


class Waiter:
    """A client push waiting in the core (the shell's future)."""

    def __init__(self, server: Server, client: str, key: tuple[str, int], uid: int, b: int) -> None:
        self.server, self.client, self.key, self.uid, self.b = server, client, key, uid, b
        self.rid = 0
        self.done = False


@dataclass
class CommitPhase:
    seq: int
    epoch: int
    started: float = -1.0
    out: set[str] = field(default_factory=set)
    failed: set[str] = field(default_factory=set)


class Rounds:
    """The state of `Replicator._rounds` for one bucket (one task per bucket)."""

    def __init__(self, rep: BucketReplica) -> None:
        self.rep = rep
        self.prep_epoch: int | None = None
        self.prep_started = 0.0
        self.prep_out: set[str] = set()
        self.prep_failed: set[str] = set()
        self.commits: deque[CommitPhase] = deque()
        #: members being brought up to date while idle (_sync_member)
        self.syncing: set[str] = set()
        #: _unresponsive in progress: (member, epoch, phase, deadline)
        self.drop: list[Any] | None = None
        self.drop_queue: list[str] = []
        self.alive = True


# -- a parameter server (the shell) ----------------------------------------------------------------


class Server:
    def __init__(
        self,
        sim: Sim,
        sid: str,
        disk: dict[int, Cut],
        wiped: bool = False,
        corrupt: frozenset[int] = frozenset(),
    ) -> None:
        self.sim, self.sid, self.disk = sim, sid, disk
        self.rate = sim.rng.uniform(0.96, 1.04)
        self.off = sim.rng.uniform(0, 100)
        self.reps: dict[int, BucketReplica] = {}
        self.roles: dict[int, str] = {}
        self.store: dict[int, list[int]] = {}
        self.leases = HolderLeases(TERMS)
        self.registered = False
        self.registering = False
        self.table_version: int | None = None
        self.unavailable: frozenset[int] = frozenset()
        self.last_heard: dict[int, float] = {}
        self.role_change_after: dict[int, float] = {}
        self.hb_inflight = False
        self.hb_next = 0.0
        self.reregister_at: float | None = None
        self.next_ping = self.local() + PING
        self.next_flush = self.local() + sim.rng.uniform(0, FLUSH)
        self.rpcs: dict[int, Rpc] = {}
        self.rounds: dict[int, Rounds] = {}
        #: (bucket, learner) -> event count of the snapshot that made it a learner
        self.joined_at: dict[tuple[int, str], int] = {}
        #: bucket -> (next try, outstanding rid or None)
        self.joins: dict[int, list[Any]] = {}
        #: bucket -> event count of the disk cut this copy was reloaded from (loss window)
        self.restored: dict[int, int] = {}
        self.crashed = False
        self.paused_until: float | None = None
        # A cut that fails its checksum (issue 29) is dropped at the reload, as
        # Persister.verify + discard do: the copy offers nothing and rejoins by state transfer.
        for b in corrupt:
            disk.pop(b, None)
        if not wiped:
            for b, cut in disk.items():
                rep = self.reps[b] = Replica(sid, b, log_limit=LOG_LIMIT)
                rep.restore(cut.seq, cut.epoch, cut.dedup, cut.prepared)
                self.roles[b] = "standby"
                self.store[b] = list(cut.values)
                self.restored[b] = cut.at
        else:
            disk.clear()

    # -- helpers -----------------------------------------------------------------------------

    def local(self) -> float:
        return self.off + self.rate * self.sim.now

    def to_true(self, local: float) -> float:
        return (local - self.off) / self.rate

    @property
    def up(self) -> bool:
        return not self.crashed and self.paused_until is None

    def log(self, text: str) -> None:
        self.sim.log(f"{self.sid}: {text}")

    def call(
        self,
        dst: str,
        kind: str,
        body: dict[str, Any],
        on_reply: Callable[[dict[str, Any]], None],
        on_fail: Callable[[str], None],
        timeout: float = MEMBER_TIMEOUT,
    ) -> int:
        rid = self.sim.rid()
        rpc = Rpc(self.local() + timeout, on_reply, on_fail)
        if dst == CTL:
            rpc.deadline = self.local() + CTL_ATTEMPT
            rpc.retry = (dst, kind, body)
            rpc.retry_until = self.local() + CTL_RETRY_FOR
        self.rpcs[rid] = rpc
        self.sim.net.send(self.sid, dst, kind, {**body, "rid": rid, "from": self.sid})
        return rid

    def on_reply(self, body: dict[str, Any]) -> None:
        rpc = self.rpcs.pop(body["rid"], None)
        if rpc is None:
            return
        if "error" in body:
            rpc.on_fail(body["error"])
        else:
            rpc.on_reply(body)

    def expire_rpcs(self) -> None:
        now = self.local()
        for rid in [r for r, rpc in self.rpcs.items() if rpc.deadline <= now]:
            rpc = self.rpcs.pop(rid)
            if rpc.retry is not None and now < rpc.retry_until:
                # the controller client tries again (same request: duplicates reach the model)
                dst, kind, body = rpc.retry
                rpc.deadline = now + CTL_ATTEMPT
                self.rpcs[rid] = rpc
                self.sim.net.send(self.sid, dst, kind, {**body, "rid": rid, "from": self.sid})
                continue
            rpc.on_fail("timeout")

    def request_heartbeat(self) -> None:
        self.hb_next = min(self.hb_next, self.local())

    def can_write(self, b: int) -> bool:
        rep = self.reps.get(b)
        return rep is not None and self.leases.can_write(b, rep.assignment.epoch, self.local())

    def serve(self, b: int, what: str) -> None:
        """Records an act as primary under the lease (invariant 1)."""
        rep = self.reps[b]
        deadline = self.leases.deadline(b)
        assert deadline is not None
        self.sim.served(self.sid, b, rep.assignment.epoch, self.to_true(deadline), what)

    # -- timers ------------------------------------------------------------------------------

    def tick(self) -> None:
        self.expire_rpcs()
        now = self.local()
        if not self.registered:
            if not self.registering and (self.reregister_at is None or now >= self.reregister_at):
                self.register()
            return
        if not self.hb_inflight and now >= self.hb_next:
            self.heartbeat()
        if now >= self.next_ping:
            self.next_ping = now + PING
            self.ping_loop()
        if now >= self.next_flush:
            self.next_flush = now + FLUSH
            self.flush()
        for b in [b for b in self.rounds if self.roles.get(b) != "primary"]:
            self.rounds.pop(b).alive = False
        for b in list(self.roles):
            role = self.roles.get(b)
            if role == "primary":
                self.drive(b)
            elif role == "joining":
                self.drive_join(b)

    def flush(self) -> None:
        """The flusher's cut: every held copy's values and position at one instant; positions of
        the others are deleted (persist.write_snapshots)."""
        cuts = {}
        for b, rep in self.reps.items():
            if self.roles.get(b) == "joining" and not rep.learning:
                continue
            cuts[b] = Cut(
                list(self.store[b]),
                rep.committed_epoch,
                rep.committed,
                rep.dedup.to_list(),
                # a copy reloaded from an older cut holds what it held then (plus later rounds)
                self.restored.get(b, self.sim.tick_n()),
                tuple(rep.held_prepared()),
            )
        self.disk.clear()
        self.disk.update(cuts)

    # -- control loop ------------------------------------------------------------------------

    def copies(self) -> dict[int, list[int]]:
        return {
            b: list(rep.held_position)
            for b, rep in self.reps.items()
            if self.roles.get(b) != "joining" or rep.learning
        }

    def register(self) -> None:
        self.registering = True
        copies = self.copies()
        self.log(f"register offering {copies}")

        def ok(reply: dict[str, Any]) -> None:
            self.registering = False
            self.leases = HolderLeases(TERMS)
            for b, rep in self.reps.items():
                self.fail_waiters(rep.on_assignment(Assignment(rep.assignment.epoch, None)))
                if self.roles.get(b) != "joining" or rep.learning:
                    self.roles[b] = "standby"
            self.rounds.clear()
            self.table_version = None
            self.registered = True
            self.hb_inflight = False
            self.hb_next = self.local()

        def fail(err: Any) -> None:
            self.registering = False
            self.reregister_at = self.local() + 0.5 / 4

        self.call(CTL, "register", {"copies": copies}, ok, fail)

    def heartbeat(self) -> None:
        asked_at = self.local()
        reports = {b: [rep.assignment.epoch, rep.prepared_seq] for b, rep in self.reps.items()}
        self.hb_inflight = True
        incarnation = self.registered

        def ok(reply: dict[str, Any]) -> None:
            self.hb_inflight = False
            self.hb_next = self.local() + HEARTBEAT
            if not incarnation or not self.registered:
                return
            self.unavailable = frozenset(reply["unavailable"])
            if "roles" in reply:
                self.apply_roles(reply["roles"], reply["version"])
            for b, epoch in reply["renewed"]:
                self.leases.on_granted(b, epoch, asked_at)

        def fail(err: Any) -> None:
            self.hb_inflight = False
            code = err.get("code") if isinstance(err, dict) else err
            # declared dead (conflict / not_found), or the controllers unreachable: the control
            # loop registers again (a new incarnation)
            self.log(f"heartbeat failed ({code}): registering again")
            self.registered = False
            self.reregister_at = self.local() + (
                0.0 if code in ("conflict", "not_found") else 0.125
            )

        self.call(CTL, "heartbeat", {"known": self.table_version, "reports": reports}, ok, fail)

    def apply_roles(self, roles: list[dict[str, Any]], version: int) -> None:
        seen = set()
        for r in roles:
            b = r["bucket"]
            seen.add(b)
            a = Assignment(r["epoch"], r["primary"], tuple(r["secondaries"]), tuple(r["joining"]))
            role = r["role"]
            rep = self.reps.get(b)
            if rep is None:
                rep = self.reps[b] = Replica(self.sid, b, log_limit=LOG_LIMIT)
                self.store[b] = []
                self.restored.pop(b, None)
            was = self.roles.get(b)
            if role == "standby":
                self.roles[b] = "standby"
                self.leases.drop(b)
                continue
            if role == "joining":
                if rep.is_primary and 2 not in UNFIXED:
                    # Bug 2 (test_deposed_primary_that_rejoins_keeps_its_round_in_flight): the
                    # shell sets the assignment of a copy that becomes `joining` directly, so a
                    # primary handed off keeps its round in flight and its waiters; promoted
                    # later, it replays that stale round. Workaround: leave the role first.
                    self.fail_waiters(rep.on_assignment(Assignment(rep.assignment.epoch, None)))
                if a.epoch >= rep.assignment.epoch:
                    if (a.epoch, a.primary) != (rep.assignment.epoch, rep.assignment.primary):
                        if rep.learning:
                            self.log(f"b{b}: joining {a}: transfer again")
                        rep.learning = False
                    rep.assignment = a
                self.roles[b] = "joining"
                self.joins.setdefault(b, [0.0, None])
                continue
            if was == "joining":
                self.joins.pop(b, None)
            self.fail_waiters(rep.on_assignment(a))
            self.roles[b] = role
            if role == "primary":
                if was != "primary":
                    self.log(f"b{b}: primary at epoch {a.epoch} {a}")
            else:
                self.leases.drop(b)
                self.last_heard.setdefault(b, self.local())
        for b in [b for b in self.reps if b not in seen]:
            self.forget(b)
        self.table_version = version

    def forget(self, b: int) -> None:
        self.log(f"b{b}: copy dropped (no role)")
        rep = self.reps.pop(b)
        self.roles.pop(b, None)
        self.store.pop(b, None)
        self.restored.pop(b, None)
        self.leases.drop(b)
        self.last_heard.pop(b, None)
        self.joins.pop(b, None)
        self.fail_waiters(rep.on_assignment(Assignment(rep.assignment.epoch + 1, None)))

    def fail_waiters(self, waiters: list[Any]) -> None:
        for w in waiters:
            if not w.done:
                w.done = True
                self.sim.net.send(
                    self.sid, w.client, "push_reply", {"rid": w.rid, "outcome": "unknown"}
                )

    def release(self, waiters: list[Any]) -> None:
        for w in waiters:
            if w.done:
                continue
            w.done = True
            rep = self.reps.get(w.b)
            if rep is not None and self.can_write(w.b):
                self.serve(w.b, f"ack u{w.uid}")
            else:
                # Replicator._release answers a round's pushes whenever its members confirmed,
                # also after the lease ran out, even after the next epoch was granted: two
                # copies then acknowledge in overlapping time (harmless for the data: the batch
                # is on the new primary too). Fix: past the lease, the outcome is unknown.
                lease = self.sim.ctl.model.buckets[w.b]["lease"]
                epoch = rep.assignment.epoch if rep is not None else -1
                if lease is not None and (lease.holder, lease.epoch) != (self.sid, epoch):
                    self.sim.stats["acks_after_next_grant"] += 1
                    if 5 in UNFIXED:
                        raise Violation(
                            f"{self.sid} acknowledges u{w.uid} of b{w.b} (epoch {epoch}) after "
                            f"epoch {lease.epoch} was granted to {lease.holder}"
                        )
                if 5 not in UNFIXED:
                    self.sim.net.send(
                        self.sid, w.client, "push_reply", {"rid": w.rid, "outcome": "unknown"}
                    )
                    continue
            # the promotable holders: primary and members (a learner's copy is no member's)
            holders = (self.sid, *rep.assignment.secondaries) if rep is not None else (self.sid,)
            self.sim.acked(w.b, w.uid, self.sid, holders)
            self.sim.net.send(self.sid, w.client, "push_reply", {"rid": w.rid, "outcome": "ack"})

    # -- primary: rounds (Replicator._rounds / _prepare_all / _commit_all) -------------------------

    def drive(self, b: int) -> None:
        rep = self.reps[b]
        rs = self.rounds.get(b)
        if rs is None or rs.rep is not rep:
            if rs is not None:
                rs.alive = False
            rs = self.rounds[b] = Rounds(rep)
        if rs.drop is not None or rs.drop_queue:
            self.drive_drop(b, rs)
            if rs.drop is not None or rs.drop_queue:
                return
        if rep.needs_recovery:
            rep.recover()
        if rep.inflight is None:
            rs.prep_epoch = None
            if not self.can_write(b):
                rs.commits.clear()  # the task returns; its commit task is cancelled
                return
            if len(rs.commits) <= 1:
                batch = rep.next_round()
                if batch is not None:
                    self.serve(b, f"round {batch.seq}")
                elif rs.commits:
                    self.drive_commits(b, rs)
                    return
                else:
                    for m in rep.lagging():
                        if m not in rs.syncing:
                            rs.syncing.add(m)
                            self.sync_member(b, rs, m, None, lambda ok, m=m: rs.syncing.discard(m))
                    if not rs.syncing:
                        self.report_learners(b, rep)
                    return
        if rep.inflight is not None:
            self.drive_prepare(b, rs)
        self.drive_commits(b, rs)

    def drive_prepare(self, b: int, rs: Rounds) -> None:
        rep = rs.rep
        if rs.prep_epoch != rep.assignment.epoch:
            rs.prep_epoch = rep.assignment.epoch
            rs.prep_started = self.local()
            rs.prep_failed = set()
        assert rep.inflight is not None
        seq = rep.inflight[0].seq
        if rep.round_prepared():
            if len(rs.commits) >= 2:
                return  # awaits the previous commit task
            rep_apply = rep.commit_round()
            self.apply(b, rep_apply.batches)
            if self.sim.ack == "prepared":
                self.release(rep.release_decided())  # the decision point (the default)
            rs.commits.append(CommitPhase(seq, rep.assignment.epoch))
            rs.prep_epoch = None
            return
        for m in rep.replicas:
            if rep.acked_prepare.get(m, -1) < seq and m not in rs.prep_out:
                rs.prep_out.add(m)
                self.prepare_one(b, rs, m, 3)
        if rs.prep_failed and self.local() - rs.prep_started > MEMBER_TIMEOUT:
            rs.drop_queue += sorted(rs.prep_failed)
            rs.prep_failed = set()
            rs.prep_started = self.local()

    def prepare_one(self, b: int, rs: Rounds, m: str, tries: int) -> None:
        rep = rs.rep

        def done(ok: bool) -> None:
            rs.prep_out.discard(m)
            if ok:
                rs.prep_failed.discard(m)
            else:
                rs.prep_failed.add(m)

        if rep.inflight is None or tries == 0:
            done(False)
            return
        entries = rep.prepare_for(m)
        if entries is None:
            done(False)
            return

        def reply(r: dict[str, Any]) -> None:
            if not rs.alive:
                return
            if r["status"] == "gap":
                rep.on_member_position(m, r["seq"])
                self.prepare_one(b, rs, m, tries - 1)
                return
            rep.on_prepare_ack(m, r["seq"])
            if "committed" in r:  # it applied what this PREPARE said was decided
                self.release(rep.on_commit_ack(m, r["committed"]))
            done(True)

        def fail(err: Any) -> None:
            if not rs.alive:
                return
            if isinstance(err, dict) and err.get("code") == "stale_epoch":
                self.request_heartbeat()
            done(False)

        self.call(
            m,
            "prepare",
            # `commit`: the primary's committed seq rides along (Replicator._prepare_one)
            {
                "bucket": b,
                "epoch": rep.assignment.epoch,
                "entries": entries,
                "commit": rep.committed,
            },
            reply,
            fail,
        )

    def drive_commits(self, b: int, rs: Rounds) -> None:
        rep = rs.rep
        while rs.commits:
            ph = rs.commits[0]
            if ph.started < 0:
                ph.started = self.local()
                if self.sim.ack == "prepared" and self.sim.rng.random() < 0.5:
                    # Replicator._commit_all waits COMMIT_DELAY first: the next PREPARE may
                    # carry the commit (here: a step, in half of the rounds)
                    return
            waiting = [m for m in rep.replicas if rep.acked_commit.get(m, -1) < ph.seq]
            if not waiting or rep.assignment.epoch != ph.epoch or self.roles.get(b) != "primary":
                rs.commits.popleft()
                self.release(rep.release_acknowledged())
                self.report_learners(b, rep)
                continue
            for m in waiting:
                if m not in ph.out:
                    ph.out.add(m)
                    self.commit_one(b, rs, ph, m)
            if ph.failed and self.local() - ph.started > MEMBER_TIMEOUT:
                rs.drop_queue += sorted(ph.failed)
                ph.failed = set()
                ph.started = self.local()
            return

    def commit_one(self, b: int, rs: Rounds, ph: CommitPhase, m: str) -> None:
        rep = rs.rep

        def done(ok: bool) -> None:
            ph.out.discard(m)
            if ok:
                ph.failed.discard(m)
            else:
                ph.failed.add(m)

        def reply(r: dict[str, Any]) -> None:
            if not rs.alive:
                return
            if r["status"] == "gap":
                rep.on_member_position(m, r["seq"])
                self.sync_member(b, rs, m, ph.seq, done)
                return
            self.release(rep.on_commit_ack(m, r["seq"]))
            done(True)

        def fail(err: Any) -> None:
            if not rs.alive:
                return
            if isinstance(err, dict) and err.get("code") == "stale_epoch":
                self.request_heartbeat()
            done(False)

        self.call(
            m, "commit", {"bucket": b, "epoch": rep.assignment.epoch, "seq": ph.seq}, reply, fail
        )

    def sync_member(
        self,
        b: int,
        rs: Rounds,
        m: str,
        upto: int | None,
        done: Callable[[bool], None],
        tries: int = 3,
    ) -> None:
        """_sync_member: COMMIT up to `upto`; on a gap, PREPARE the log after its position."""
        rep = rs.rep
        if tries == 0 or not rs.alive:
            done(False)
            return
        seq = rep.committed if upto is None else min(upto, rep.committed)

        def reply(r: dict[str, Any]) -> None:
            if not rs.alive:
                return
            if r["status"] == "ok":
                self.release(rep.on_commit_ack(m, r["seq"]))
                done(True)
                return
            rep.on_member_position(m, r["seq"])
            entries = rep.log_after(r["seq"])
            if entries is None:
                done(False)
                return
            self.call(
                m,
                "prepare",
                {"bucket": b, "epoch": rep.assignment.epoch, "entries": entries},
                lambda _r: self.sync_member(b, rs, m, upto, done, tries - 1),
                lambda _e: done(False),
            )

        self.call(
            m,
            "commit",
            {"bucket": b, "epoch": rep.assignment.epoch, "seq": seq},
            reply,
            lambda _e: done(False),
        )

    def drive_drop(self, b: int, rs: Rounds) -> None:
        """_unresponsive for the queued members, one at a time (the round task awaits it)."""
        rep = rs.rep
        if rs.drop is not None:
            member, epoch, phase, deadline = rs.drop
            if phase == "rpc":
                return
            if (
                member in rep.assignment.secondaries
                and rep.assignment.epoch == epoch
                and self.local() < deadline
            ):
                self.request_heartbeat()
                return
            rs.drop = None
            if member in rep.learners:
                rep.drop_learner(member)
        while rs.drop is None and rs.drop_queue:
            m = rs.drop_queue.pop(0)
            state = rep.learners.get(m)
            if state == "syncing":
                self.log(f"b{b}: learner {m} unresponsive; forgotten")
                rep.drop_learner(m)
                continue
            if state == "reporting":
                continue
            epoch = rep.assignment.epoch
            self.log(f"b{b}: drop-secondary {m} (epoch {epoch})")
            rs.drop = [m, epoch, "rpc", 0.0]

            def ok(_r: dict[str, Any], rs: Rounds = rs) -> None:
                if rs.drop is not None:
                    rs.drop[2] = "wait"
                    rs.drop[3] = self.local() + MEMBER_TIMEOUT
                self.request_heartbeat()

            def fail(_e: Any, rs: Rounds = rs) -> None:
                rs.drop = None
                self.request_heartbeat()

            self.call(
                CTL,
                "drop_secondary",
                {"bucket": b, "primary": self.sid, "epoch": epoch, "server": m},
                ok,
                fail,
            )

    def report_learners(self, b: int, rep: BucketReplica) -> None:
        for m in rep.learners_caught_up():
            rep.report_sent(m)
            self.report_caught_up(b, rep, m, rep.assignment.epoch, self.joined_at.get((b, m), 0))

    def report_caught_up(
        self, b: int, rep: BucketReplica, m: str, epoch: int, joined_at: int
    ) -> None:
        """Replicator._report_caught_up."""
        self.log(f"b{b}: report {m} caught up at {rep.committed} (epoch {epoch})")

        def current() -> bool:
            # the answer settles the learner only if the record did not move on and the copy
            # did not join again meanwhile (that join's own report decides)
            return rep.assignment.epoch == epoch and self.joined_at.get((b, m), 0) == joined_at

        def ok(_r: dict[str, Any]) -> None:
            if current():
                rep.report_done(m, True)
            self.request_heartbeat()

        def fail(err: Any) -> None:
            if err == "timeout" and 3 not in UNFIXED and self.up and self.reps.get(b) is rep:
                # Bug 3 (test_caught_up_report_with_unknown_outcome_forgets_a_member): an
                # unknown outcome is no refusal. Fix: ask again until the controller answers
                # (caught_up is idempotent, see Controller.handle).
                self.report_caught_up(b, rep, m, epoch, joined_at)
                return
            if current():
                rep.report_done(m, False)
            self.request_heartbeat()

        body = {"bucket": b, "primary": self.sid, "epoch": epoch, "server": m}
        if 4 not in UNFIXED:
            body["joined_at"] = joined_at
        self.call(CTL, "caught_up", body, ok, fail)

    def apply(self, b: int, batches: tuple[Batch, ...]) -> None:
        st = self.store[b]
        for batch in batches:
            st.extend(batch.updates)

    # -- pings, watchdog, join ---------------------------------------------------------------

    def ping_loop(self) -> None:
        by_member: dict[str, dict[int, int]] = {}
        for b, role in self.roles.items():
            if role != "primary":
                continue
            rep = self.reps[b]
            for m in rep.replicas:
                by_member.setdefault(m, {})[b] = rep.assignment.epoch
        for m, buckets in by_member.items():

            def ok(r: dict[str, Any]) -> None:
                if r["stale"]:
                    self.request_heartbeat()

            self.call(m, "ping", {"buckets": buckets}, ok, lambda _e: None)
        self.watchdog()

    def watchdog(self) -> None:
        now = self.local()
        for b, role in list(self.roles.items()):
            if role != "secondary":
                continue
            heard = self.last_heard.get(b, now)
            if now - heard > FAILOVER_AFTER and now >= self.role_change_after.get(b, 0):
                self.role_change_after[b] = now + FAILOVER_AFTER
                rep = self.reps[b]
                self.log(f"b{b}: primary {rep.assignment.primary} silent: role change")

                def fail(err: Any, b: int = b) -> None:
                    if isinstance(err, dict) and err.get("retry_after"):
                        self.role_change_after[b] = self.local() + err["retry_after"]
                    self.request_heartbeat()

                self.call(
                    CTL,
                    "role_change",
                    {
                        "bucket": b,
                        "server": self.sid,
                        "prev_epoch": rep.assignment.epoch,
                        "reports": {self.sid: [rep.assignment.epoch, rep.prepared_seq]},
                    },
                    lambda _r: self.request_heartbeat(),
                    fail,
                )

    def drive_join(self, b: int) -> None:
        """Replicator._join."""
        js = self.joins.setdefault(b, [0.0, None])
        rep = self.reps[b]
        now = self.local()
        if rep.learning:
            if now - self.last_heard.get(b, 0.0) > FAILOVER_AFTER:
                self.log(f"b{b}: primary silent while joining; again")
                rep.learning = False
            return
        if js[1] is not None or now < js[0]:
            return
        primary, epoch = rep.assignment.primary, rep.assignment.epoch
        if primary is None:
            js[0] = now + 0.3 / 4
            self.request_heartbeat()
            return

        def ok(snap: dict[str, Any]) -> None:
            js[1] = None
            if (
                self.joins.get(b) is not js
                or self.reps.get(b) is not rep
                or self.roles.get(b) != "joining"
                or (rep.assignment.epoch, rep.assignment.primary) != (epoch, primary)
                or snap["epoch"] != epoch
            ):
                js[0] = self.local() + 0.3 / 4
                self.request_heartbeat()
                return
            self.store[b] = list(snap["values"])
            rep.install_snapshot(snap["committed"], snap["dedup"], snap["committed_epoch"])
            self.restored.pop(b, None)
            self.last_heard[b] = self.local()
            self.log(f"b{b}: snapshot at {snap['committed']} from {primary} installed")
            self.sim.stats["snapshots"] += 1

        def fail(_e: Any) -> None:
            js[1] = None
            js[0] = self.local() + 0.3 / 4
            self.request_heartbeat()

        js[1] = self.call(primary, "snapshot", {"bucket": b, "joiner": self.sid}, ok, fail)

    # -- requests from peers and clients -------------------------------------------------------

    def handle(self, msg: Msg) -> None:
        body = msg.body
        if msg.kind == "reply":
            self.on_reply(body)
            return
        if msg.kind == "push":
            self.on_push(msg)
            return
        handler = getattr(self, f"op_{msg.kind}")
        try:
            result = handler(msg.src, body)
            reply = {"rid": body["rid"], **result}
        except ProtoError as exc:
            reply = {"rid": body["rid"], "error": {"code": exc.code, **exc.extra}}
        self.sim.net.send(self.sid, msg.src, "reply", reply)

    def _known(self, b: int) -> BucketReplica:
        rep = self.reps.get(b)
        if rep is None:
            self.request_heartbeat()
            raise ProtoError("unavailable")
        return rep

    def _reject(self, rej: Reject) -> ProtoError:
        if rej.code == "unavailable":
            self.request_heartbeat()
        return ProtoError(rej.code)

    def op_prepare(self, sender: str, body: dict[str, Any]) -> dict[str, Any]:
        b = body["bucket"]
        rep = self._known(b)
        res = rep.on_prepare(sender, body["epoch"], body["entries"])
        if isinstance(res, Reject):
            raise self._reject(res)
        self.last_heard[b] = self.local()
        reply = {"status": res[0], "seq": res[1]}
        upto = min(body.get("commit", 0), rep.prepared_seq)
        if res[0] == "ok" and upto > rep.committed:  # Follower.op_repl_prepare
            done = rep.on_commit(sender, body["epoch"], upto)
            assert not isinstance(done, (Reject, tuple)), done
            self.apply(b, done.batches)
            reply["committed"] = rep.committed
        return reply

    def op_commit(self, sender: str, body: dict[str, Any]) -> dict[str, Any]:
        b = body["bucket"]
        rep = self._known(b)
        res = rep.on_commit(sender, body["epoch"], body["seq"])
        if isinstance(res, Reject):
            raise self._reject(res)
        self.last_heard[b] = self.local()
        if isinstance(res, tuple):
            return {"status": res[0], "seq": res[1]}
        self.apply(b, res.batches)
        return {"status": "ok", "seq": rep.committed}

    def op_ping(self, sender: str, body: dict[str, Any]) -> dict[str, Any]:
        stale = []
        for b, epoch in body["buckets"].items():
            rep = self.reps.get(b)
            if rep is None:
                continue
            if rep.assignment.epoch == epoch and rep.assignment.primary == sender:
                self.last_heard[b] = self.local()
            elif epoch < rep.assignment.epoch:
                stale.append(b)
            else:
                self.request_heartbeat()
        return {"stale": stale}

    def check_primary(self, b: int) -> BucketReplica:
        rep = self.reps.get(b)
        if b in self.unavailable:
            self.request_heartbeat()
            raise ProtoError("bucket_unavailable")
        if rep is None or self.roles.get(b) != "primary":
            raise ProtoError("not_primary")
        if not self.can_write(b):
            self.request_heartbeat()
            raise ProtoError("not_primary")
        return rep

    def op_snapshot(self, sender: str, body: dict[str, Any]) -> dict[str, Any]:
        b = body["bucket"]
        rep = self.check_primary(b)
        rej = rep.add_learner(body["joiner"])
        if rej is not None:
            raise self._reject(rej)
        self.serve(b, f"snapshot to {body['joiner']}")
        self.joined_at[(b, body["joiner"])] = self.sim.tick_n()
        self.log(f"b{b}: snapshot at {rep.committed} for {body['joiner']}")
        return {
            "epoch": rep.assignment.epoch,
            **rep.snapshot_meta(),
            "values": list(self.store[b]),
        }

    def on_push(self, msg: Msg) -> None:
        body = msg.body
        b, key, uid = body["bucket"], tuple(body["key"]), body["uid"]
        w = Waiter(self, msg.src, key, uid, b)
        w.rid = body["rid"]
        try:
            rep = self.check_primary(b)
            verdict = rep.submit(uid, key, w)
        except ProtoError as exc:
            verdict = Reject(exc.code, "")
        if isinstance(verdict, Reject):
            w.done = True
            self.sim.net.send(self.sid, msg.src, "push_reply", {"rid": w.rid, "outcome": "failed"})
            return
        self.serve(b, f"push {key}")
        if verdict == "duplicate-committed":
            self.release([w])


class ProtoError(Exception):
    def __init__(self, code: str, **extra: Any) -> None:
        super().__init__(code)
        self.code = code
        self.extra = extra


# -- the controller (leader): the real ClusterModel and the service's soft state ----------------


class Controller:
    def __init__(self, sim: Sim) -> None:
        self.sim = sim
        self.model = ClusterModel(N_BUCKETS, TERMS, replication=3, min_servers=3)
        self.last_seen: dict[str, float] = {}
        self.reports: dict[int, dict[str, list[int]]] = {}
        self.next_step = 0.0
        #: (bucket, server, incarnation) -> event count when it entered `joining` (bug 4's fix)
        self.join_since: dict[tuple[int, str, int], int] = {}
        self._joining: set[tuple[int, str, int]] = set()

    def track(self) -> None:
        """Notes when copies enter `joining` (call after every change of the model)."""
        servers = self.model.servers
        now = {
            (b, s, servers[s]["incarnation"])
            for b, bk in enumerate(self.model.buckets)
            for s in bk["joining"]
        }
        for key in now - self._joining:
            self.join_since[key] = self.sim.tick_n()
        self._joining = now

    def leader_change(self) -> None:
        self.last_seen = {}
        self.reports = {}

    def _reports(self) -> dict[int, dict[str, list[int]]]:
        return {b: dict(r) for b, r in self.reports.items()}

    def step(self) -> None:
        now = self.sim.now
        if now < self.next_step:
            return
        self.next_step = now + RECONCILE
        m = self.model
        for sid, rec in list(m.servers.items()):
            if rec["state"] == DEAD:
                self.last_seen.pop(sid, None)
                continue
            seen = self.last_seen.setdefault(sid, now)
            if now - seen > SERVER_TIMEOUT:
                self.sim.log(f"ctl: declare_dead {sid}")
                m.declare_dead(sid, now, self._reports())
                self.last_seen.pop(sid, None)
        if m.grants_due(now):
            self.sim.log("ctl: reconcile")
            m.reconcile(now, self._reports())
        self.track()

    def handle(self, msg: Msg) -> None:
        body = msg.body
        sid = body["from"]
        m = self.model
        now = self.sim.now
        kind = msg.kind
        res: dict[str, Any]
        if kind == "register":
            res = m.register(sid, sid, now, body["copies"])
            self.last_seen[sid] = now
        elif kind == "heartbeat":
            rec = m.servers.get(sid)
            if rec is None:
                res = {"ok": False, "error": "not_found"}
            elif rec["state"] == DEAD:
                res = {"ok": False, "error": "conflict"}
            else:
                self.last_seen[sid] = now
                for b, r in body["reports"].items():
                    self.reports.setdefault(b, {})[sid] = list(r)
                holds = any(m.primary_of(b) == sid and m.holder_live(b) for b in range(m.n_buckets))
                renewed = m.renew(sid, now)["renewed"] if holds else []
                res = {
                    "ok": True,
                    "renewed": renewed,
                    "unavailable": [b for b in range(m.n_buckets) if m.unavailable(b)],
                    "version": m.version,
                }
                if body["known"] != m.version:
                    res["roles"] = m.roles_of(sid)
        elif kind == "role_change":
            b = body["bucket"]
            clean = {s: list(r) for s, r in body["reports"].items()}
            for s, r in self.reports.get(b, {}).items():
                clean.setdefault(s, r)
            res = m.role_change(b, body["server"], body["prev_epoch"], clean, now)
        elif kind == "caught_up":
            b, sid_j = body["bucket"], body["server"]
            bk = m.buckets[b]
            lease = bk["lease"]
            inc = m.servers.get(sid_j, {}).get("incarnation", 0)
            if "joined_at" in body and body["joined_at"] < self.join_since.get((b, sid_j, inc), 0):
                # Bug 4 (test_stale_caught_up_report_makes_a_fresh_copy_a_member). Fix: the report
                # names the join it is about (here: when the snapshot was taken); a report of an
                # earlier join of the same copy is refused.
                res = {"ok": False, "error": "conflict"}
            elif (
                3 not in UNFIXED
                and sid_j in bk["holders"]
                and lease is not None
                and (lease.holder, lease.epoch) == (body["primary"], body["epoch"])
            ):
                res = {"ok": True}  # bug 3's fix: a repeated report of this join is accepted
            else:
                res = m.verified_caught_up(b, body["primary"], body["epoch"], sid_j, now)
        elif kind == "drop_secondary":
            res = m.drop_secondary(
                body["bucket"], body["primary"], body["epoch"], body["server"], now
            )
        elif kind == "release":
            res = m.release(body["bucket"], body["server"], body["epoch"], now)
        else:  # pragma: no cover
            raise AssertionError(kind)
        if kind not in ("heartbeat",) or not res.get("ok"):
            self.sim.log(
                f"ctl: {kind} { ({k: v for k, v in body.items() if k not in ('rid', 'from', 'reports')}) } from {sid} -> {_short(res)}"
            )
        if res.get("ok"):
            reply = {"rid": body["rid"], **res}
        else:
            reply = {
                "rid": body["rid"],
                "error": {
                    "code": res["error"],
                    **{k: v for k, v in res.items() if k == "retry_after"},
                },
            }
        self.track()
        self.sim.net.send(CTL, sid, "reply", reply)


def _short(res: dict[str, Any]) -> str:
    if res.get("ok"):
        return "ok " + str({k: v for k, v in res.items() if k in ("primary", "epoch", "removed")})
    return f"error {res.get('error')}"


# -- clients -------------------------------------------------------------------------------------


@dataclass
class Push:
    key: tuple[str, int]
    uid: int
    bucket: int
    status: str = "pending"  # pending | acked | failed | unknown
    attempts: int = 0
    outstanding: int | None = None  # rid


class Client:
    def __init__(self, sim: Sim, name: str) -> None:
        self.sim, self.name = sim, name
        self.seq = 0
        self.waiting: dict[int, tuple[Push, float]] = {}

    def step(self, new_pushes: bool) -> None:
        sim = self.sim
        for rid, (p, deadline) in list(self.waiting.items()):
            if sim.now >= deadline:
                del self.waiting[rid]
                p.outstanding = None
                if p.status != "acked":
                    p.status = "unknown"
        if len(self.waiting) >= 2:
            return
        unknown = [
            p
            for p in sim.pushes.values()
            if p.status == "unknown"
            and p.key[0] == self.name
            and p.outstanding is None
            and p.attempts < 6
        ]
        if unknown and sim.rng.random() < 0.3:
            self.send(sim.rng.choice(unknown))
        elif new_pushes and sim.rng.random() < 0.6:
            self.seq += 1
            b = sim.rng.randrange(N_BUCKETS)
            p = Push((self.name, self.seq), sim.next_uid(), b)
            sim.pushes[p.key] = p
            self.send(p)

    def send(self, p: Push) -> None:
        primary = self.sim.ctl.model.primary_of(p.bucket)
        if primary is None:
            return
        rid = self.sim.rid()
        p.attempts += 1
        p.outstanding = rid
        self.waiting[rid] = (p, self.sim.now + PUSH_TIMEOUT)
        self.sim.net.send(
            self.name,
            primary,
            "push",
            {"bucket": p.bucket, "key": list(p.key), "uid": p.uid, "rid": rid},
        )

    def handle(self, msg: Msg) -> None:
        rid = msg.body["rid"]
        entry = self.waiting.pop(rid, None)
        if entry is None:
            return
        p = entry[0]
        p.outstanding = None
        outcome = msg.body["outcome"]
        if outcome == "ack":
            p.status = "acked"
        elif p.status == "pending" and outcome == "failed":
            p.status = "failed"  # definitely not applied (first and only attempt)
        elif p.status != "acked":
            p.status = "unknown"


# -- the simulation ------------------------------------------------------------------------------


class Sim:
    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.rng = random.Random(seed)
        #: storage faults (a corrupted copy), apart from `rng` (see `restart`)
        self.storage_rng = random.Random(f"storage-{seed}")
        #: when a round's pushes are acknowledged (the servers' `ack`): at the decision point,
        #: the default, in three seeds of four; once every member committed in the fourth
        self.ack = ACK or ("committed" if seed % 4 == 3 else "prepared")
        self.now = 0.0
        self._rid = itertools.count(1)
        self._uid = itertools.count(1)
        self.trace: deque[str] = deque(maxlen=int(os.environ.get("ADAMPS_SIM_TRACE", "60")))
        self.net = Network(self)
        self.ctl = Controller(self)
        self.servers: dict[str, Server] = {}
        self.disks: dict[str, dict[int, Cut]] = {}
        self.clients = {c: Client(self, c) for c in ("c0", "c1")}
        self.pushes: dict[tuple[str, int], Push] = {}
        #: bucket -> uid -> event count when a server first acknowledged it
        self.acks: dict[int, dict[int, int]] = {b: {} for b in range(N_BUCKETS)}
        #: bucket -> uid -> the servers (process objects) that held it when it was acknowledged
        self.ack_holders: dict[int, dict[int, list[Server]]] = {b: {} for b in range(N_BUCKETS)}
        self._events = itertools.count(1)
        #: (bucket, server, incarnation): reloaded copies seen as secondaries (no loss window)
        self.restored_holder: set[tuple[int, str, int]] = set()
        #: bucket -> uids lost in the allowed window (a copy reloaded from its cut was promoted)
        self.allowed_loss: dict[int, set[int]] = {b: set() for b in range(N_BUCKETS)}
        #: (bucket, epoch) -> (holder, latest true deadline it acted under)
        self.acted: dict[tuple[int, int], tuple[str, float]] = {}
        #: scheduled nemesis events: (true time, n, fn)
        self.timers: list[tuple[float, int, Callable[[], None]]] = []
        self.faults = 0
        self.stats: Counter[str] = Counter()
        self._lease_key: tuple[Any, ...] = ()
        self.n_servers = 0
        inten = self.rng.random()
        self.p_fault = 0.01 + 0.03 * inten
        self.net.drop = self.rng.choice([0.0, 0.02, 0.05, 0.1])
        self.net.dup = self.rng.choice([0.0, 0.02, 0.05])
        self.net.slow = self.rng.choice([0.0, 0.02, 0.05])
        for _ in range(self.rng.choice([4, 5])):
            self.add_server()

    # -- plumbing -----------------------------------------------------------------------------

    def rid(self) -> int:
        return next(self._rid)

    def tick_n(self) -> int:
        """An event count: orders acknowledgements and disk cuts within one step."""
        return next(self._events)

    def next_uid(self) -> int:
        return next(self._uid)

    def log(self, text: str) -> None:
        self.trace.append(f"{self.now:7.3f} {text}")

    def at(self, delay: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self.timers, (self.now + delay, self.rid(), fn))

    def add_server(self) -> None:
        sid = f"s{self.n_servers}"
        self.n_servers += 1
        self.disks[sid] = {}
        self.servers[sid] = Server(self, sid, self.disks[sid])
        self.log(f"nemesis: add {sid}")

    def acked(self, b: int, uid: int, sid: str, holders: tuple[str, ...]) -> None:
        if uid not in self.acks[b]:
            self.acks[b][uid] = self.tick_n()
            self.ack_holders[b][uid] = [self.servers[h] for h in holders if h in self.servers]
            self.log(f"{sid}: ack b{b} u{uid}")

    def served(self, sid: str, b: int, epoch: int, deadline: float, what: str) -> None:
        """Invariant 1 at the moment a server acts as primary of `b` under `epoch`."""
        lease = self.ctl.model.buckets[b]["lease"]
        records = [r for r in self.ctl.model.lease_records() if r["bucket"] == b]
        mine = [r for r in records if r["epoch"] == epoch]
        if not mine or mine[0]["holder"] != sid:
            raise Violation(
                f"{sid} acts as primary of b{b} at epoch {epoch} ({what}) not granted to it: {mine}"
            )
        if lease is not None and lease.epoch > epoch:
            raise Violation(
                f"{sid} acts as primary of b{b} under epoch {epoch} ({what}) after epoch "
                f"{lease.epoch} was granted to {lease.holder} at {lease.granted_at:.3f}"
            )
        if deadline <= self.now:
            raise Violation(f"{sid} acts on b{b} past its own lease deadline")
        prev = self.acted.get((b, epoch))
        self.acted[(b, epoch)] = (sid, max(deadline, prev[1] if prev else deadline))

    # -- nemesis ------------------------------------------------------------------------------

    def nemesis(self) -> None:
        rng = self.rng
        if rng.random() >= self.p_fault:
            return
        self.faults += 1
        up = [s for s in self.servers.values() if s.up]
        kind = rng.choice(
            [
                "crash",
                "crash",
                "pause",
                "pause",
                "isolate",
                "cut_ctl",
                "cut_peers",
                "drain",
                "add",
                "rebalance",
                "leader",
                "crash_all",
                "pause_all",
            ]
        )
        self.stats[kind] += 1
        if kind in ("crash", "pause", "isolate", "cut_ctl", "cut_peers") and not up:
            return
        if kind == "crash_all":
            # a whole-cluster crash: what was acknowledged after a copy's last flush may be lost
            self.log("nemesis: crash every server")
            for s in up:
                s.crashed = True
                self.at(rng.uniform(0.2, 2.0), lambda s=s: self.restart(s.sid, False))
        elif kind == "pause_all":
            d = rng.uniform(0.5, 3.0)
            self.log(f"nemesis: pause every server for about {d:.2f}s")
            for s in up:
                s.paused_until = self.now + d * rng.uniform(0.8, 1.2)
        elif kind == "crash":
            s = rng.choice(up)
            s.crashed = True
            wipe = rng.random() < 0.1
            self.log(f"nemesis: crash {s.sid}{' (disk lost)' if wipe else ''}")
            self.at(rng.uniform(0.2, 3.0), lambda s=s, wipe=wipe: self.restart(s.sid, wipe))
        elif kind == "pause":
            s = rng.choice(up)
            d = rng.uniform(0.2, 3.0)
            s.paused_until = self.now + d
            self.log(f"nemesis: pause {s.sid} for {d:.2f}s")
        elif kind in ("isolate", "cut_ctl", "cut_peers"):
            s = rng.choice(up)
            others = [o for o in self.servers if o != s.sid]
            peers = [*others, *self.clients] if kind == "isolate" else others
            links = {frozenset((s.sid, o)) for o in peers if kind != "cut_ctl"}
            if kind != "cut_peers":
                links.add(frozenset((s.sid, CTL)))
            links -= self.net.cut
            self.net.cut |= links
            d = rng.uniform(0.2, 3.0)
            self.log(f"nemesis: {kind} {s.sid} for {d:.2f}s")
            self.at(d, lambda links=links: self.heal(links))
        elif kind == "drain":
            live = [s for s, r in self.ctl.model.servers.items() if r["state"] == LIVE]
            if len(live) > 3:
                s = rng.choice(live)
                self.log(f"nemesis: drain {s}")
                self.ctl.model.drain(s, self.now)
                self.ctl.track()
        elif kind == "add":
            if self.n_servers < 7:
                self.add_server()
        elif kind == "rebalance":
            self.log("nemesis: rebalance")
            self.ctl.model.rebalance(self.now)
            self.ctl.track()
        elif kind == "leader":
            self.log("nemesis: controller leader change (soft state lost)")
            self.ctl.leader_change()

    def heal(self, links: set[frozenset[str]]) -> None:
        self.net.cut -= links
        self.log("nemesis: heal " + " ".join("-".join(sorted(x)) for x in links))

    def restart(self, sid: str, wipe: bool) -> None:
        old = self.servers[sid]
        if not old.crashed:
            return
        # A storage fault (issue 29), drawn from an RNG of its own so that the other faults of
        # a seed stay as they were: one copy's cut on the disk fails verification.
        corrupt: frozenset[int] = frozenset()
        disk = self.disks[sid]
        if not wipe and disk and self.storage_rng.random() < CORRUPT_P:
            corrupt = frozenset({self.storage_rng.choice(sorted(disk))})
            self.stats["corrupt_copies"] += 1
            self.log(f"nemesis: {sid}'s cut of b{min(corrupt)} fails its checksum: not offered")
        self.servers[sid] = Server(self, sid, disk, wiped=wipe, corrupt=corrupt)
        cuts = {b: (c.epoch, c.seq) for b, c in self.disks[sid].items()}
        self.log(f"nemesis: restart {sid} from disk {cuts}")

    # -- the loop -----------------------------------------------------------------------------

    def step(self, faults: bool = True, new_pushes: bool = True) -> None:
        self.now = round(self.now + DT, 9)
        while self.timers and self.timers[0][0] <= self.now:
            heapq.heappop(self.timers)[2]()
        for s in self.servers.values():
            if s.paused_until is not None and self.now >= s.paused_until:
                s.paused_until = None
                self.log(f"nemesis: resume {s.sid}")
        if faults:
            self.nemesis()
        work: list[Any] = list(self.net.due())
        deferred = []
        work += [("tick", s) for s in self.servers.values()]
        work += [("ctl", None)]
        work += [("client", c) for c in self.clients.values()]
        self.rng.shuffle(work)
        for item in work:
            if isinstance(item, Msg):
                if self.net.blocked(item.src, item.dst):
                    continue
                if item.dst == CTL:
                    self.ctl.handle(item)
                elif item.dst in self.clients:
                    self.clients[item.dst].handle(item)
                else:
                    s = self.servers[item.dst]
                    if s.crashed:
                        continue
                    if s.paused_until is not None:
                        deferred.append(item)
                        continue
                    s.handle(item)
            elif item[0] == "tick":
                if item[1].up and self.servers.get(item[1].sid) is item[1]:
                    item[1].tick()
            elif item[0] == "ctl":
                self.ctl.step()
            else:
                item[1].step(new_pushes)
        for m in deferred:
            m.at = self.now + DT
            heapq.heappush(self.net.queue, m)
        self.check()

    # -- invariants ---------------------------------------------------------------------------

    def holds(self, s: Server, b: int) -> set[int]:
        rep = s.reps[b]
        held = set(s.store.get(b, ()))
        top = rep.prepared_seq
        for seq, batch in rep.prepared.items():
            if seq <= top:
                held.update(batch.updates)
        return held

    def lost_with_a_crash(self, b: int, missing: set[int]) -> set[int]:
        """Of the pushes a promotable copy lacks, those the loss window allows: held by no live
        copy of the bucket at all (so no copy the controllers passed over had them), and every
        process that held one as a member when it was acknowledged (its primary and secondaries)
        crashed since, its memory lost: a holder reloaded from a later cut would hold it, so
        what is lost was acknowledged after the last flush of every member that had it, or
        only a member whose data directory was lost had it (docs/operations.md, "Durability")."""
        m = self.ctl.model
        pickable = set(m.live_members(b)) | set(m.buckets[b].get("candidates", []))
        live = [
            s for s in self.servers.values() if not s.crashed and b in s.reps and s.sid in pickable
        ]  # the copies the controllers may pick: members and candidates (no learner's)
        held = set().union(*(self.holds(s, b) for s in live)) if live else set()
        current = {id(s) for s in self.servers.values() if not s.crashed}
        return {
            u
            for u in missing - held
            if not any(id(h) in current for h in self.ack_holders[b].get(u, []))
        }

    def check(self) -> None:
        m = self.ctl.model
        # 1. lease safety of the committed record, and of what holders did under it (checked
        # again whenever a lease changed)
        key = (len(m.history), *(id(bk["lease"]) for bk in m.buckets), len(self.acted))
        if key != self._lease_key:
            self._lease_key = key
            records = m.lease_records()
            problems = check_history(records, m.terms)
            if problems:
                raise Violation(f"lease history: {problems}")
            for r in records:
                b, e = r["bucket"], r["epoch"]
                for (b2, e2), (holder, dl) in self.acted.items():
                    if b2 == b and e2 < e and r["granted_at"] < dl - 1e-9:
                        raise Violation(
                            f"b{b}: epoch {e} granted to {r['holder']} at {r['granted_at']:.3f} "
                            f"while {holder} could still act under epoch {e2} until {dl:.3f}"
                        )
        for b in range(N_BUCKETS):
            acks = self.acks[b]
            # 2. every acknowledged push on every promotable copy
            promotable = [(s, "member") for s in m.live_members(b)]
            # Of the candidates (every member of the last wave), the one the controllers would
            # promote: older copies of the wave may lack what was acknowledged after they left.
            best = m._best_candidate(b)
            promotable += [(best, "candidate")] if best is not None else []
            for sid, why in promotable:
                s = self.servers[sid]
                if s.crashed or b not in s.reps or not s.registered:
                    # memory gone (its next registration makes it leave), or a restarted
                    # process the controller does not know yet: not the copy it counts on
                    continue
                if why == "member" and s.roles.get(b) in (None, "joining"):
                    # the controller counts it a member but this incarnation did not learn it yet
                    pass
                # The loss window: a copy reloaded from its disk after a crash may lack what was
                # acknowledged after its cut while it is a candidate (every member gone), and as
                # the primary it then became; never if it entered the replica set another way.
                cut_at = s.restored.get(b)
                inc = m.servers[sid]["incarnation"]
                if cut_at is not None and why == "member" and m.primary_of(b) != sid:
                    self.restored_holder.add((b, sid, inc))
                missing = set(acks) - self.holds(s, b) - self.allowed_loss[b]
                if not missing:
                    continue
                if (b, sid, inc) in self.restored_holder:
                    excused = set()
                else:
                    excused = self.lost_with_a_crash(b, missing)
                    if cut_at is not None:
                        excused |= {u for u in missing if acks[u] > cut_at}
                if missing - excused:
                    worst = sorted(missing - excused)[:10]
                    raise Violation(
                        f"b{b}: {why} {sid} (role {s.roles.get(b)}, committed "
                        f"{s.reps[b].committed_epoch}/{s.reps[b].committed}) lacks acknowledged "
                        f"pushes {worst} (acked at events {[acks[u] for u in worst]}, cut at {cut_at})"
                    )
                if m.primary_of(b) == sid and m.holder_live(b):
                    self.stats["loss_window_pushes"] += len(excused - self.allowed_loss[b])
                    self.allowed_loss[b] |= excused
                    self.log(f"b{b}: loss window: {sorted(excused)} lost with {sid}'s cut")
            # 3. equal positions hold equal values; nothing applied twice
            seen: dict[tuple[int, int], tuple[str, list[int]]] = {}
            for s in self.servers.values():
                if s.crashed or b not in s.reps:
                    continue
                st = s.store[b]
                if len(st) != len(set(st)):
                    dup = sorted(u for u in set(st) if st.count(u) > 1)
                    raise Violation(f"b{b}: {s.sid} applied {dup} twice")
                rep = s.reps[b]
                pos = (rep.committed_epoch, rep.committed)
                other = seen.get(pos)
                if other is not None and other[1] != st:
                    raise Violation(
                        f"b{b}: {other[0]} and {s.sid} at position {pos} differ: "
                        f"{other[1][-8:]} vs {st[-8:]}"
                    )
                seen[pos] = (s.sid, st)

    # -- the end -------------------------------------------------------------------------------

    def heal_all(self) -> None:
        self.log("nemesis: stop; heal everything")
        self.net.cut.clear()
        self.net.drop = self.net.dup = self.net.slow = 0.0
        for sid, s in list(self.servers.items()):
            if s.crashed:
                self.restart(sid, False)
            if s.paused_until is not None:
                s.paused_until = self.now
        self.timers = [t for t in self.timers if False]

    def final_check(self) -> None:
        m = self.ctl.model
        st = self.stats
        st["acked"] = sum(len(a) for a in self.acks.values())
        st["unknown"] = sum(1 for p in self.pushes.values() if p.status == "unknown")
        st["failed"] = sum(1 for p in self.pushes.values() if p.status == "failed")
        st["lease_grants"] = len(m.lease_records())
        st["candidate_grants"] = sum(1 for b in range(N_BUCKETS) if self.allowed_loss[b])
        applied_anywhere: dict[int, set[int]] = {b: set() for b in range(N_BUCKETS)}
        for s in self.servers.values():
            for b, st in s.store.items():
                applied_anywhere[b] |= set(st)
        for p in self.pushes.values():
            if p.status == "failed" and p.uid in applied_anywhere[p.bucket]:
                raise Violation(f"push {p.key} failed definitely but was applied")
        for b in range(N_BUCKETS):
            if m.unavailable(b):
                self.log(f"b{b}: unavailable at the end (a candidate lost or corrupted its disk)")
                continue
            members = m.live_members(b)
            if not members:
                raise Violation(f"b{b}: no member at the end")
            client_acked = {
                p.uid for p in self.pushes.values() if p.bucket == b and p.status == "acked"
            }
            acked = (set(self.acks[b]) | client_acked) - self.allowed_loss[b]
            for sid in members:
                s = self.servers[sid]
                st = s.store.get(b)
                if st is None:
                    raise Violation(f"b{b}: member {sid} holds no copy at the end")
                missing = acked - set(st)
                if missing:
                    raise Violation(
                        f"b{b}: member {sid} lacks acknowledged {sorted(missing)[:10]} at the end"
                    )
            stores = {sid: self.servers[sid].store[b] for sid in members}
            first = next(iter(stores.values()))
            for sid, st in stores.items():
                if sorted(st) != sorted(first):
                    raise Violation(
                        f"b{b}: copies differ at the end: {sid} {st[-6:]} vs {first[-6:]}"
                    )


def run(seed: int, steps: int = STEPS) -> Sim:
    sim = Sim(seed)
    try:
        for _ in range(steps):
            sim.step()
        sim.heal_all()
        for _ in range(120):
            sim.step(faults=False, new_pushes=False)
        sim.final_check()
    except Exception as exc:
        trace = "\n".join(sim.trace)
        raise AssertionError(
            f"seed {seed} failed at t={sim.now:.3f}: {exc}\n--- last events ---\n{trace}"
        ) from exc
    return sim


SEED_LIST = [int(ONE_SEED)] if ONE_SEED else list(range(SEEDS))


def test_the_simulation_exercises_the_faults() -> None:
    """A guard against a simulation that checks nothing: over a few seeds, every fault happens,
    leases move, copies transfer state, pushes are acknowledged and some outcomes are unknown."""
    total: Counter[str] = Counter()
    for seed in range(12):
        total += run(seed).stats
    for kind in ("crash", "pause", "isolate", "cut_ctl", "cut_peers", "drain", "add", "rebalance"):
        assert total[kind] > 0, (kind, total)
    assert total["lease_grants"] > 12 * N_BUCKETS * 2, total
    assert total["snapshots"] > 20 and total["acked"] > 200 and total["unknown"] > 0, total


@pytest.mark.parametrize("seed", SEED_LIST)
def test_replication_sim(seed: int) -> None:
    run(seed)


# -- the bugs the simulation found, each as a minimal reproduction ----------------------------------


def _assignment(m: ClusterModel, b: int = 0) -> Assignment:
    v = m.bucket_view(b)
    return Assignment(v["epoch"], v["primary"], tuple(v["secondaries"]), tuple(v["joining"]))


def _round(primary: BucketReplica, members: dict[str, BucketReplica]) -> list[Any]:
    """One round delivered to every member without loss; the acknowledged waiters."""
    if primary.needs_recovery:
        primary.recover()
    assert primary.next_round() is not None
    for name in primary.replicas:
        entries = primary.prepare_for(name)
        assert entries is not None
        res = members[name].on_prepare(primary.server, primary.assignment.epoch, entries)
        assert isinstance(res, tuple) and res[0] == "ok", res
        primary.on_prepare_ack(name, res[1])
    primary.commit_round()
    done = []
    for name in primary.replicas:
        res = members[name].on_commit(primary.server, primary.assignment.epoch, primary.committed)
        assert not isinstance(res, (Reject, tuple)), res
        done += primary.on_commit_ack(name, members[name].committed)
    return done + primary.release_acknowledged()


def _joining_cluster() -> tuple[ClusterModel, dict[str, BucketReplica]]:
    """b primary with secondary a; a declared dead, c joins. Replicas as the shell sets them."""
    m = ClusterModel(1, TERMS, replication=2, min_servers=2)
    m.register("a", "a", 0.0)
    m.register("b", "b", 0.0)
    m.register("c", "c", 0.0)
    reps = {s: BucketReplica(s, 0) for s in "abc"}
    reps["a"].on_assignment(_assignment(m))
    reps["b"].on_assignment(_assignment(m))
    assert reps["b"].is_primary and reps["a"].is_secondary
    reps["b"].submit("u1", ("cl", 1), "w1")
    assert _round(reps["b"], reps) == ["w1"]
    m.renew("b", 0.5)
    m.declare_dead("a", 0.5)
    a = _assignment(m)
    assert a.joining == ("c",) and a.secondaries == ()
    reps["b"].on_assignment(a)
    reps["c"].assignment = a  # _apply_roles, role "joining"
    return m, reps


def test_learner_is_not_caught_up_before_it_installed_the_snapshot() -> None:
    """The primary reports a learner caught up as soon as it *took* the snapshot for it (add_learner
    sets acked_commit[learner] = committed): the controller then makes a copy a promotable member
    although it installed nothing yet (the snapshot reply may be lost, or slow). If the primary
    dies then, the empty copy is promoted and every acknowledged push is gone."""
    m, reps = _joining_cluster()
    b, c = reps["b"], reps["c"]
    assert b.add_learner("c") is None  # op_repl_snapshot; its reply never reaches c
    for learner in b.learners_caught_up():  # Replicator._report_learners
        b.report_sent(learner)
        assert m.verified_caught_up(0, "b", 1, learner, 0.6)["ok"]
        b.report_done(learner, True)
    # The contract: every live member of the recorded replica set holds every acknowledged push.
    assert "c" not in m.bucket_view(0)["secondaries"], "c is a member but holds nothing"
    m.declare_dead("b", 0.7)
    m.reconcile(0.5 + TERMS.duration * (1 + TERMS.skew) + TERMS.margin)
    assert m.primary_of(0) != "c" or c.committed == 1, "the empty copy was promoted"


def test_caught_up_report_with_unknown_outcome_forgets_no_member() -> None:
    """Bug 3, fixed: the controller commits the report but its answer is lost. The shell asks
    again (Replicator._report_caught_up) and a repeated report of the same join is accepted, so
    the learner stays required until the answer; it is never dropped while it may be a member."""
    m, reps = _joining_cluster()
    b, c = reps["b"], reps["c"]
    join = m.buckets[0]["join_ids"]["c"]
    assert b.add_learner("c", join) is None
    meta = b.snapshot_meta()
    c.install_snapshot(meta["committed"], meta["dedup"], meta["committed_epoch"])
    b.acked_commit["c"] = c.committed  # (as if c acknowledged)
    assert b.learners_caught_up() == ["c"]
    b.report_sent("c")
    assert m.verified_caught_up(0, "b", 1, "c", 0.6, join)["ok"]  # committed, answer lost ...
    retry = m.verified_caught_up(0, "b", 1, "c", 0.6, join)  # ... asked again
    assert retry["ok"] and retry.get("repeated")
    b.report_done("c", True)
    b.submit("u2", ("cl", 2), "w2")
    assert "c" in b.replicas, "the next round waits for member c"


def test_deposed_primary_that_rejoins_keeps_its_round_in_flight() -> None:
    """Replicator._apply_roles sets a `joining` copy's assignment directly (no on_assignment), so a
    primary handed off (lease hand-off: the old primary re-enters as joining) keeps its round in
    flight and the waiters of its pushes. install_snapshot does not clear them either. Promoted
    later, the core replays that stale round: next_round() never starts a new one, and when the
    stale batch is prepared commit_round() fails its `seq == committed + 1` assertion (the shell
    logs "round failed" and retries forever: the bucket is wedged); when the stale batch's seq
    happens to be committed + 1 it is applied again: a push applied twice (the simulation,
    ADAMPS_SIM_UNPATCHED=2, seed 267). Its clients are never answered (they time out instead of
    getting not_primary)."""
    reps = {s: BucketReplica(s, 0) for s in "abc"}
    a1 = Assignment(1, "a", ("b", "c"))
    for r in reps.values():
        r.on_assignment(a1)
    a = reps["a"]
    a.recover()
    a.submit("u1", ("cl", 1), "w1")
    assert _round(a, reps) == ["w1"]
    a.submit("u2", ("cl", 2), "w2")
    assert a.next_round() is not None  # in flight; nobody prepared it yet
    # hand-off to b: a is joining under epoch 2 (the shell's joining branch)
    a2 = Assignment(2, "b", ("c",), ("a",))
    a.on_assignment(a2)  # the shell's joining branch (Replicator._apply_roles)
    for s in "bc":
        reps[s].on_assignment(a2)
    b = reps["b"]
    b.recover()
    for i in (3, 4):
        b.submit(f"u{i}", ("cl", i), f"w{i}")
        _round(b, reps)
    assert b.add_learner("a") is None
    meta = b.snapshot_meta()
    a.install_snapshot(meta["committed"], meta["dedup"], meta["committed_epoch"])
    a.learning = True
    a3 = Assignment(2, "b", ("c", "a"))
    for r in reps.values():
        r.on_assignment(a3)
    assert a.committed == 3
    # b goes; a is promoted at epoch 3
    a4 = Assignment(3, "a", ("c",))
    for s in "ac":
        reps[s].on_assignment(a4)
    a.recover()
    a.submit("u5", ("cl", 5), "w5")
    batch = a.next_round()
    assert batch is not None and batch.seq == 4, f"stale round in flight: {a.inflight}"


def test_stale_caught_up_report_makes_no_fresh_copy_a_member() -> None:
    """c caught up and the primary sent its report; before the controller applies it, c restarts
    empty (or its copy is dropped and re-created: no role for a while, then joining again) and asks
    for a new snapshot. add_learner resets c's learner state from "reporting" to "syncing", so the
    primary may forget it (Replicator._unresponsive forgets a "syncing" learner), and the
    controller's caught_up(b, primary, epoch, c) accepts the OLD report: c is joining again under
    the same primary and epoch. c becomes a promotable member holding nothing."""
    m, reps = _joining_cluster()
    b = reps["b"]
    old_join = m.buckets[0]["join_ids"]["c"]
    assert b.add_learner("c", old_join) is None
    meta = b.snapshot_meta()
    reps["c"].install_snapshot(meta["committed"], meta["dedup"], meta["committed_epoch"])
    b.acked_commit["c"] = reps["c"].committed  # (c acknowledged: independent of bug 1)
    assert b.learners_caught_up() == ["c"]
    b.report_sent("c")  # the report travels ...
    # ... c restarts without its copy and joins again
    m.register("c", "c", 0.6, {})
    new_c = reps["c"] = BucketReplica("c", 0)
    new_c.assignment = _assignment(m)
    assert new_c.assignment.joining == ("c",)
    new_join = m.buckets[0]["join_ids"]["c"]
    assert new_join != old_join
    assert b.add_learner("c", new_join) is None  # its new snapshot request; the reply is slow
    if b.learners.get("c") == "syncing":
        b.drop_learner("c")  # Replicator._unresponsive: a syncing learner is forgotten
    res = m.verified_caught_up(0, "b", 1, "c", 0.7, old_join)  # the old report arrives
    members = m.bucket_view(0)["secondaries"]
    assert not (res["ok"] and "c" in members and new_c.committed == 0 and "c" not in b.replicas), (
        "c is a member holding nothing, and the primary's rounds do not wait for it"
    )
