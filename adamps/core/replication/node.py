"""The replication core of one parameter server: every bucket's state and every decision, no IO
and no clock (etcd-io/raft's RawNode shape; Project Adam 3.3.3).

The shell (adamps.server.replication.shell, or the simulation) feeds events in and carries out what
``ready()`` returns, then calls ``advance()``:

- the controllers (controllers.py): ``tick`` asks for the registration and the heartbeats
  when the link says (``ControllerRequest`` in the ``Ready``), ``want_record(now)`` for a
  heartbeat at once, and ``controller_answer(req, answer, now)`` feeds back every answer;
- ``on_roles(reply, asked_at, now)`` (a heartbeat's answer): the buckets' records become roles
  (primary, secondary, joining, standby) and ``Assignment``s, renewed leases are timed from when
  the heartbeat was asked (``HolderLeases``), copies no longer assigned are forgotten;
- ``tick(now)``: the failover watchdog (a secondary whose primary stayed silent proposes a role
  change), a joining copy whose primary went silent transfers again, the primary's retries,
  delayed COMMITs and messages unanswered past their deadline (failed: deadlines.py),
  caught-up reports of unknown outcome sent again;
- ``step(peer, msg, now)``: PREPARE, COMMIT and pings of a primary, answered at once (the
  transport is request/response); the batches they decide are applied through ``ready()``;
- ``submit(...)``: a client push, accepted only as primary and while the lease holds; then
  ``pump`` runs the bucket's rounds: its messages (``Send``) are in ``ready()``, and each gets
  one answer back, ``answer(rid, reply, error, now)`` (ignored after its deadline);
- ``release(...)``: pushes whose round is decided or committed are acknowledged only while the
  lease holds, else answered "unknown" (another primary may already acknowledge under the next
  epoch; the client's retry is answered exactly once by whoever has the batch);
- ``unresponsive(...)``: a member whose messages failed for ``member_timeout``;
- the joining copy's snapshot (``snapshot_fetched``, ``installed``, ``install_persisted``: join.py);
- the disk (disk.py): a copy reloaded at start (``reloaded``), a flush's cut (``cut_taken``),
  damaged records (``rewrite_copy``), whether a copy can be persisted now (``cannot_persist``).

Nothing outside the core writes its attributes: every change comes through these inputs
(tests/core/test_core_inputs.py scans the code for writes).

Per bucket, the two-phase-commit state machine is ``BucketReplica`` (adamps.core.replication.bucket);
this object holds one per copy, and the per-server state around them: roles, leases, when each
primary was last heard, the joins, and which cut of each copy was persisted.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from adamps.core.lease import HolderLeases
from adamps.core.replication.bucket import BucketReplica
from adamps.core.replication.controller_link import ControllerLink
from adamps.core.replication.controllers import ControllerSide
from adamps.core.replication.deadlines import PeerLinks
from adamps.core.replication.disk import DiskSide
from adamps.core.replication.invariants import check as _check_invariants
from adamps.core.replication.join import JoiningCopy
from adamps.core.replication.pings import Pings
from adamps.core.replication.ready import Answer, ControllerRequest, Fetch, Ready, Send
from adamps.core.replication.rounds import MAX_GAPS, Rounds
from adamps.core.replication.settings import ReplSettings
from adamps.core.replication.values import Apply, Assignment, Batch, Reject


class ReplCore(ControllerSide, JoiningCopy, Pings, DiskSide):
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
        #: bucket -> (primary, epoch) its installed snapshot came from, while it is persisted
        self.installing: dict[int, tuple[str | None, int]] = {}
        self._fetching: dict[int, Fetch] = {}
        self._fetch_after: dict[int, float] = {}
        #: this server's primary leases, timed on its own clock from when it asked
        self.leases = HolderLeases(settings.lease)
        #: version of the controllers' record last applied (None: send every role next time)
        self.table_version: int | None = None
        #: bucket -> time the primary was last heard (secondary and joining side)
        self.last_heard: dict[int, float] = {}
        #: bucket -> time before which no new role change is proposed (secondary side)
        self.role_change_after: dict[int, float] = {}
        #: bucket -> learner -> when the controllers' acceptance of its caught-up report came
        #: (primary side): a record asked before then may predate it (``_apply_roles``)
        self._accepted: dict[int, dict[str, float]] = {}
        #: (bucket, learner) -> (when, report): caught-up reports of unknown outcome to send
        #: again (primary side, ``tick``)
        self._report_again: dict[tuple[int, str], tuple[float, ControllerRequest]] = {}
        #: bucket -> the primary's messages to its replicas (primary side)
        self._rounds: dict[int, Rounds] = {}
        #: message id -> (bucket, replica) of every message in flight
        self._rids: dict[int, tuple[int, str]] = {}
        self._next_rid = 0
        self._ready = Ready()
        #: when to register and heartbeat (controllers.py)
        self.link = ControllerLink(retry=settings.link_retry)
        #: when each message to a peer is due an answer (deadlines.py)
        self._links = PeerLinks(settings.member_timeout, settings.rate_floor)

    validate = _check_invariants  # raises InvariantViolation naming bucket and rule

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

    def new_replica(self, b: int) -> BucketReplica:
        return BucketReplica(self.server_id, b, log_limit=self.settings.log_limit)

    # -- the controllers' records (their calls and answers: controllers.py) ----------------

    def on_roles(self, reply: Mapping[str, Any], asked_at: float, now: float) -> None:
        """A heartbeat's answer, asked at `asked_at` (this server's clock)."""
        self.unavailable = frozenset(int(b) for b in reply.get("unavailable", []))
        if "roles_since" in reply:
            # A delta (issue 40): the buckets whose record changed since the version this
            # server applied, and those it has no role in any more. From another version than
            # the one held (a reply overtaken by another), it cannot be applied: the next
            # heartbeat, knowing no version, gets the full list.
            if reply["roles_since"] != self.table_version:
                self.table_version = None
            else:
                removed = [int(b) for b in reply.get("removed", [])]
                self._apply_roles(reply["roles"], int(reply["version"]), asked_at, now, removed)
        elif "roles" in reply:
            self._apply_roles(reply["roles"], int(reply["version"]), asked_at, now)
        for b, epoch in reply.get("renewed", []):
            self.leases.on_granted(int(b), int(epoch), asked_at)
            self.pump(int(b), now)

    def _apply_roles(
        self,
        roles: Iterable[Mapping[str, Any]],
        version: int,
        asked_at: float,
        now: float,
        removed: Iterable[int] | None = None,
    ) -> None:
        """`roles`: every bucket this server has a role in (`removed` None: the others are
        dropped), or a delta: the buckets whose role changed, and `removed` those to drop."""
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
                rep = self.buckets[b] = self.new_replica(b)
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
                continue
            if was == "joining":
                self._stop_join(b)
            # Learners whose acceptance came after this heartbeat was asked: a record without
            # them may be older than the acceptance (the answer was slow), and the controllers
            # already count them members. Dropping them would acknowledge pushes they lack
            # (the simulation, seeds 3745, 8035, 9819). A record asked later decides.
            accepted = self._accepted.get(b, {})
            keep = frozenset(m for m, at in accepted.items() if at >= asked_at)
            self._unknown(rep.on_assignment(assignment, keep), b, why)
            if accepted:
                self._accepted[b] = {m: at for m, at in accepted.items() if m in rep.learners}
            self.roles[b] = role
            if role == "primary":
                if was != "primary" and was is not None:
                    self._ready.failovers += 1
                self.pump(b, now)
            else:
                self.leases.drop(b)
                self.last_heard.setdefault(b, now)
        if removed is None:
            removed = [b for b in self.buckets if b not in seen]
        for b in removed:
            if b in self.buckets and b not in seen:
                self._forget(b)
        self.table_version = version

    def _forget(self, b: int) -> None:
        rep = self.buckets.pop(b, None)
        self.persisted.pop(b, None)
        self.roles.pop(b, None)
        self.join_ids.pop(b, None)
        self.installing.pop(b, None)
        self.leases.drop(b)
        self.last_heard.pop(b, None)
        self.role_change_after.pop(b, None)
        self._accepted.pop(b, None)
        self._rounds.pop(b, None)
        self._ready.forget.append(b)
        self._stop_join(b)
        if rep is not None:
            self._unknown(
                rep.on_assignment(Assignment(rep.assignment.epoch + 1, None)),
                b,
                "this server no longer holds the bucket; the push's outcome is unknown",
            )

    # -- time -------------------------------------------------------------------------------------------

    def tick(self, now: float) -> None:
        """Timers: the failover watchdog, silent primaries of joining copies, lagging members,
        snapshots to ask for, the primary's pings (pings.py)."""
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
            elif role == "primary":
                if (rs := self._rounds.get(b)) is None or rs.due(rep, now) <= now:
                    for m, o in rs.overdue(now) if rs else ():  # failed: deadlines.py
                        self._rids.pop(o.rid, None)
                        if o.epoch == rep.assignment.epoch:
                            self._failed(b, rep, rs, m, o.sent, now)
                    self.pump(b, now)
        for key, (at, req) in list(self._report_again.items()):
            if now >= at:
                del self._report_again[key]
                self._ready.requests.append(req)
        self._joins_tick(now)
        self._pings_tick(now)
        self._link_tick(now)

    def next_deadline(self, now: float) -> float:
        """When ``tick`` next has something to do: ``now`` or earlier (at once), a time, or inf.
        A tick before then changes nothing, so a shell may sleep until then, feeding every other
        input at once (they may bring it earlier: ask again after them). The pings, the
        heartbeats and every watchdog keep their periods; a primary's bucket when its pump next
        has something to send or start (``Rounds.due``): never while it waits only for answers,
        which pump it themselves."""
        fa = self.settings.failover_after
        due = min(self.link.next_due(), self._pings_due(), self._joins_due(now))
        # Asked after every loop step with inputs: the dicts bound once, a secondary's watchdog
        # two lookups and no call (issue 36: a tenth of a server's event loop at RF 3)
        buckets, rounds, heard = self.buckets, self._rounds, self.last_heard
        after = self.role_change_after
        for b, role in self.roles.items():
            if role == "secondary":
                if (h := heard.get(b)) is not None:
                    at, r = h + fa, after.get(b, 0.0)
                    at = r if r > at else at  # max(h + fa, after): no call
                    due = at if at < due else due
            elif role == "primary":
                if (rs := rounds.get(b)) is None or (at := rs.due(buckets[b], now)) <= now:
                    return now
                due = at if at < due else due
            elif role == "joining" and buckets[b].learning:
                at = heard.get(b, 0.0) + fa
                due = at if at < due else due
        return min([due, *(at for at, _req in self._report_again.values())])

    # -- primary: pushes, rounds, acknowledgements ---------------------------------------------

    def check_primary(self, b: int, now: float, read: bool = False) -> BucketReplica | Reject:
        """The bucket's state if this server may serve it as primary now; for a `read`, only
        once it holds no in-doubt batch (a new primary's values may lack acknowledged pushes
        until its first rounds applied what its predecessor left prepared)."""
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
        if read and rep.in_doubt:
            # Writes may go on: they are sequenced after the in-doubt batches.
            return Reject(
                "not_primary",
                f"bucket {b}: this new primary has not yet applied its predecessor's in-doubt "
                f"rounds (seq {rep.committed + 1} to {rep.prepared_seq}); a read now could miss "
                "an acknowledged push: retry",
            )
        return rep

    def check_primaries(
        self, buckets: Iterable[int], now: float, read: bool = False
    ) -> Reject | None:
        """check_primary of every bucket a request names, as one input: the first refusal
        (naming its bucket), or None. One step of the shell for a request of many buckets (a
        push_rows names most of them), not one step and drain per bucket."""
        for b in buckets:
            rep = self.check_primary(b, now, read)
            if isinstance(rep, Reject):
                return dataclasses.replace(rep, bucket=b)
        return None

    def submit(
        self,
        updates: Mapping[int, Any],
        client: tuple[str, int] | None,
        waiters: Mapping[int, Any],
        now: float,
    ) -> Reject | None:
        """A client push (its updates per bucket, a waiter per bucket): all buckets or none.
        Returns the refusal (naming its bucket), if any; duplicates are counted in the Ready."""
        reps = {}
        for b in updates:
            rep = self.check_primary(b, now)
            if isinstance(rep, Reject):
                return dataclasses.replace(rep, bucket=b)
            reps[b] = rep
        for b, update in updates.items():
            verdict = reps[b].submit(update, client, waiters[b])
            if isinstance(verdict, Reject):
                return dataclasses.replace(verdict, bucket=b)
            if verdict == "duplicate-committed":
                self._ready.answers.append(Answer(waiters[b], "ok", b))
            self._ready.duplicates += verdict != "queued"
            self.pump(b, now)
        return None

    def pump(self, b: int, now: float) -> None:
        """The primary's rounds of bucket b: start the next round while the lease holds and
        pushes wait, decide a round every replica holds, send each replica what it lacks."""
        rep = self.buckets.get(b)
        if rep is None or self.roles.get(b) != "primary":
            self._rounds.pop(b, None)
            return
        if (rs := self._rounds.get(b)) is None:
            rs = self._rounds[b] = Rounds()
        while True:
            if rep.needs_recovery:
                rep.recover()
            if rep.inflight is None:
                # A new round only under the lease (the next renewal pumps again).
                if not self.leases.can_write(b, rep.assignment.epoch, now):
                    break
                if rep.next_round() is None:
                    break
                rs.started(now, len(rep.inflight[1]))  # type: ignore[index]
            if not rep.round_prepared():
                break
            self._decide(b, rep, rs, now)
        # ack = "committed": what every replica committed (also after one was removed).
        self.release(b, rep.release_acknowledged(), now)
        rs.forget_gone(rep.replicas)
        epoch = rep.assignment.epoch
        for m, op, fields in rs.to_send(rep, now):
            if not op:  # its gap reaches past the log: it needs a state transfer
                self._failed(b, rep, rs, m, now, now)
                continue
            self._next_rid = rid = self._next_rid + 1
            rs.sent(m, rid, op, epoch, now, self._links.deadline(m, fields, now))
            self._rids[rid] = (b, m)
            body = {"bucket": b, "epoch": epoch, "sender": self.server_id, **fields}
            self._ready.messages.append(Send(rid, m, op, body))
        self.report_learners(b)

    def _decide(self, b: int, rep: BucketReplica, rs: Rounds, now: float) -> None:
        """Every replica holds the round's batch: apply it; with ``ack = "prepared"`` this is the
        decision point and its pushes are acknowledged (docs/protocol-ps.md)."""
        self._ready.applies.append((b, rep.commit_round()))
        self._ready.rounds.append((now - rs.began, rs.pushes))
        if self.settings.ack == "prepared":
            self.release(b, rep.release_decided(), now)
            rs.decided(now)

    def answer(
        self, rid: int, reply: Mapping[str, Any] | None, error: str | None, now: float
    ) -> None:
        """The one answer the transport gives message `rid`: the replica's reply, or its error."""
        if reply is not None:
            self.on_reply(rid, reply, now)
        else:
            self.report_unreachable(rid, now, error or "connection")

    def on_reply(self, rid: int, reply: Mapping[str, Any], now: float) -> None:
        """A replica answered message `rid` (a PREPARE or COMMIT of this primary)."""
        if (got := self._take(rid)) is None:
            return
        b, m, rep, rs, o = got
        if o.epoch == rep.assignment.epoch:  # else: of a round restarted under a new epoch
            committed = rs.answered(rep, m, o.op, dict(reply))
            if committed is not None:
                self.release(b, rep.on_commit_ack(m, committed), now)
            if rs.gaps.get(m, 0) > MAX_GAPS:
                self._failed(b, rep, rs, m, o.sent, now)
        self.pump(b, now)

    def report_unreachable(self, rid: int, now: float, code: str = "connection") -> None:
        """The transport says message `rid` failed: the connection failed, or the replica
        refused it (`code`: stale_epoch means this server's record is old)."""
        if (got := self._take(rid)) is None:
            return
        b, m, rep, rs, o = got
        if code == "stale_epoch":
            self.on_peer_stale()
        if o.epoch == rep.assignment.epoch:
            self._failed(b, rep, rs, m, o.sent, now)
        self.pump(b, now)

    def _take(self, rid: int) -> tuple[int, str, BucketReplica, Rounds, Any] | None:
        if (bm := self._rids.pop(rid, None)) is None:
            return None
        b, m = bm
        rs, rep = self._rounds.get(b), self.buckets.get(b)
        if rs is None or rep is None or m not in rs.out or rs.out[m].rid != rid:
            return None
        return b, m, rep, rs, rs.out.pop(m)

    def _failed(
        self, b: int, rep: BucketReplica, rs: Rounds, m: str, sent: float, now: float
    ) -> None:
        if m in rep.replicas and rs.failed(m, sent, now, self.settings.member_timeout):
            self.unresponsive(b, m)

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

    def unresponsive(self, b: int, member: str) -> str:
        """A replica failed for member_timeout: "forgotten" (a learner not yet reported
        caught up is no member: it transfers again), "wait" (its report awaits the controllers'
        answer) or "drop" (a member, or an accepted learner, leaves only by a committed controller
        entry: a drop_secondary request is in ``ready()``; the rounds wait for the record)."""
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

    # -- secondary: messages from the primary ---------------------------------------------------

    def step(self, peer: str | None, msg: Mapping[str, Any], now: float) -> Reject | dict[str, Any]:
        """A replication message of a primary (op repl_prepare with its entries decoded and
        checked, repl_commit, repl_ping): the reply, or a refusal. Op "reply" is a replica's
        answer to this primary's message ``rid`` (``on_reply``)."""
        op = msg["op"]
        if op == "reply":
            self.on_reply(msg["rid"], msg["reply"], now)
            return {}
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
        rs = self._rounds.get(b)
        if rs is not None:
            # What the joiner answers to a message sent before this snapshot (as an earlier
            # member, or an earlier join) says nothing about the copy it installs now: a late
            # commit ack would report it caught up before it holds anything.
            rs.forget(joiner)
        return {"epoch": rep.assignment.epoch, **rep.snapshot_meta()}
