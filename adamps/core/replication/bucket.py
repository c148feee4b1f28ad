"""Replication of one bucket over two-phase commit: the pure core (Project Adam 3.3.3).

No sockets, no threads, no clock: the parameter server's shell feeds events in (a client push, a
prepare or commit from the primary, a reply from a secondary, a new assignment from the controller,
a timeout it measured) and carries out what the methods return. Batches are opaque to this module:
it sequences them, decides who must have them, and says when they may be applied and acknowledged.

The protocol, for a bucket whose controller-recorded assignment is (epoch, primary, secondaries):

- The primary (and only while its lease holds: the shell checks it with adamps.core.lease) gathers
  client pushes into the next batch, numbered ``seq = committed + 1``. One round is in flight per
  bucket; pushes arriving meanwhile wait for the next round, so a round carries many pushes.
- PREPARE(epoch, entries) goes to every secondary of the recorded set. ``entries`` are all batches
  the secondary lacks, from the highest seq it acknowledged: a lagging member catches up through
  the same message. A secondary accepts only the epoch it learned from the controller (an older
  one is ``stale``, a newer one makes it ask the controller first), keeps the batches as prepared,
  and acknowledges the highest seq it now holds.
- When every member holds the batch, the primary applies it and sends COMMIT(epoch, seq); the
  secondaries apply their prepared batches up to seq, in order. The pushes of the batch are
  acknowledged to their clients at that decision point (``release_decided``), or, in the strict
  mode, once every member has committed (``release_acknowledged``). A member that does not answer is
  reported to the controller; only after a committed controller entry removed it (a new assignment
  with a new epoch) does the round go on without it.
- In-doubt rounds after a failover: the controller promotes the secondary with the highest
  (epoch, prepared seq). A batch committed anywhere was prepared on every member, hence on the new
  primary, which replicates everything it holds prepared, under its new epoch, as its first rounds;
  it applies a batch only once every member holds it, as for any round (applying earlier would let
  a failure of the new primary leave it with a batch nobody else has). Batches only some secondary
  prepared were never committed anywhere (and never acknowledged); they are dropped.
- Exactly once: every batch lists the (client id, client seq) of its pushes, and every replica
  records them when it applies the batch. A push seen before is not applied again; if its batch was
  committed it is acknowledged at once.
- Joining copies (learners). A copy that joins takes a snapshot at the primary's committed seq C;
  in the same step the primary makes it a *learner*: every later round waits for the learner's
  prepare and commit acks exactly as for a member, so no batch after C is acknowledged without
  it. Once the learner has committed everything the primary committed, the primary reports it
  caught up to the controller; the controller's entry then makes it a member. A learner that
  stops answering before it was reported is simply forgotten (it is no member, nothing waits on
  the controller); once reported, only a committed controller entry removes it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Container, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from adamps.core.replication.values import (  # noqa: F401  (re-exported: the module's public names)
    DEFAULT_DEDUP_LIMIT,
    Apply,
    Assignment,
    Batch,
    ClientKey,
    Dedup,
    Pending,
    Reject,
)

#: committed batches kept per bucket for catching up lagging members (older ones need a snapshot)
DEFAULT_LOG_LIMIT = 1024


@dataclass
class BucketReplica:
    """Replication state of one bucket on one server. Mutated only through its methods."""

    server: str
    bucket: int
    #: the controller's record as this server last learned it
    assignment: Assignment = field(default_factory=lambda: Assignment(0, None))
    #: seq of the last batch applied here
    committed: int = 0
    #: epoch of that batch: (committed_epoch, committed) is the position a copy offers
    committed_epoch: int = 0
    #: seq -> batch, prepared here but not yet committed (secondary side, and in-doubt rounds)
    prepared: dict[int, Batch] = field(default_factory=dict)
    log_limit: int = DEFAULT_LOG_LIMIT
    dedup: Dedup = field(default_factory=Dedup)
    #: committed batches, newest last, for lagging members
    log: deque[Batch] = field(default_factory=deque)
    # -- primary side --
    #: pushes waiting for the next round
    pending: list[Pending] = field(default_factory=list)
    #: the round in flight: its batch and waiters
    inflight: tuple[Batch, list[Pending]] | None = None
    #: member -> highest seq it acknowledged as prepared
    acked_prepare: dict[str, int] = field(default_factory=dict)
    #: member -> highest seq it acknowledged as committed
    acked_commit: dict[str, int] = field(default_factory=dict)
    #: committed locally, waiting for members' commit acks: seq -> waiters
    awaiting_commit: dict[int, list[Pending]] = field(default_factory=dict)
    #: a promoted primary must first re-replicate the in-doubt batches it holds
    needs_recovery: bool = False
    #: in-doubt batch seq -> waiters of clients that retried a push it carries
    doubt_waiters: dict[int, list[Pending]] = field(default_factory=dict)
    #: learner -> "syncing" (forgettable) | "reporting" (a caught-up report in flight or of
    #: unknown outcome: only the controller's record decides) | "reported" (accepted)
    learners: dict[str, str] = field(default_factory=dict)
    #: learner -> the controller's id of its join (a report names the join it is about)
    learner_joins: dict[str, int] = field(default_factory=dict)
    # -- joining side --
    #: this copy installed a snapshot of the current primary and takes its rounds as a learner
    learning: bool = False

    # -- roles ---------------------------------------------------------------------------------

    @property
    def is_primary(self) -> bool:
        return self.assignment.primary == self.server

    @property
    def is_secondary(self) -> bool:
        return self.server in self.assignment.secondaries

    @property
    def replicas(self) -> tuple[str, ...]:
        """Whom the primary's rounds wait for: the recorded secondaries and the learners."""
        if not self.learners:  # the common case, asked several times per bucket per message
            return self.assignment.secondaries
        return self.assignment.secondaries + tuple(
            m for m in self.learners if m not in self.assignment.secondaries
        )

    @property
    def prepared_seq(self) -> int:
        """Highest seq held without a hole (committed, then prepared): what a role-change
        proposal reports. Prepared batches past a hole are of no use and never counted."""
        seq = self.committed
        while seq + 1 in self.prepared:
            seq += 1
        return seq

    @property
    def held_position(self) -> tuple[int, int]:
        """(epoch, seq) of the newest batch this copy holds without a hole, applied or prepared:
        what it offers the controllers, which promote the highest (as Raft compares the last
        entry's term and index). A prepared batch counts: with ``ack = "prepared"`` a batch is
        acknowledged once every member holds it prepared, so a copy that has it must win over
        one that does not."""
        top = self.prepared_seq
        if top == self.committed:
            return self.committed_epoch, top
        return self.prepared[top].epoch, top

    @property
    def in_doubt(self) -> bool:
        """Holds batches prepared and not applied that an earlier primary sent: on a promoted
        primary some may be acknowledged already (``ack = "prepared"``), so its values lack
        pushes a client was told are done until its first rounds have applied them."""
        return self.prepared_seq > self.committed

    def held_prepared(self) -> list[Batch]:
        """The prepared batches counted in ``held_position``, in seq order: a flush writes them
        with the cut, so a copy reloaded from disk still holds what it acknowledged as prepared."""
        return [self.prepared[s] for s in range(self.committed + 1, self.prepared_seq + 1)]

    def on_assignment(self, new: Assignment, keep: Container[str] = ()) -> list[Any]:
        """The controller's record changed. Returns the waiters of pushes this server can no
        longer see through, when it stopped being the primary. Their outcome is UNKNOWN (a batch
        in flight may still be committed by the next primary): the shell answers them with a
        retryable error (not_primary), and the client's retry with the same (client id, seq) is
        applied exactly once wherever the batch ended. Learners in `keep` stay learners if the
        record lacks them (it may be older than the controllers' acceptance of their report)."""
        if new.epoch < self.assignment.epoch:
            return []  # an old message arriving late
        was_primary = self.is_primary
        old_epoch = self.assignment.epoch
        old_primary = self.assignment.primary
        self.assignment = new
        if new.epoch != old_epoch or new.primary != old_primary:
            self.learning = False  # a snapshot of another primary's history
        if not self.is_primary or new.epoch != old_epoch:
            self.learners, self.learner_joins = {}, {}
        else:
            for m in list(self.learners):
                if m in new.secondaries:
                    self.drop_learner(m)  # the controller made it a member (positions kept)
                elif m not in new.joining and self.learners[m] != "reporting" and m not in keep:
                    # Neither joining nor a member: the controller removed it. Not a learner
                    # whose report is in flight: the record may be older than the join it
                    # serves (a heartbeat's answer computed before the copy joined again; the
                    # simulation, seed 1440), and the controllers may accept the report
                    # meanwhile. Their answer decides (a refusal drops it); so does a new epoch.
                    self.drop_learner(m)
        failed: list[Any] = []
        if was_primary and not self.is_primary:
            self.needs_recovery = False
            failed = [p.waiter for p in self.pending]
            if self.inflight is not None:
                failed += [p.waiter for p in self.inflight[1]]
            for waiters in self.awaiting_commit.values():
                failed += [p.waiter for p in waiters]
            for waiters in self.doubt_waiters.values():
                failed += [p.waiter for p in waiters]
            self.pending, self.inflight, self.awaiting_commit, self.doubt_waiters = [], None, {}, {}
        if self.is_primary:
            members = set(self.replicas)
            self.acked_prepare = {m: v for m, v in self.acked_prepare.items() if m in members}
            self.acked_commit = {m: v for m, v in self.acked_commit.items() if m in members}
            if not was_primary or new.epoch != old_epoch:
                # Promoted (or re-leased under a new epoch): finish in-doubt rounds first, and
                # learn each member's position afresh (its first reply tells).
                self.needs_recovery = True
                self.acked_prepare = dict.fromkeys(members, -1)
                self.acked_commit = dict.fromkeys(members, -1)
            if self.inflight is not None and new.epoch != old_epoch:
                # The round in flight was prepared under the old epoch; resend under the new one.
                batch, waiters = self.inflight
                self.inflight = (Batch(batch.seq, new.epoch, batch.updates, batch.clients), waiters)
        return failed

    def recover(self) -> None:
        """A newly promoted primary keeps the in-doubt batches it holds without a hole, re-stamped
        with its epoch: next_round() replicates them before any new batch."""
        self.needs_recovery = False
        top = self.prepared_seq
        epoch = self.assignment.epoch
        self.prepared = {
            s: Batch(s, epoch, b.updates, b.clients) for s, b in self.prepared.items() if s <= top
        }

    # -- primary: client pushes ----------------------------------------------------------------

    def submit(self, update: Any, client: ClientKey | None, waiter: Any) -> Reject | str:
        """A client push. Returns "queued", "duplicate-committed" (ack at once), "duplicate-
        inflight" (the shell waits for the earlier copy) or a Reject."""
        if not self.is_primary:
            return Reject(
                "not_primary",
                f"bucket {self.bucket} has primary {self.assignment.primary!r}",
                self.assignment.epoch,
            )
        seen = self.dedup.batch_of(client)
        if seen is not None:
            return "duplicate-committed"
        if client is not None:
            # A retry of a push that is in a round not yet committed: wait for that round.
            if self.inflight is not None and client in self.inflight[0].clients:
                self.inflight[1].append(Pending(None, client, waiter))
                return "duplicate-inflight"
            for b in self.prepared.values():
                if client in b.clients:
                    self.doubt_waiters.setdefault(b.seq, []).append(Pending(None, client, waiter))
                    return "duplicate-inflight"
            if any(p.client == client for p in self.pending):
                self.pending.append(Pending(None, client, waiter))
                return "duplicate-inflight"
        self.pending.append(Pending(update, client, waiter))
        return "queued"

    def next_round(self) -> Batch | None:
        """Starts the next round if none is in flight and pushes wait. The shell then sends
        prepare_for(member) to every secondary."""
        if self.inflight is not None or not self.is_primary or self.needs_recovery:
            return None
        seq = self.committed + 1
        if seq in self.prepared:  # an in-doubt batch of the previous primary goes first
            # It stays in `prepared` until it is applied: it may be acknowledged already (ack =
            # "prepared"), so this copy must go on holding it if it is deposed meanwhile, and
            # a flush must write it.
            batch = self.prepared[seq]
            self.inflight = (batch, self.doubt_waiters.pop(seq, []))
            return batch
        fresh = [p for p in self.pending if p.update is not None]
        if not fresh:
            return None
        batch = Batch(
            seq,
            self.assignment.epoch,
            tuple(p.update for p in fresh),
            tuple(p.client for p in fresh),
        )
        self.inflight = (batch, self.pending)
        self.pending = []
        return batch

    def prepare_for(self, member: str) -> list[Batch] | None:
        """The entries to send `member` in this round: what it lacks up to the round's batch.
        None when its gap reaches past the log (it needs a snapshot: state transfer)."""
        if self.inflight is None:
            return []
        batch = self.inflight[0]
        have = self.acked_prepare.get(member, -1)
        start = (self.committed if have < 0 else min(have, self.committed)) + 1
        entries = self._log_from(start)
        if entries is None:
            return None
        # A promoted primary's first rounds re-replicate the in-doubt batches it holds, one per
        # round; send the later ones along. A member drops what an earlier epoch prepared above
        # the entries it gets, and with ack = "prepared" such a batch may be acknowledged.
        later = [self.prepared[s] for s in range(batch.seq + 1, self.prepared_seq + 1)]
        return [*entries, batch, *later]

    def _log_from(self, start: int) -> list[Batch] | None:
        if start > self.committed:
            return []
        if not self.log or self.log[0].seq > start:
            return None
        first = self.log[0].seq
        return list(self.log)[start - first :]

    def log_after(self, seq: int) -> list[Batch] | None:
        """Committed batches after `seq` (to bring a lagging member up to date between rounds);
        None when they reach past the log (the member needs a state transfer)."""
        return self._log_from(seq + 1)

    def on_prepare_ack(self, member: str, seq: int) -> bool:
        """A member holds everything up to `seq`. True when every member of the recorded set holds
        the round's batch: the shell then calls commit_round()."""
        self.acked_prepare[member] = max(self.acked_prepare.get(member, -1), seq)
        return self.round_prepared()

    def on_member_position(self, member: str, committed: int) -> None:
        """A member told its committed seq (reply to a prepare that did not fit): resend from there."""
        self.acked_prepare[member] = committed
        self.acked_commit[member] = max(self.acked_commit.get(member, -1), committed)

    def round_prepared(self) -> bool:
        if self.inflight is None:
            return False
        seq = self.inflight[0].seq
        return all(self.acked_prepare.get(m, -1) >= seq for m in self.replicas)

    def commit_round(self) -> Apply:
        """Every member holds the batch: apply it here. The shell then sends COMMIT(epoch, seq)."""
        assert self.inflight is not None and self.round_prepared()
        batch, waiters = self.inflight
        self.inflight = None
        self._committed(batch)
        self.awaiting_commit[batch.seq] = waiters
        return Apply((batch,))

    def release_decided(self) -> list[Any]:
        """Waiters of every batch applied here, whether or not the members confirmed the commit:
        the acknowledgement at the decision point (``ack = "prepared"``). Safe because a batch is
        applied only once every member and learner holds it prepared, and the promotable copy
        with the highest (epoch, prepared seq) commits what it holds prepared as its first
        rounds: every copy the controller may promote next has the batch."""
        done: list[Any] = []
        for seq in sorted(self.awaiting_commit):
            done += [p.waiter for p in self.awaiting_commit.pop(seq)]
        return done

    def on_commit_ack(self, member: str, seq: int) -> list[Any]:
        """A member committed up to `seq`. Returns the waiters now acknowledged by every member."""
        self.acked_commit[member] = max(self.acked_commit.get(member, -1), seq)
        return self.release_acknowledged()

    def release_acknowledged(self) -> list[Any]:
        """Waiters of batches every current member has committed (also after a member's removal)."""
        done: list[Any] = []
        low = min((self.acked_commit.get(m, -1) for m in self.replicas), default=self.committed)
        for seq in sorted(self.awaiting_commit):
            if seq > low:
                break
            done += [p.waiter for p in self.awaiting_commit.pop(seq)]
        return done

    def lagging(self) -> list[str]:
        """Members that have not acknowledged what is in flight or committed (to report if silent)."""
        if self.inflight is not None:
            seq = self.inflight[0].seq
            return [m for m in self.replicas if self.acked_prepare.get(m, -1) < seq]
        return [m for m in self.replicas if self.acked_commit.get(m, -1) < self.committed]

    # -- primary: learners (joining copies) -----------------------------------------------------

    def add_learner(self, member: str, join: int = 0) -> Reject | None:
        """A joining copy takes a snapshot at `committed` now: from here on every round waits for
        it. Refused unless the controller has it joining (as this server last learned). It counts
        as caught up only once it acknowledged a commit itself (it may never install this
        snapshot). A new snapshot of the same join keeps a report's state: only the controller's
        answer may end it."""
        if not self.is_primary:
            return Reject(
                "not_primary", f"bucket {self.bucket}: not its primary", self.assignment.epoch
            )
        if member not in self.assignment.joining:
            return Reject(
                "unavailable",
                f"bucket {self.bucket}: {member!r} is not joining (as far as the primary knows)",
                self.assignment.epoch,
            )
        if self.learner_joins.get(member) != join or member not in self.learners:
            self.learners[member] = "syncing"
        self.learner_joins[member] = join
        self.acked_prepare[member] = self.committed
        self.acked_commit[member] = -1
        return None

    def learners_caught_up(self) -> list[str]:
        """Learners holding every committed batch and not reported yet: report them now (and
        mark them with report_sent)."""
        return [
            m
            for m, state in self.learners.items()
            if state == "syncing" and self.acked_commit.get(m, -1) >= self.committed
        ]

    def report_sent(self, member: str) -> None:
        if member in self.learners:
            self.learners[member] = "reporting"

    def report_done(self, member: str, accepted: bool) -> None:
        """The controller's answer to the caught-up report: accepted (now a member as soon as
        the assignment says so) or refused (forget the learner: it transfers again)."""
        if member not in self.learners:
            return
        if accepted:
            self.learners[member] = "reported"
        else:
            self.drop_learner(member)

    def drop_learner(self, member: str) -> None:
        self.learners.pop(member, None)
        self.learner_joins.pop(member, None)
        if member not in self.assignment.secondaries:
            self.acked_prepare.pop(member, None)
            self.acked_commit.pop(member, None)

    # -- secondary: messages from the primary --------------------------------------------------

    def _check_epoch(self, epoch: int, sender: str) -> Reject | None:
        known = self.assignment.epoch
        if epoch < known:
            return Reject(
                "stale_epoch", f"bucket {self.bucket}: epoch {epoch} < current {known}", known
            )
        if epoch > known:
            return Reject(
                "unavailable",
                f"bucket {self.bucket}: epoch {epoch} not yet known here (have {known})",
                known,
            )
        if sender != self.assignment.primary:
            return Reject(
                "stale_epoch",
                f"bucket {self.bucket}: {sender!r} is not the primary of epoch {epoch}",
                known,
            )
        if not self.is_secondary and not self.learning:
            return Reject(
                "conflict", f"bucket {self.bucket}: {self.server} is not a secondary", known
            )
        return None

    def on_prepare(
        self, sender: str, epoch: int, entries: Sequence[Batch]
    ) -> Reject | tuple[str, int]:
        """PREPARE from the primary. Returns ("ok", highest seq held) or ("gap", committed seq: resend
        from there) or a Reject (unavailable: ask the controller for the new epoch, then retry)."""
        rej = self._check_epoch(epoch, sender)
        if rej is not None:
            return rej
        for b in entries:
            if b.seq <= self.committed:
                continue  # already applied (a resend)
            self.prepared[b.seq] = b  # a resend under a newer epoch replaces the older copy
        # Drop prepared batches above what the primary sends that an earlier epoch's primary
        # prepared: a deposed primary's round that was never committed anywhere (the new primary
        # did not hold it). Never one of this epoch: its primary only appends, and an older
        # PREPARE of it arriving late (delayed or duplicated) must not take back a batch this
        # copy already acknowledged as prepared (the primary may have committed it since).
        top = entries[-1].seq if entries else self.committed
        for s in [s for s, b in self.prepared.items() if s > top and b.epoch < epoch]:
            del self.prepared[s]
        expected = self.committed + 1
        while expected in self.prepared:
            expected += 1
        if any(s > expected for s in self.prepared):
            return ("gap", self.committed)
        return ("ok", expected - 1)

    def on_commit(self, sender: str, epoch: int, seq: int) -> Reject | Apply | tuple[str, int]:
        """COMMIT up to `seq`: the batches to apply, in order, or ("gap", committed)."""
        rej = self._check_epoch(epoch, sender)
        if rej is not None:
            return rej
        if seq <= self.committed:
            return Apply(())
        if any(s not in self.prepared for s in range(self.committed + 1, seq + 1)):
            return ("gap", self.committed)
        return self._commit_prepared_upto(seq)

    def _commit_prepared_upto(self, seq: int) -> Apply:
        batches = []
        for s in range(self.committed + 1, seq + 1):
            b = self.prepared.pop(s)
            self._committed(b)
            batches.append(b)
        return Apply(tuple(batches))

    def _committed(self, batch: Batch) -> None:
        assert batch.seq == self.committed + 1, (batch.seq, self.committed)
        self.committed = batch.seq
        self.committed_epoch = batch.epoch
        self.prepared.pop(batch.seq, None)
        self.dedup.record(batch)
        self.log.append(batch)
        while len(self.log) > self.log_limit:
            self.log.popleft()

    # -- state transfer --------------------------------------------------------------------------

    def snapshot_meta(self) -> dict[str, Any]:
        """What a joining member needs besides the shard values: position and dedup table."""
        return {
            "committed": self.committed,
            "committed_epoch": self.committed_epoch,
            "dedup": self.dedup.to_list(),
        }

    def install_snapshot(
        self, committed: int, dedup: Iterable[Sequence[Any]], committed_epoch: int = 0
    ) -> None:
        """Adopt a snapshot taken at `committed` (the shell installs the values), from the
        primary of the current assignment: from now on this copy takes its rounds (learning)."""
        self.committed = committed
        self.committed_epoch = committed_epoch
        self.prepared = {}
        self.dedup = Dedup.from_list(dedup, self.dedup.limit)
        self.log.clear()
        # Nothing of a role this copy may have had survives: no round, no waiter, no learner.
        self.pending, self.inflight, self.awaiting_commit, self.doubt_waiters = [], None, {}, {}
        self.learners, self.learner_joins, self.needs_recovery = {}, {}, False
        self.learning = True

    def restore(
        self,
        committed: int,
        committed_epoch: int,
        dedup: Iterable[Sequence[Any]],
        prepared: Iterable[Batch] = (),
    ) -> None:
        """A copy reloaded from disk at (committed_epoch, committed), with the batches it held
        prepared at that cut (``held_prepared``): no role until the controller gives one."""
        self.committed = committed
        self.committed_epoch = committed_epoch
        self.dedup = Dedup.from_list(dedup, self.dedup.limit)
        self.prepared = {b.seq: b for b in prepared if b.seq > committed}
