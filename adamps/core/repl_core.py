"""The replication core of one parameter server: every bucket's state and every decision, no IO
and no clock (etcd-io/raft's RawNode shape; Project Adam 3.3.3).

The shell (adamps.server.replicate, or the simulation) feeds events in and carries out what
``ready()`` returns, then calls ``advance()``:

- ``registered(terms)``: a new incarnation at the controllers (no role or lease trusted any more);
- ``on_roles(reply, asked_at, now)``: a heartbeat's answer: the buckets' records become roles
  (primary, secondary, joining, standby) and ``Assignment``s, renewed leases are timed from when
  the heartbeat was asked (``HolderLeases``), copies no longer assigned are forgotten;
- ``tick(now)``: the failover watchdog (a secondary whose primary stayed silent proposes a role
  change), a joining copy whose primary went silent transfers again, lagging primaries are kicked;
- ``step(peer, msg, now)``: PREPARE, COMMIT and pings of a primary, answered at once (the
  transport is request/response); the batches they decide are applied through ``ready()``;
- ``submit(...)``: a client push, accepted only as primary and while the lease holds;
- ``release(...)``: pushes whose round is decided or committed are acknowledged only while the
  lease holds, else answered "unknown" (another primary may already acknowledge under the next
  epoch; the client's retry is answered exactly once by whoever has the batch);
- ``unresponsive(...)``: a member that did not answer within ``member_timeout``;
- the controllers' answers (``on_role_change_answer``, ``on_caught_up_answer``) and the joining
  copy's snapshot (``snapshot_fits``, ``installed``).

Per bucket, the two-phase-commit state machine is ``BucketReplica`` (adamps.core.replication);
this object holds one per copy, and the per-server state around them: roles, leases, when each
primary was last heard, the joins, and which cut of each copy was persisted.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable, Mapping, Sequence
from typing import Any

from adamps.core.lease import HolderLeases, LeaseTerms
from adamps.core.repl_ready import Answer, ControllerRequest, Ready
from adamps.core.repl_settings import ReplSettings
from adamps.core.repl_types import Apply, Assignment, Batch, Reject
from adamps.core.replication import BucketReplica

#: controller error codes after which a caught-up report's outcome is unknown (the entry may have
#: committed): the report is sent again, never taken as a refusal
UNKNOWN_OUTCOME = frozenset({"no_quorum", "timeout", "unavailable", "internal"})


class ReplCore:
    """Replication state of one server. Mutated only through its methods, by one shell."""

    def __init__(self, settings: ReplSettings) -> None:
        self.settings = settings
        self.server_id = settings.server_id
        #: bucket -> replication state (buckets this server holds a copy of, or is joining)
        self.buckets: dict[int, BucketReplica] = {}
        #: bucket -> "primary" | "secondary" | "joining" | "standby"
        self.roles: dict[int, str] = {}
        #: buckets the controllers report unavailable (no live copy to serve them)
        self.unavailable: frozenset[int] = frozenset()
        #: bucket -> seq of the last cut taken for the flush (absent: a new or reinstalled copy)
        self.persisted: dict[int, int] = {}
        #: bucket -> the controllers' id of this copy's current join (named in the snapshot ask)
        self.join_ids: dict[int, int] = {}
        #: this server's primary leases, timed on its own clock from when it asked
        self.leases = HolderLeases(settings.lease)
        #: version of the controllers' record last applied (None: send every role next time)
        self.table_version: int | None = None
        #: bucket -> time the primary was last heard (secondary and joining side)
        self.last_heard: dict[int, float] = {}
        #: bucket -> time before which no new role change is proposed (secondary side)
        self.role_change_after: dict[int, float] = {}
        self._ready = Ready()

    # -- Ready ------------------------------------------------------------------------------------

    def ready(self) -> Ready:
        """What to carry out now (the same value until ``advance()``)."""
        return self._ready

    def advance(self) -> None:
        """The shell carried out the last ``ready()``."""
        self._ready = Ready()

    def has_ready(self) -> bool:
        return not self._ready.empty()

    def _unknown(self, waiters: Iterable[Any], b: int, why: str) -> None:
        self._ready.answers.extend(Answer(w, "unknown", b, why) for w in waiters)

    def _rep(self, b: int) -> BucketReplica:
        return BucketReplica(self.server_id, b, log_limit=self.settings.log_limit)

    # -- the controllers ----------------------------------------------------------------------------

    def registered(self, terms: LeaseTerms) -> None:
        """A new incarnation at the controllers: no role and no lease is trusted any more, but the
        copies stay (they were offered) until the roles say what to do with them."""
        self.leases = HolderLeases(terms)
        for b, rep in self.buckets.items():
            self._unknown(
                rep.on_assignment(Assignment(rep.assignment.epoch, None)),
                b,
                "this server registered again; the push's outcome is unknown",
            )
            if self.roles.get(b) != "joining" or rep.learning:
                self.roles[b] = "standby"
        self.table_version = None

    def heartbeat_reports(self) -> dict[int, list[int]]:
        """Per copy, [epoch it knows, prepared seq]: what each heartbeat tells the controllers."""
        return {b: [rep.assignment.epoch, rep.prepared_seq] for b, rep in self.buckets.items()}

    def on_roles(self, reply: Mapping[str, Any], asked_at: float, now: float) -> None:
        """A heartbeat's answer, asked at `asked_at` (this server's clock)."""
        self.unavailable = frozenset(int(b) for b in reply.get("unavailable", []))
        if "roles" in reply:
            self._apply_roles(reply["roles"], int(reply["version"]), now)
        for b, epoch in reply.get("renewed", []):
            self.leases.on_granted(int(b), int(epoch), asked_at)
            if int(b) in self.buckets:
                self._ready.kicks.add(int(b))

    def _apply_roles(self, roles: Iterable[Mapping[str, Any]], version: int, now: float) -> None:
        seen = set()
        for r in roles:
            b = int(r["bucket"])
            seen.add(b)
            # `secondaries` excludes the primary; membership changes keep the lease epoch.
            assignment = Assignment(
                int(r["epoch"]),
                r.get("primary"),
                tuple(r.get("secondaries", [])),
                tuple(r.get("joining", [])),
            )
            role = r.get("role") or (
                "primary"
                if assignment.primary == self.server_id
                else "secondary"
                if self.server_id in assignment.secondaries
                else "joining"
            )
            if role == "standby" and b not in self.buckets:
                continue  # a copy this server no longer has: never an initial-valued stand-in
            self._ready.hold.append(b)  # shards exist only for the buckets this server holds
            rep = self.buckets.get(b)
            if rep is None:
                rep = self.buckets[b] = self._rep(b)
            was = self.roles.get(b)
            if role == "standby":
                # No member: keep the copy (and its position) untouched, serve nothing.
                self.roles[b] = "standby"
                self.leases.drop(b)
                continue
            why = "this server is no longer the primary; the push's outcome is unknown"
            if role == "joining":
                # Not a member yet: keep the assignment to know the primary, start the transfer.
                # (A primary handed off ends its rounds and answers its waiters here; another
                # primary or epoch means another history: transfer again.)
                self._unknown(rep.on_assignment(assignment), b, why)
                self.join_ids[b] = int(r.get("join", 0))
                self.roles[b] = "joining"
                self._ready.start_joins.append(b)
                continue
            if was == "joining":
                self._ready.stop_joins.append(b)
            self._unknown(rep.on_assignment(assignment), b, why)
            self.roles[b] = role
            if role == "primary":
                if was != "primary" and was is not None:
                    self._ready.failovers += 1
                self._ready.kicks.add(b)
            else:
                self.leases.drop(b)
                self.last_heard.setdefault(b, now)
        for b in [b for b in self.buckets if b not in seen]:
            self._forget(b)
        self.table_version = version

    def _forget(self, b: int) -> None:
        rep = self.buckets.pop(b, None)
        self.persisted.pop(b, None)
        self.roles.pop(b, None)
        self.join_ids.pop(b, None)
        self.leases.drop(b)
        self.last_heard.pop(b, None)
        self.role_change_after.pop(b, None)
        self._ready.forget.append(b)
        self._ready.stop_joins.append(b)
        if rep is not None:
            self._unknown(
                rep.on_assignment(Assignment(rep.assignment.epoch + 1, None)),
                b,
                "this server no longer holds the bucket; the push's outcome is unknown",
            )

    def on_role_change_answer(self, b: int, retry_after: float | None, now: float) -> None:
        """The controllers answered a role-change proposal (a refusal may say when to retry)."""
        if retry_after:
            self.role_change_after[b] = now + float(retry_after)
        self._ready.heartbeat = True

    # -- time -------------------------------------------------------------------------------------------

    def tick(self, now: float) -> None:
        """Timers: the failover watchdog, silent primaries of joining copies, lagging members."""
        fa = self.settings.failover_after
        for b, role in self.roles.items():
            rep = self.buckets[b]
            if role == "secondary":
                heard = self.last_heard.get(b, now)
                if now - heard > fa and now >= self.role_change_after.get(b, 0.0):
                    self.role_change_after[b] = now + fa
                    self._ready.requests.append(
                        ControllerRequest(
                            "role_change",
                            b,
                            rep.assignment.epoch,
                            position=(rep.assignment.epoch, rep.prepared_seq),
                        )
                    )
            elif role == "joining" and rep.learning:
                if now - self.last_heard.get(b, 0.0) > fa:
                    rep.learning = False  # the primary forgot this learner: transfer again
            elif role == "primary" and rep.lagging():
                self._ready.kicks.add(b)

    def pings(self) -> dict[str, dict[str, int]]:
        """Member -> {bucket: epoch} of the buckets this server is primary of: one ping each."""
        by_member: dict[str, dict[str, int]] = {}
        for b, role in self.roles.items():
            if role == "primary":
                rep = self.buckets[b]
                for m in rep.replicas:
                    by_member.setdefault(m, {})[str(b)] = rep.assignment.epoch
        return by_member

    # -- primary: pushes, rounds, acknowledgements ---------------------------------------------

    def check_primary(self, b: int, now: float) -> BucketReplica | Reject:
        """The bucket's state if this server may serve it as primary now."""
        rep = self.buckets.get(b)
        if b in self.unavailable:
            self._ready.heartbeat = True
            return Reject(
                "bucket_unavailable",
                f"bucket {b}: no live copy can serve it (waiting for a copy to come back, or "
                "for an operator to declare it lost)",
            )
        if rep is None or self.roles.get(b) != "primary":
            return Reject("not_primary", "this server is not its primary")
        if not self.leases.can_write(b, rep.assignment.epoch, now):
            self._ready.heartbeat = True
            return Reject("not_primary", "the primary lease is not (or no longer) held")
        return rep

    def submit(
        self,
        updates: Mapping[int, Any],
        client: tuple[str, int] | None,
        waiters: Mapping[int, Any],
        now: float,
    ) -> tuple[int, Reject] | int:
        """A client push (its updates per bucket, a waiter per bucket): all buckets or none.
        Returns (bucket, refusal), or how many buckets found it a duplicate."""
        reps = {}
        for b in updates:
            rep = self.check_primary(b, now)
            if isinstance(rep, Reject):
                return b, rep
            reps[b] = rep
        dups = 0
        for b, update in updates.items():
            verdict = reps[b].submit(update, client, waiters[b])
            if isinstance(verdict, Reject):
                return b, verdict
            if verdict == "duplicate-committed":
                self._ready.answers.append(Answer(waiters[b], "ok", b))
            dups += verdict != "queued"
            self._ready.kicks.add(b)
        return dups

    def round_start(self, b: int, now: float) -> str:
        """Whether the primary's rounds of bucket b go on: "stop" (no longer primary, or the lease
        lapsed: the next renewal kicks again), "round" (a round is in flight) or "idle"."""
        rep = self.buckets.get(b)
        if rep is None or self.roles.get(b) != "primary":
            return "stop"
        if rep.needs_recovery:
            rep.recover()
        if rep.inflight is None:
            if not self.leases.can_write(b, rep.assignment.epoch, now):
                return "stop"
            if rep.next_round() is None:
                return "idle"
        return "round"

    def decide(self, b: int, now: float) -> Apply:
        """Every member holds the round's batch: apply it; with ``ack = "prepared"`` this is the
        decision point and its pushes are acknowledged (docs/protocol-ps.md)."""
        rep = self.buckets[b]
        action = rep.commit_round()
        self._ready.applies.append((b, action))
        if self.settings.ack == "prepared":
            self.release(b, rep.release_decided(), now)
        return action

    def release(self, b: int, waiters: Iterable[Any], now: float) -> None:
        """Acknowledges pushes whose batches are decided (or committed by every member), but only
        while this server's lease of the bucket holds: past it another copy may already be
        acknowledging under the next epoch. Then their outcome is unknown to the client; its
        retry is answered by the next primary, which has the batch (exactly once)."""
        waiters = list(waiters)
        if not waiters:
            return
        rep = self.buckets.get(b)
        if rep is not None and self.leases.can_write(b, rep.assignment.epoch, now):
            self._ready.answers.extend(Answer(w, "ok", b) for w in waiters)
        else:
            why = "the lease ended before the acknowledgement; the push's outcome is unknown"
            self._unknown(waiters, b, why)

    def on_commit_ack(self, b: int, member: str, seq: int, now: float) -> None:
        rep = self.buckets[b]
        self.release(b, rep.on_commit_ack(member, seq), now)

    def committed_everywhere(self, b: int, now: float) -> None:
        """A commit phase ended: acknowledge what every member committed, report learners."""
        rep = self.buckets[b]
        self.release(b, rep.release_acknowledged(), now)
        self.report_learners(b)

    def unresponsive(self, b: int, member: str) -> str:
        """A replica did not answer within member_timeout: "forgotten" (a learner not yet reported
        caught up is no member: it transfers again), "wait" (its report awaits the controllers'
        answer) or "drop" (a member, or an accepted learner, leaves only by a committed controller
        entry: a drop_secondary request is in ``ready()``, and the rounds wait for the record)."""
        rep = self.buckets[b]
        state = rep.learners.get(member)
        if state == "syncing":
            rep.drop_learner(member)
            return "forgotten"
        if state == "reporting":
            return "wait"
        self._ready.requests.append(
            ControllerRequest("drop_secondary", b, rep.assignment.epoch, member)
        )
        return "drop"

    def report_learners(self, b: int) -> None:
        """Learners that hold every committed batch: report them caught up (once)."""
        rep = self.buckets.get(b)
        if rep is None:
            return
        for m in rep.learners_caught_up():
            rep.report_sent(m)
            self._ready.requests.append(
                ControllerRequest(
                    "caught_up", b, rep.assignment.epoch, m, rep.learner_joins.get(m, 0)
                )
            )

    def on_caught_up_answer(self, req: ControllerRequest, error: str | None) -> bool:
        """The controllers' answer to a caught-up report (`error`: None if accepted, else its
        code, "connection" when none came). True when the report must be sent again: its
        outcome is unknown (the entry may have committed, and a repeated report of one join is
        accepted), and the record has not moved on without this primary or this join."""
        self._ready.heartbeat = True
        rep = self.buckets.get(req.bucket)
        if (
            rep is None
            or rep.assignment.epoch != req.epoch
            or not rep.is_primary
            or rep.learners.get(req.member) != "reporting"
            or rep.learner_joins.get(req.member, 0) != req.join
        ):
            # The record moved on (on_assignment settles the learner), or the copy joined
            # again meanwhile: that join's own report decides, not this older one's answer.
            return False
        if error is not None and (error == "connection" or error in UNKNOWN_OUTCOME):
            return True
        rep.report_done(req.member, error is None)
        return False

    # -- secondary: messages from the primary ---------------------------------------------------

    def step(self, peer: str | None, msg: Mapping[str, Any], now: float) -> Reject | dict[str, Any]:
        """A replication message of a primary (op repl_prepare with its entries decoded and
        checked, repl_commit, repl_ping): the reply, or a refusal."""
        op = msg["op"]
        if op == "repl_ping":
            return {"stale": self._on_ping(msg["sender"], msg["buckets"], now)}
        b = int(msg["bucket"])
        rep = self.buckets.get(b)
        if rep is None:
            self._ready.heartbeat = True
            return Reject("unavailable", f"bucket {b}: no copy here (yet)")
        if op == "repl_prepare":
            res = self._on_prepare(b, rep, msg, now)
        else:
            res = self._on_commit(b, rep, msg["sender"], msg["epoch"], msg["seq"], now)
        if isinstance(res, Reject):
            if res.code == "stale_epoch":
                self._ready.stale += 1
            if res.code == "unavailable":
                self._ready.heartbeat = True  # the primary knows an epoch we do not
        return res

    def _on_prepare(
        self, b: int, rep: BucketReplica, msg: Mapping[str, Any], now: float
    ) -> Reject | dict[str, Any]:
        sender, epoch = msg["sender"], msg["epoch"]
        entries: Sequence[Batch] = msg["entries"]
        res = rep.on_prepare(sender, epoch, entries)
        if isinstance(res, Reject):
            return res
        self.last_heard[b] = now
        reply: dict[str, Any] = {"status": res[0], "seq": res[1]}
        # The primary's committed seq rides along (Raft's leaderCommit): what it says was decided
        # is applied now, as an explicit COMMIT would be, and the reply tells the primary so.
        upto = min(int(msg.get("commit", 0)), rep.prepared_seq)
        if res[0] == "ok" and upto > rep.committed:
            done = rep.on_commit(sender, epoch, upto)
            if isinstance(done, Apply):
                self._ready.applies.append((b, done))
                reply["committed"] = rep.committed
        return reply

    def _on_commit(
        self, b: int, rep: BucketReplica, sender: str, epoch: int, seq: int, now: float
    ) -> Reject | dict[str, Any]:
        res = rep.on_commit(sender, epoch, seq)
        if isinstance(res, Reject):
            return res
        self.last_heard[b] = now
        if isinstance(res, tuple):
            return {"status": res[0], "seq": res[1]}
        # Decided and queued to the owner threads in seq order by the shell (ready().applies),
        # in this same step: the ack need not wait for the application.
        self._ready.applies.append((b, res))
        return {"status": "ok", "seq": rep.committed}

    def _on_ping(self, sender: str, pinged: Mapping[int, int], now: float) -> list[int]:
        stale = []
        for b, epoch in pinged.items():
            rep = self.buckets.get(b)
            if rep is None:
                continue
            if rep.assignment.epoch == epoch and rep.assignment.primary == sender:
                self.last_heard[b] = now
            elif epoch < rep.assignment.epoch:
                stale.append(b)
            else:
                self._ready.heartbeat = True
        return stale

    def on_ping_reply(self, stale: Sequence[int]) -> None:
        """A member says some of this server's pinged epochs are stale: ask the controllers."""
        if stale:
            self._ready.stale += len(stale)
            self._ready.heartbeat = True

    def on_peer_stale(self) -> None:
        """A member refused a message as of an older epoch: this server's record is old."""
        self._ready.stale += 1
        self._ready.heartbeat = True

    # -- state transfer -------------------------------------------------------------------------------

    def snapshot_for(self, b: int, joiner: str, join: int, now: float) -> Reject | dict[str, Any]:
        """A joining copy asks for a snapshot: as primary under the lease, the joiner becomes a
        learner now (every later round waits for it) and gets the position and dedup table; the
        shell queues the values' reads in this same step."""
        rep = self.check_primary(b, now)
        if isinstance(rep, Reject):
            return rep
        rej = rep.add_learner(joiner, join)
        if rej is not None:
            if rej.code == "unavailable":
                self._ready.heartbeat = True
            return rej
        return {"epoch": rep.assignment.epoch, **rep.snapshot_meta()}

    def join_target(self, b: int) -> tuple[str | None, int, int] | None:
        """(primary, epoch, join id) to ask for a snapshot while bucket b is joining, else None."""
        if self.roles.get(b) != "joining":
            return None
        a = self.buckets[b].assignment
        return a.primary, a.epoch, self.join_ids.get(b, 0)

    def snapshot_fits(self, b: int, asked: tuple[str | None, int], snap_epoch: int) -> bool:
        """A snapshot fetched from `asked` = (primary, epoch) is installed only if the copy is still
        joining under that very record, and the primary sent it under that epoch."""
        rep = self.buckets.get(b)
        return (
            rep is not None
            and self.roles.get(b) == "joining"
            and (rep.assignment.primary, rep.assignment.epoch) == asked
            and snap_epoch == asked[1]
        )

    def installed(
        self, b: int, committed: int, dedup: Iterable[Sequence[Any]], epoch: int, now: float
    ) -> None:
        """The shell queued the snapshot's values: the position moves in the same step."""
        self.buckets[b].install_snapshot(committed, dedup, epoch)
        self.persisted.pop(b, None)
        self.last_heard[b] = now

    def learning(self, b: int) -> bool:
        """A joining copy holds its snapshot and takes its primary's rounds."""
        rep = self.buckets.get(b)
        return rep is not None and self.roles.get(b) == "joining" and rep.learning

    # -- copies and durability --------------------------------------------------------------------

    def _holds(self, b: int, rep: BucketReplica) -> bool:
        # A joining copy that has no snapshot yet holds nothing.
        return self.roles.get(b) != "joining" or rep.learning

    def copies(self) -> dict[int, list[int]]:
        """The copies held whole, with the (epoch, seq) of the newest batch held applied or
        prepared: what this server offers the controllers."""
        return {b: list(r.held_position) for b, r in self.buckets.items() if self._holds(b, r)}

    def held_copies(self) -> set[int]:
        """The buckets whose copy a flush persists."""
        return {b for b, r in self.buckets.items() if self._holds(b, r)}

    def positions(
        self,
        buckets: Container[int] | None,
        dedup_per_flush: int,
        make: Callable[[int, int, list[list[Any]], bool, list[Batch]], Any],
    ) -> dict[int, Any]:
        """Per held copy (of `buckets`; None: all), make(epoch, seq, dedup pairs, fresh, prepared
        batches): its position and the exactly-once pairs recorded since the last cut. Taken in
        the same step as the flush's copies are queued: they describe exactly what it writes."""
        out = {}
        for b, rep in self.buckets.items():
            if not self._holds(b, rep) or (buckets is not None and b not in buckets):
                continue
            last = self.persisted.get(b)
            if last is None:
                dedup, fresh = rep.dedup.to_list(), True
            else:
                dedup, fresh = rep.dedup.entries_after(last, dedup_per_flush), False
            out[b] = make(rep.committed_epoch, rep.committed, dedup, fresh, rep.held_prepared())
            self.persisted[b] = rep.committed
        return out

    def unpersisted(self, b: int) -> None:
        """Bucket b's cut on disk is gone (corrupt, or moved): the next flush writes it whole."""
        self.persisted.pop(b, None)

    def restore(
        self,
        b: int,
        seq: int,
        epoch: int,
        dedup: Iterable[Sequence[Any]],
        prepared: Iterable[Batch],
    ) -> None:
        """A copy reloaded from disk at start: held as standby until the controllers decide."""
        rep = self.buckets[b] = self._rep(b)
        rep.restore(seq, epoch, dedup, prepared)
        self.roles[b] = "standby"
        self.persisted[b] = seq

    # -- observation ----------------------------------------------------------------------------

    def primaries(self) -> list[int]:
        return [b for b, r in self.roles.items() if r == "primary"]

    def lag(self, b: int) -> int:
        """Batches the slowest replica of a primary bucket has yet to commit."""
        rep = self.buckets[b]
        low = min((rep.acked_commit.get(m, -1) for m in rep.replicas), default=rep.committed)
        return max(0, rep.committed - max(low, 0))

    def status(self, now: float) -> dict[str, Any]:
        out = {}
        for b, rep in sorted(self.buckets.items()):
            d = self.leases.deadline(b)
            out[str(b)] = {
                "role": self.roles.get(b),
                "epoch": rep.assignment.epoch,
                "primary": rep.assignment.primary,
                "secondaries": list(rep.assignment.secondaries),
                "committed": rep.committed,
                "committed_epoch": rep.committed_epoch,
                "learners": dict(rep.learners),
                "prepared": sorted(rep.prepared),
                "pending": len(rep.pending),
                "lease_left": None if d is None else round(d - now, 3),
            }
        return out
