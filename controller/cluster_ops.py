"""The operations of the controllers' model, one per replicated entry (called through
``controller.state.ReplicatedCluster``): registrations, deaths, renewals, role changes, joins,
drains, layout and progress. Each takes `now` from the proposing leader and answers a refusal
(``{"ok": False, ...}``) instead of raising."""

from __future__ import annotations

import copy
import logging
from typing import Any

from adamps.core import lease as leases
from adamps.core.lease import Lease
from controller.cluster_rules import (
    DEAD,
    DRAINING,
    LIVE,
    PROGRESS_EPOCHS,
    PROGRESS_REPLICAS,
    PROGRESS_REPLICAS_PER_RUN,
    refusal,
    shared_storage_fault,
)

log = logging.getLogger("controller.state")


class Operations:
    """The mutating operations of the model.

    A part of :class:`controller.state.ClusterModel`, which holds the records its methods read
    and change (``servers``, ``buckets``, ``history``, ...): plain, deterministic, no clock, no
    IO, never raises on bad input."""

    def register(
        self,
        sid: str,
        address: str,
        now: float,
        copies: dict[int, list[int]] | None = None,
        rack: str | None = None,
    ) -> dict[str, Any]:
        """A server (re)starts, or comes back after it was declared dead: a new incarnation,
        which offers the copies it holds (bucket -> [epoch, seq], from memory or LMDB). Its old
        incarnation leaves every replica set; where that leaves a bucket without a live member,
        its copy becomes a candidate (`_leave`). A copy it no longer offers is no candidate.
        `rack`: its failure domain (issue 26), which placement keeps copies apart by; None or
        empty: a rack of its own (an entry of an earlier release carries none)."""
        now = self._tick(now)
        rec = self.servers.get(sid)
        # The buckets this server may figure in (indexes, supersets): nothing else changes
        # (issue 26's scale simulation: a pass over every bucket per registration was 1e8
        # steps for 1,000 servers registering over 100,000 buckets).
        near = set(self.leased_to(sid)) | set(self.touching(sid))
        if rec is not None and rec["state"] != DEAD:
            self._leave(sid, now)
        state = DRAINING if rec is not None and rec["state"] == DRAINING else LIVE
        offered = {
            int(b): [int(p[0]), int(p[1])]
            for b, p in (copies or {}).items()
            if 0 <= int(b) < self.n_buckets
        }
        # The digests of the offered copies' values at their committed seq, where the server
        # sent them: compared between candidates that tie on (epoch, seq) (issue 29).
        digests = {
            int(b): [int(p[2]), str(p[3])]
            for b, p in (copies or {}).items()
            if 0 <= int(b) < self.n_buckets and len(p) >= 4
        }
        for b in (rec or {}).get("copies", {}):  # the old incarnation's offers are replaced
            self._offer(sid, b, False)
        for b in offered:
            self._offer(sid, b, True)
        self.servers[sid] = {
            "address": address,
            "state": state,
            "incarnation": (rec["incarnation"] + 1) if rec else 1,
            "since": now,
            "copies": offered,
            "digests": digests,
        }
        if rack:
            self.servers[sid]["rack"] = str(rack)
        if rec is not None and state == DRAINING and "drain_floor" in rec:
            self.servers[sid]["drain_floor"] = rec["drain_floor"]
        for b in sorted(near):
            bk = self.buckets[b]
            if sid in bk.get("candidates", []) and b not in offered:
                bk["candidates"].remove(sid)
                log.warning("bucket %d: candidate %s came back without its copy", b, sid)
        self._replan(now, touched=near)
        return {"ok": True, "server": sid, **self.servers[sid]}

    def _leave(self, sid: str, now: float) -> None:
        """The current incarnation of `sid` leaves every replica set (declared dead, or replaced
        by a new incarnation). Where it was the last live member, its copy is a candidate, and
        so are the copies of the members that left shortly before it (`_wave`). Visits only
        the buckets the indexes name for `sid` (see `register`)."""
        for b in sorted(set(self.leased_to(sid)) | set(self.touching(sid))):
            bk = self.buckets[b]
            self._mark(b)
            member = (self.primary_of(b) == sid and self.holder_live(b)) or sid in bk["holders"]
            if member and not self.live_members(b, exclude=sid):
                cands = bk.setdefault("candidates", [])
                for s in [*self._wave(b, now), sid]:
                    if s not in cands:
                        cands.append(s)
                        self._touch(s, b)
                bk["left"] = {}
                self._maybe_unavailable(b)
            elif member:
                bk.setdefault("left", {})[sid] = now
                self._touch(sid, b)
            if sid in bk["holders"]:
                bk["holders"].remove(sid)
            if sid in bk["joining"]:
                bk["joining"].remove(sid)

    def declare_dead(
        self, sid: str, now: float, reports: dict[int, dict[str, Any]] | None = None
    ) -> dict[str, Any]:
        """A server stayed silent past its timeout: its copies go, its buckets are re-placed.

        Where it was primary the lease stays recorded until it has certainly expired; then the
        best caught-up secondary is promoted (by this entry if already expired, else by a later
        `reconcile`).
        """
        now = self._tick(now)
        rec = self.servers.get(sid)
        if rec is None:
            return refusal("not_found", f"no server {sid!r}")
        if rec["state"] == DEAD:
            return {"ok": True, "server": sid, "state": DEAD, "changed": False}
        near = set(self.leased_to(sid)) | set(self.touching(sid))
        self._leave(sid, now)
        rec["state"] = DEAD
        rec["since"] = now
        self._replan_lost(now, reports, near)  # its buckets only (issue 40)
        return {"ok": True, "server": sid, "state": DEAD, "changed": True}

    def reconcile(
        self, now: float, reports: dict[int, dict[str, Any]] | None = None
    ) -> dict[str, Any]:
        """Grants every lease that may be granted at `now` (expired hand-offs and failures), and
        lets draining servers whose hold passed leave the buckets that no longer need them."""
        now = self._tick(now)
        before = self.version
        reports = reports or {}
        offers = self._offers_by_bucket()
        # What time alone changes: leases that may now be granted, and the buckets of draining
        # servers whose hold passed; plus the buckets with offered copies (stale offers go).
        # Every other bucket's record is as the entry that last changed it settled it
        # (issue 26's scale simulation: settling 100,000 buckets took seconds per reconcile).
        due = {b for b in self.unsettled() if self._grant_target(b, now, reports.get(b))}
        for s in self.holds_due(now):
            due |= set(self.leased_to(s)) | set(self.touching(s))
        due |= set(offers)
        for b in sorted(due):
            self._settle(b, now, reports.get(b), offers)
        for rec in self.servers.values():  # a passed drain hold needs no more reconciles
            if rec.get("hold_until", now + 1) <= now:
                del rec["hold_until"]
        return {"ok": True, "changed": self.version != before}

    def role_change(
        self, b: int, sid: str, prev_epoch: int, reports: dict[str, Any], now: float
    ) -> dict[str, Any]:
        """A secondary missed the primary's heartbeats and proposes to take over (Adam 3.3.3).

        Accepted only if the proposal names the current lease and that lease has certainly
        expired; then the caught-up secondary with the highest reported (epoch, seq) wins.
        """
        now = self._tick(now)
        if not 0 <= b < self.n_buckets:
            return refusal("unknown_bucket", f"no bucket {b}")
        bk = self.buckets[b]
        lease = self.lease_of(b)  # its renewal time: the holder's last round (server_leases)
        if sid not in bk["holders"]:
            return refusal("conflict", f"{sid!r} is not a caught-up secondary of bucket {b}")
        epoch = 0 if lease is None else lease.epoch
        if prev_epoch != epoch:
            return refusal(
                "stale_epoch", f"bucket {b} is at epoch {epoch}, not {prev_epoch}", epoch=epoch
            )
        busy = self._lease_in_use(lease, now)
        if busy is not None:
            return busy
        chosen = self._best_copy(b, reports)
        if chosen is None:
            return refusal("conflict", f"bucket {b} has no live caught-up secondary")
        new = self._grant(b, chosen, now)
        self._set_want(b, [chosen, *(s for s in bk["want"] if s != chosen)][: self.replication])
        self._settle(b, now)
        return {"ok": True, "bucket": b, "primary": chosen, "epoch": new.epoch}

    def caught_up(self, b: int, sid: str, epoch: int, now: float) -> dict[str, Any]:
        """The previous release's report, sent by the joining copy itself. Kept only so that a
        journal written by that release replays as it was applied; new reports are
        `verified_caught_up`."""
        now = self._tick(now)
        if not 0 <= b < self.n_buckets:
            return refusal("unknown_bucket", f"no bucket {b}")
        bk = self.buckets[b]
        lease: Lease | None = bk["lease"]
        if lease is None or lease.epoch != epoch:
            return refusal(
                "stale_epoch", f"bucket {b} is at epoch {0 if lease is None else lease.epoch}"
            )
        if sid not in bk["joining"]:
            return refusal("conflict", f"{sid!r} is not joining bucket {b}")
        bk["joining"].remove(sid)
        bk["holders"].append(sid)
        self._touch(sid, b)
        self.version += 1
        self._settle(b, now)
        return {"ok": True, "bucket": b, "server": sid}

    def verified_caught_up(
        self, b: int, primary: str, epoch: int, sid: str, now: float, join: int | None = None
    ) -> dict[str, Any]:
        """The primary of `epoch` reports that joining copy `sid` holds every batch it committed
        and that its rounds already wait for `sid`: from now on every acknowledged batch is on
        it, so it may enter the replica set (and be promoted)."""
        now = self._tick(now)
        if not 0 <= b < self.n_buckets:
            return refusal("unknown_bucket", f"no bucket {b}")
        bk = self.buckets[b]
        lease: Lease | None = bk["lease"]
        if (
            join is not None
            and sid in bk["holders"]
            and bk.setdefault("joined", {}).get(sid) == join
        ):
            # A retried report of a join already accepted: "ok" whatever happened since (the
            # primary declared dead, a new epoch). Refused, the primary took the copy for no
            # member and acknowledged rounds it lacked, while the record held it as one
            # (simulation seed 970500: the first answer lost, the retry after declare_dead).
            return {"ok": True, "bucket": b, "server": sid, "repeated": True}
        if (
            lease is None
            or lease.epoch != epoch
            or lease.holder != primary
            or not self.holder_live(b)
        ):
            return refusal(
                "stale_epoch",
                f"{primary!r} is not the primary of epoch {epoch} of bucket {b}",
                epoch=0 if lease is None else lease.epoch,
            )
        ids = bk.setdefault("join_ids", {})
        if sid not in bk["joining"]:
            return refusal("conflict", f"{sid!r} is not joining bucket {b}")
        if join is not None and ids.get(sid) != join:
            return refusal("conflict", f"join {join} of {sid!r} is over (now {ids.get(sid)})")
        bk["joining"].remove(sid)
        bk.setdefault("joined", {})[sid] = ids.pop(sid, None)
        bk["holders"].append(sid)
        self._touch(sid, b)
        self.version += 1
        self._settle(b, now)
        return {"ok": True, "bucket": b, "server": sid}

    def drop_secondary(
        self, b: int, primary: str, epoch: int, sid: str, now: float
    ) -> dict[str, Any]:
        """The primary removes an unresponsive secondary before acknowledging without it. Only a
        primary live in the incarnation its lease was granted to: one declared dead (or
        restarted) may be a paused process waking up, whose drop would take the last live copy
        out of the replica set."""
        now = self._tick(now)
        if not 0 <= b < self.n_buckets:
            return refusal("unknown_bucket", f"no bucket {b}")
        bk = self.buckets[b]
        lease: Lease | None = bk["lease"]
        if (
            lease is None
            or lease.holder != primary
            or lease.epoch != epoch
            or not self.holder_live(b)
        ):
            return refusal("stale_epoch", f"{primary!r} does not hold epoch {epoch} of bucket {b}")
        changed = False
        self._mark(b)
        for key in ("holders", "joining"):
            if sid in bk[key]:
                bk[key].remove(sid)
                changed = True
        if changed:
            self.version += 1
            if self._live(sid) and sid in bk["want"]:
                self._start_join(b, sid)  # it may come back, through a state transfer
        return {"ok": True, "bucket": b, "removed": changed}

    def release(self, b: int, sid: str, epoch: int, now: float) -> dict[str, Any]:
        """The holder gives its lease back (it has stopped writing): the hand-off need not wait."""
        now = self._tick(now)
        if not 0 <= b < self.n_buckets:
            return refusal("unknown_bucket", f"no bucket {b}")
        bk = self.buckets[b]
        lease = self.lease_of(b)  # released no earlier than its last renewal (server_leases)
        if lease is None or lease.holder != sid or lease.epoch != epoch:
            return refusal("stale_epoch", f"{sid!r} does not hold epoch {epoch} of bucket {b}")
        bk["lease"] = leases.release(lease, sid, epoch, now)
        self._settle(b, now)
        return {"ok": True, "bucket": b}

    def write_off(self, b: int, now: float) -> dict[str, Any]:
        """An operator gives up on the acknowledged updates of unavailable bucket `b`: the most
        up-to-date copy any live server offered serves it, or else it restarts from the tensors'
        initial values. Logged and counted; the bucket is flagged `lost` for good."""
        now = self._tick(now)
        if not 0 <= b < self.n_buckets:
            return refusal("unknown_bucket", f"no bucket {b}")
        bk = self.buckets[b]
        if not self.unavailable(b):
            return refusal("conflict", f"bucket {b} is not unavailable: nothing to declare lost")
        busy = self._lease_in_use(self.lease_of(b), now)
        if busy is not None:
            return busy
        offers = [
            (-p[0], -p[1], s)
            for s, rec in self.servers.items()
            if rec["state"] == LIVE and (p := rec.get("copies", {}).get(b)) is not None
        ]
        eligible = self.eligible()
        if offers:
            target, source = min(offers)[2], "copy"
        elif eligible:
            want = bk["want"]
            target = want[0] if want and want[0] in eligible else eligible[0]
            source = "initial values"
        else:
            return refusal("conflict", f"no live server to take bucket {b}")
        bk["candidates"] = []
        bk["left"] = {}
        bk["holders"], bk["joining"] = [], []
        self._grant(b, target, now)
        self._set_want(b, [target, *(s for s in bk["want"] if s != target)][: self.replication])
        bk["lost"] = True
        self.declared_lost = getattr(self, "declared_lost", 0) + 1
        log.warning(
            "bucket %d declared LOST by an operator: %s serves it from its %s", b, target, source
        )
        self._settle(b, now)
        return {"ok": True, "bucket": b, "primary": target, "from": source}

    def drain(self, sid: str, now: float, hold: float = 0.0, back: bool = False) -> dict[str, Any]:
        """An operator takes `sid` out of service (`back`: returns it, see `undrain`).

        Its buckets move away: new copies join first, primaries move once their targets caught
        up. It stays a member of each bucket (a secondary, still caught up) until two things
        hold, so that `drained` is never shown while a bucket it left has a copy fewer than the
        drain planned (issue 26: a primary killed 0.1 s before a drain was still `live` when
        the drain let go of the copies, and its death then left one copy):

        * `hold` seconds have passed since the drain (the leader passes the time a silent
          server needs to be declared dead: a server that failed with the drain is known dead
          first);
        * the bucket has, among its wanted live members, the `drain_floor` copies the drain
          planned: min(replication, servers left to place on). A death does not lower it (the
          drain then waits for a server to come back or be added); another drain does.

        The entry of both directions is one replicated method (`drain`): a new method name
        would renumber the journal's methods (tests/core/test_raft_method_ids.py)."""
        if back:
            return self.undrain(sid, now)
        now = self._tick(now)
        rec = self.servers.get(sid)
        if rec is None:
            return refusal("not_found", f"no server {sid!r}")
        if rec["state"] == DEAD:
            return refusal("conflict", f"server {sid!r} is dead")
        rec["state"] = DRAINING
        rec["since"] = now
        rec["hold_until"] = now + max(0.0, float(hold))
        floor = min(self.replication, len(self.eligible()))
        for other in self.servers.values():
            if other["state"] == DRAINING:  # this drain lowers what earlier drains wait for
                other["drain_floor"] = min(other.get("drain_floor", floor), floor)
        self._replan(now)
        return {"ok": True, "server": sid, "state": DRAINING}

    def undrain(self, sid: str, now: float) -> dict[str, Any]:
        """A draining (or drained) server returns to service: it may receive buckets again
        (placement recomputed, few moves). A live server is left as it is."""
        now = self._tick(now)
        rec = self.servers.get(sid)
        if rec is None:
            return refusal("not_found", f"no server {sid!r}")
        if rec["state"] == DEAD:
            return refusal("conflict", f"server {sid!r} is dead; it registers as live when back")
        changed = rec["state"] == DRAINING
        rec["state"] = LIVE
        rec.pop("hold_until", None)
        rec.pop("drain_floor", None)
        if changed:
            rec["since"] = now
            self._replan(now)
        return {"ok": True, "server": sid, "state": LIVE, "changed": changed}

    def write_storage(
        self, sid: str, not_durable: str | None, now: float, hold: float = 0.0
    ) -> dict[str, Any]:
        """A server reports whether it can persist (issue 29): while its flushes fail or stall
        past max_unflushed (`not_durable` says why) it takes no bucket and its primaries and
        copies move to servers that can, as from a draining server; once it flushes again it
        is eligible again.

        Its copies leave as a drained server's do (`_drain_keeps`): not before `hold` seconds
        (the time a silent server needs to be declared dead) nor while a bucket has fewer
        wanted live members than could be placed. Its memory holds every acknowledged batch:
        dropping it at once, with the primary crashed but not yet known dead, lost what that
        primary acknowledged after its last flush (the replication simulation, seed 927421)."""
        now = self._tick(now)
        rec = self.servers.get(sid)
        if rec is None:
            return refusal("not_found", f"no server {sid!r}")
        reason = None if not_durable is None else str(not_durable)[:300]
        if rec.get("not_durable") != reason:
            if reason is None:
                rec.pop("not_durable", None)
                if rec["state"] == LIVE:  # (a draining server keeps its drain's hold and floor)
                    rec.pop("hold_until", None)
                    rec.pop("drain_floor", None)
                log.warning("server %s can persist again", sid)
            else:
                rec["not_durable"] = reason
                if rec["state"] == LIVE:
                    rec["hold_until"] = now + max(0.0, float(hold))
                    rec["drain_floor"] = min(self.replication, len(self.eligible()))
                live = [r for r in self.servers.values() if r["state"] == LIVE]
                durable = sum(1 for r in live if not r.get("not_durable"))
                if shared_storage_fault(len(live), durable):
                    log.error("server %s cannot persist (%s), nor can %d of %d live servers: a "
                              "shared cause, no bucket moves for it", sid, reason,
                              len(live) - durable, len(live))  # fmt: skip
                else:
                    log.error("server %s cannot persist (%s): its buckets move", sid, reason)
            self._replan(now)
        return {"ok": True, "server": sid, "not_durable": reason}

    def rebalance(self, now: float) -> dict[str, Any]:
        now = self._tick(now)
        self._replan(now)
        return {"ok": True, "version": self.version}

    def set_layout(self, layout: dict[str, Any], now: float) -> dict[str, Any]:
        now = self._tick(now)
        if layout.get("n_buckets") != self.n_buckets:
            return refusal(
                "conflict",
                f"layout has {layout.get('n_buckets')} buckets, the cluster {self.n_buckets}",
            )
        if self.layout != layout:
            self.layout = copy.deepcopy(layout)
            self.layout_version += 1
        return {"ok": True, "layout_version": self.layout_version}

    def report_progress(
        self, epoch: int, replica: str, progress: float, done: bool, now: float
    ) -> dict[str, Any]:
        now = self._tick(now)
        per = self.progress.get(str(epoch), {})
        if replica not in per:
            run = replica.partition("/")[0] if "/" in replica else ""
            mine = sum(1 for r in per if (r.partition("/")[0] if "/" in r else "") == run)
            if mine >= PROGRESS_REPLICAS_PER_RUN or len(per) >= PROGRESS_REPLICAS:
                who = f"run {run!r}" if run else "the operator's replicas"
                return refusal(
                    "too_large",
                    f"epoch {epoch} holds the progress of {mine} replicas of {who} and "
                    f"{len(per)} in all: the board keeps at most {PROGRESS_REPLICAS_PER_RUN} "
                    f"per run and {PROGRESS_REPLICAS} per epoch",
                    limit=PROGRESS_REPLICAS_PER_RUN,
                )
        per = self.progress.setdefault(str(epoch), per)
        per[replica] = {"progress": progress, "done": bool(done), "at": now}
        if len(self.progress) > PROGRESS_EPOCHS:
            for key in sorted(self.progress, key=int)[: len(self.progress) - PROGRESS_EPOCHS]:
                del self.progress[key]
        return {"ok": True, "epoch": epoch, "replicas": len(per)}

    def sweep_dead(self, sid: str, dead_before: float, now: float) -> dict[str, Any]:
        """Forgets the record of a server dead since before `dead_before` that no bucket refers
        to (issue 12: records of bogus registrations were kept forever). A no-op otherwise."""
        now = self._tick(now)
        rec = self.servers.get(sid)
        if rec is None or rec["state"] != DEAD or rec["since"] > dead_before:
            return {"ok": True, "server": sid, "forgotten": False}
        if self.refers_to(sid):
            return {"ok": True, "server": sid, "forgotten": False}
        for b in rec.get("copies", {}):
            self._offer(sid, b, False)
        del self.servers[sid]
        self._renewals().pop(sid, None)  # no lease names it, so none follows it
        self.version += 1
        return {"ok": True, "server": sid, "forgotten": True}

    def refers_to(self, sid: str) -> bool:
        """Some bucket names `sid` in any field (placement, copies, lease)."""
        for bk in self.buckets:
            for v in bk.values():
                if v == sid or (isinstance(v, list | tuple | set) and sid in v):
                    return True
                if getattr(v, "holder", None) == sid:
                    return True
        return False
