"""The primary side of replication: client pushes into rounds, and the rounds of two-phase
commit to the bucket's members (Project Adam 3.3.3).

One round in flight per bucket, many pushes per round: PREPARE to every member of the recorded
replica set, apply once all hold the batch and acknowledge the pushes (``ack = "prepared"``, the
decision point), COMMIT; with ``ack = "committed"`` the pushes are acknowledged once all committed.
Either way only while the lease holds. A member that does not answer within ``member_timeout`` is reported
to the controller (``drop-secondary``); the round goes on without it only under the new
assignment the controller committed. Learners that caught up are reported ``caught-up``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from typing import Any

from adamps.client.rpc import RpcError
from adamps.core.replication import BucketReplica, Reject
from adamps.protocol import ProtocolError
from adamps.server.repl_wire import batch_to_wire, not_primary

log = logging.getLogger("adamps.server.replicate")

#: seconds a decided round's COMMIT waits (ack = "prepared") for the next PREPARE to carry it
COMMIT_DELAY = 0.002


class PrimaryRounds:
    """Pushes and rounds of the buckets this server is primary of.

    A part of :class:`adamps.server.replicate.Replicator`, which holds the state its methods
    use (``buckets``, ``roles``, ``leases``, ``peers``, ``controller``, ``store``, ``m``)."""

    async def push(
        self, by_bucket: dict[int, list[dict[str, Any]]], client: tuple[str, int] | None
    ) -> None:
        """Replicates one client push (its updates grouped by bucket); returns once every
        bucket's round is decided (``ack = "prepared"``) or committed by every member."""
        loop = asyncio.get_running_loop()
        reps = {b: self.check_primary(b) for b in by_bucket}  # all or nothing: check first
        futs = []
        for b, updates in by_bucket.items():
            fut = loop.create_future()
            verdict = reps[b].submit(tuple(updates), client, fut)
            if isinstance(verdict, Reject):
                raise ProtocolError(verdict.code, verdict.message, bucket=b, epoch=verdict.epoch)
            if verdict == "duplicate-committed":
                self.m.dedup.inc()
                fut.set_result(None)
            elif verdict == "duplicate-inflight":
                self.m.dedup.inc()
            self.kick(b)
            futs.append(fut)
        try:
            await asyncio.wait_for(asyncio.gather(*futs), self.cfg.push_timeout)
        except TimeoutError:
            raise ProtocolError(
                "timeout",
                f"replication did not complete within {self.cfg.push_timeout}s; outcome unknown",
            ) from None

    def kick(self, b: int) -> None:
        task = self.round_tasks.get(b)
        if task is None or task.done():
            self.round_tasks[b] = asyncio.create_task(self._rounds(b), name=f"rounds-{b}")

    async def _rounds(self, b: int) -> None:
        """Runs rounds of bucket b while this server is its primary and work waits.

        Rounds are pipelined two deep: the PREPARE of round k+1 overlaps the COMMIT of round k
        (with ack = "committed", pushes of round k are acknowledged only once every member
        committed it; members apply batches in seq order whatever order the messages arrive in)."""
        commit_task: asyncio.Task | None = None
        try:
            while not self.closing:
                rep = self.buckets.get(b)
                if rep is None or self.roles.get(b) != "primary":
                    return
                if rep.needs_recovery:
                    rep.recover()
                if rep.inflight is None:
                    if not self.leases.can_write(b, rep.assignment.epoch, time.monotonic()):
                        return  # the next heartbeat's renewal kicks us again
                    if rep.next_round() is None:
                        if commit_task is not None:
                            await commit_task
                            commit_task = None
                            continue  # pushes may have arrived meanwhile
                        # Idle: bring members that joined (or missed a commit) up to date, so a
                        # quiet bucket's copies are identical and a failover finds nothing missing.
                        for m in rep.lagging():
                            await self._sync_member(b, rep, m)
                        self._report_learners(b, rep)
                        return
                t0 = time.perf_counter()
                n_pushes = len(rep.inflight[1]) if rep.inflight else 0
                try:
                    if not await self._prepare_all(b, rep):
                        continue  # the assignment changed: loop re-reads the role
                    seq = rep.inflight[0].seq
                    # Applied here in seq order: enqueued to the owner threads before anything
                    # else runs on the loop, so reads and snapshots see whole batches.
                    self.apply_batches(rep.commit_round())
                    if self.cfg.ack == "prepared":
                        # The decision point: every member holds the batch prepared, so every
                        # copy the controller may promote next commits it (docs/protocol-ps.md).
                        self._release(b, rep, rep.release_decided())
                    if commit_task is not None:
                        await commit_task  # at most one commit phase in flight
                    commit_task = asyncio.create_task(
                        self._commit_all(b, rep, seq, t0, n_pushes), name=f"commit-{b}-{seq}"
                    )
                except asyncio.CancelledError:
                    raise
                except Exception:
                    log.exception("bucket %d: round failed", b)
                    await asyncio.sleep(0.1)
        finally:
            if commit_task is not None and not commit_task.done():
                commit_task.cancel()

    async def _prepare_all(self, b: int, rep: BucketReplica) -> bool:
        """Until every member holds the round's batch. False when the assignment changed."""
        epoch = rep.assignment.epoch
        started = time.monotonic()
        while not rep.round_prepared():
            if (
                rep.assignment.epoch != epoch
                or self.roles.get(b) != "primary"
                or rep.inflight is None
            ):
                return False
            todo = [m for m in rep.replicas if rep.acked_prepare.get(m, -1) < rep.inflight[0].seq]
            results = await asyncio.gather(
                *(self._prepare_one(b, rep, m) for m in todo), return_exceptions=True
            )
            failed = [m for m, r in zip(todo, results, strict=True) if r is not True]
            if not failed:
                continue
            if time.monotonic() - started > self.member_timeout:
                for m in failed:
                    await self._unresponsive(b, rep, m)
                started = time.monotonic()
            else:
                await asyncio.sleep(0.02)
        return True

    async def _prepare_one(self, b: int, rep: BucketReplica, member: str) -> bool:
        for _ in range(3):
            if rep.inflight is None:
                return False
            entries = rep.prepare_for(member)
            if entries is None:
                # Too far behind for the log: it must transfer state again; the controller puts
                # it back as joining once we drop it.
                return False
            try:
                reply = await self.peers.channel(member).call(
                    "repl_prepare",
                    bucket=b,
                    epoch=rep.assignment.epoch,
                    sender=self.server_id,
                    entries=[batch_to_wire(e) for e in entries],
                    # What is decided rides along: the member applies it, no COMMIT needed.
                    commit=rep.committed,
                )
            except RpcError as exc:
                if exc.code == "stale_epoch":
                    self.m.stale.inc()
                    self.request_heartbeat()
                return False
            except (ConnectionError, TimeoutError, OSError):
                return False
            if reply["status"] == "gap":
                rep.on_member_position(member, int(reply["seq"]))
                continue
            rep.on_prepare_ack(member, int(reply["seq"]))
            if "committed" in reply:
                self._release(b, rep, rep.on_commit_ack(member, int(reply["committed"])))
            return True
        return False

    async def _commit_all(
        self, b: int, rep: BucketReplica, seq: int, t0: float, n_pushes: int
    ) -> None:
        """COMMIT to every member; acknowledges pushes as members confirm. A member that does not
        confirm within member_timeout is dropped (its pushes are released once it is removed)."""
        epoch = rep.assignment.epoch
        if self.cfg.ack == "prepared":
            # Nothing waits for the COMMIT: give the next round's PREPARE, which carries it, a
            # moment to go first (one message per member per round instead of two).
            await asyncio.sleep(COMMIT_DELAY)
        started = time.monotonic()
        while True:
            waiting = [m for m in rep.replicas if rep.acked_commit.get(m, -1) < seq]
            if not waiting or rep.assignment.epoch != epoch or self.roles.get(b) != "primary":
                break
            results = await asyncio.gather(
                *(self._commit_one(b, rep, m, seq) for m in waiting), return_exceptions=True
            )
            failed = [m for m, r in zip(waiting, results, strict=True) if r is not True]
            if failed and time.monotonic() - started > self.member_timeout:
                for m in failed:
                    await self._unresponsive(b, rep, m)
                started = time.monotonic()
            elif failed:
                await asyncio.sleep(0.02)
        self._release(b, rep, rep.release_acknowledged())
        self._report_learners(b, rep)
        self.m.round_seconds.observe(time.perf_counter() - t0)
        self.m.round_pushes.observe(n_pushes)

    async def _sync_member(
        self, b: int, rep: BucketReplica, member: str, upto: int | None = None
    ) -> bool:
        """COMMIT up to `upto` (default: our position); a member that lacks batches says where
        it stands and gets them from the log (PREPARE of committed batches), then the COMMIT
        again."""
        for _ in range(3):
            try:
                reply = await self.peers.channel(member).call(
                    "repl_commit",
                    bucket=b,
                    epoch=rep.assignment.epoch,
                    sender=self.server_id,
                    seq=rep.committed if upto is None else min(upto, rep.committed),
                )
                if reply["status"] == "ok":
                    self._release(b, rep, rep.on_commit_ack(member, int(reply["seq"])))
                    return True
                position = int(reply["seq"])
                rep.on_member_position(member, position)
                entries = rep.log_after(position)
                if entries is None:
                    return False  # beyond the log: dropping it makes it transfer state again
                await self.peers.channel(member).call(
                    "repl_prepare",
                    bucket=b,
                    epoch=rep.assignment.epoch,
                    sender=self.server_id,
                    entries=[batch_to_wire(e) for e in entries],
                )
            except (RpcError, ConnectionError, TimeoutError, OSError):
                return False
        return False

    async def _commit_one(self, b: int, rep: BucketReplica, member: str, seq: int) -> bool:
        try:
            reply = await self.peers.channel(member).call(
                "repl_commit", bucket=b, epoch=rep.assignment.epoch, sender=self.server_id, seq=seq
            )
        except RpcError as exc:
            if exc.code == "stale_epoch":
                self.m.stale.inc()
                self.request_heartbeat()
            return False
        except (ConnectionError, TimeoutError, OSError):
            return False
        if reply["status"] == "gap":
            # It lacks batches (a learner whose prepare raced its snapshot, or a restart): bring
            # it up from the log, then commit again.
            rep.on_member_position(member, int(reply["seq"]))
            return await self._sync_member(b, rep, member, seq)
        self._release(b, rep, rep.on_commit_ack(member, int(reply["seq"])))
        return True

    def _release(self, b: int, rep: BucketReplica, waiters: Iterable[Any]) -> None:
        """Acknowledges the pushes of batches every replica committed, but only while this
        server's lease of the bucket holds: past it another copy may already be acknowledging
        under the next epoch. Then their outcome is unknown to the client (`primary_changed`);
        its retry is answered by the next primary, which has the batch (exactly once)."""
        waiters = [f for f in waiters if isinstance(f, asyncio.Future) and not f.done()]
        if not waiters:
            return
        if self.leases.can_write(b, rep.assignment.epoch, time.monotonic()):
            for fut in waiters:
                fut.set_result(None)
            return
        why = "the lease ended before the acknowledgement; the push's outcome is unknown"
        for fut in waiters:
            fut.set_exception(not_primary(rep, b, self.addresses, why, code="primary_changed"))

    async def _unresponsive(self, b: int, rep: BucketReplica, member: str) -> None:
        """A replica did not answer within member_timeout. A learner not yet reported caught up
        is no member: forget it (it transfers again). One whose report awaits the controller's
        answer is waited for. A member, or a learner the controller accepted, leaves only by a
        committed controller entry."""
        state = rep.learners.get(member)
        if state == "syncing":
            log.info("bucket %d: learner %s unresponsive; forgotten", b, member)
            rep.drop_learner(member)
            return
        if state == "reporting":
            return
        if await self._drop_secondary(b, rep, member) and member in rep.learners:
            rep.drop_learner(member)

    def _report_learners(self, b: int, rep: BucketReplica) -> None:
        """Learners that hold every committed batch: report them caught up (once)."""
        for m in rep.learners_caught_up():
            rep.report_sent(m)
            asyncio.create_task(self._report_caught_up(b, rep, m, rep.assignment.epoch))

    async def _report_caught_up(self, b: int, rep: BucketReplica, member: str, epoch: int) -> None:
        """Reports a learner caught up, in its join. An answer of unknown outcome is no refusal
        (the entry may have committed): ask again (a repeated report of one join is accepted)
        until the controllers answer, or the record moves on without this primary."""
        join = rep.learner_joins.get(member, 0)
        while not self.closing:
            accepted: bool | None
            try:
                await self.controller.caught_up(b, self.server_id, epoch, member, join)
                log.info(
                    "bucket %d: %s caught up at seq %d (epoch %d)", b, member, rep.committed, epoch
                )
                accepted = True
            except RpcError as exc:
                if exc.code in ("no_quorum", "timeout", "unavailable", "internal"):
                    accepted = None
                else:
                    log.info("bucket %d: caught-up of %s refused: %s", b, member, exc)
                    accepted = False
            except (ConnectionError, TimeoutError, OSError):
                accepted = None
            if (
                rep.assignment.epoch != epoch
                or not rep.is_primary
                or rep.learners.get(member) != "reporting"
                or rep.learner_joins.get(member, 0) != join
            ):
                # The record moved on (on_assignment settles the learner), or the copy joined
                # again meanwhile: that join's own report decides, not this older one's answer.
                break
            if accepted is not None:
                rep.report_done(member, accepted)
                break
            await asyncio.sleep(0.2)
        self.request_heartbeat()

    async def _drop_secondary(self, b: int, rep: BucketReplica, member: str) -> bool:
        """Reports an unresponsive member; waits for the controller's new assignment. True when
        the controller removed it."""
        log.warning(
            "bucket %d: secondary %s unresponsive; asking the controller to drop it", b, member
        )
        self.m.dropped.inc()
        epoch = rep.assignment.epoch
        try:
            await self.controller.drop_secondary(b, self.server_id, epoch, member)
        except (RpcError, ConnectionError, TimeoutError) as exc:
            log.warning("bucket %d: drop-secondary %s refused or failed: %s", b, member, exc)
            self.request_heartbeat()
            return False
        # Learn the new replica set (a committed controller entry) before going on without it.
        deadline = time.monotonic() + self.member_timeout
        while (
            member in rep.assignment.secondaries
            and rep.assignment.epoch == epoch
            and time.monotonic() < deadline
            and not self.closing
        ):
            self.request_heartbeat()
            await asyncio.sleep(0.05)
        return True
