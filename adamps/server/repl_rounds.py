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

from adamps.core.replication import BucketReplica
from adamps.rpc import RpcError
from adamps.server.repl_wire import batch_to_wire

log = logging.getLogger("adamps.server.replicate")

#: seconds a decided round's COMMIT waits (ack = "prepared") for the next PREPARE to carry it
COMMIT_DELAY = 0.002


class PrimaryRounds:
    """Pushes and rounds of the buckets this server is primary of.

    A part of :class:`adamps.server.replicate.Replicator`, which holds the state its methods
    use (``core``, ``buckets``, ``peers``, ``store``, ``m``) and carries out the core's ``Ready``
    (``drain``). Every decision is the core's; this is the IO of the rounds."""

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
                verdict = self.core.round_start(b, time.monotonic())
                if verdict == "stop":
                    return  # no longer primary, or the lease lapsed: a renewal kicks us again
                rep = self.buckets[b]
                if verdict == "idle":
                    if commit_task is not None:
                        await commit_task
                        commit_task = None
                        continue  # pushes may have arrived meanwhile
                    # Idle: bring members that joined (or missed a commit) up to date, so a
                    # quiet bucket's copies are identical and a failover finds nothing missing.
                    for m in rep.lagging():
                        await self._sync_member(b, rep, m)
                    self.core.report_learners(b)
                    self.drain()
                    return
                t0 = time.perf_counter()
                n_pushes = len(rep.inflight[1]) if rep.inflight else 0
                try:
                    if not await self._prepare_all(b, rep):
                        continue  # the assignment changed: loop re-reads the role
                    seq = rep.inflight[0].seq
                    # Applied here in seq order: enqueued to the owner threads before anything
                    # else runs on the loop, so reads and snapshots see whole batches.
                    # The core applies it and, with ack = "prepared", acknowledges its pushes:
                    # the decision point (docs/protocol-ps.md).
                    self.core.decide(b, time.monotonic())
                    self.drain()
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
                    self.core.on_peer_stale()
                    self.drain()
                return False
            except (ConnectionError, TimeoutError, OSError):
                return False
            if reply["status"] == "gap":
                rep.on_member_position(member, int(reply["seq"]))
                continue
            rep.on_prepare_ack(member, int(reply["seq"]))
            if "committed" in reply:
                self.core.on_commit_ack(b, member, int(reply["committed"]), time.monotonic())
                self.drain()
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
        if b in self.buckets:
            self.core.committed_everywhere(b, time.monotonic())
            self.drain()
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
                    self.core.on_commit_ack(b, member, int(reply["seq"]), time.monotonic())
                    self.drain()
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
        self.core.on_commit_ack(b, member, int(reply["seq"]), time.monotonic())
        self.drain()
        return True

    async def _unresponsive(self, b: int, rep: BucketReplica, member: str) -> None:
        """A replica did not answer within member_timeout: the core decides (forget a learner,
        wait for a report's answer, or ask the controllers to drop it). After a drop request the
        round waits up to member_timeout for the record that removes it before trying again."""
        epoch = rep.assignment.epoch
        verdict = self.core.unresponsive(b, member)
        self.drain()
        if verdict == "forgotten":
            log.info("bucket %d: learner %s unresponsive; forgotten", b, member)
        if verdict != "drop":
            return
        deadline = time.monotonic() + self.member_timeout
        while (
            member in rep.assignment.secondaries
            and rep.assignment.epoch == epoch
            and time.monotonic() < deadline
            and not self.closing
        ):
            self.request_heartbeat()
            await asyncio.sleep(0.05)
