"""The controller's replicated state: servers, buckets and leases, layout, replica progress.

Project Adam 3.3.3: the controllers form a consensus group whose replicated state maps buckets to
a primary (via a lease) and secondaries, receives heartbeats, and relocates the buckets of failed
servers evenly. Here the group is Raft (pysyncobj) and the state has two layers:

* `ClusterModel`: plain, deterministic Python. Every mutating method takes `now` (the proposing
  leader's wall clock) as an argument and never reads a clock, never does IO, never raises on
  bad input (it returns ``{"ok": False, "error": code, ...}``): a replicated method that raised
  would stall the Raft apply loop on every replica.
* `ReplicatedCluster`: a pysyncobj consumer whose ``@replicated`` methods take small plain
  arguments and call the model under a lock (HTTP threads read while the Raft thread applies).

Only decisions are replicated. Heartbeat arrivals stay soft state on the leader (controller/
service.py), which turns silence into a committed `declare_dead` and batches lease renewals into
one entry per server per heartbeat. Every lease grant, renewal, hand-off and relocation is a
committed entry; a lease moves to another server only once the old one has certainly expired
(adamps/core/lease.py) or was released by its holder.

Bucket life cycle: `want` is the placement's target ([primary, secondaries...]); `holders` are the
caught-up copies (the replica set the primary replicates to); `joining` are copies being
transferred (they enter the replica set by `caught_up`, which the primary reports once the copy
holds every batch it committed and every later round waits for it). A primary is granted only
to a caught-up copy; a member outside `want` leaves once every wanted copy has caught up.

Copies outlive their server's registration. Every acknowledged batch is on every member of the
replica set, so when the last live member of a bucket leaves it (declared dead, or registered
again as a new incarnation after a restart or a pause), its copy is recorded as a `candidate`:
a copy that may hold every acknowledged batch (in memory after a pause; from LMDB after a crash,
up to its last flush). So is the copy of every member that left within one lease duration
before it (`WAVE`): the members of a crash of every copy leave one by one (each declared dead or
registered again on its own), and any of them may have flushed more than the last one. The
bucket is then *unavailable*: nobody serves it, nothing re-creates it. Servers offer their
copies with (epoch, seq) when they register; once every candidate is back (with its copy, or
without it: then it is no candidate) and the old lease has certainly expired, the most
up-to-date one is granted the lease and the others catch up from it. A candidate that never
comes back keeps the bucket unavailable: only an operator may give up on its copy. A bucket that ever held data is never re-created empty or
from an older copy except by an operator's explicit `write_off` (`POST /buckets/{b}/declare-lost`), which is logged and counted.
"""

from __future__ import annotations

import copy
import logging
import threading
from collections.abc import Callable
from typing import Any

from pysyncobj import SyncObj, SyncObjConf, SyncObjConsumer, replicated

from adamps.core import lease as leases
from adamps.core.lease import Lease, LeaseTerms
from controller import placement
from controller.raft_transport import RaftLimits, transport_class

log = logging.getLogger(__name__)

LIVE, DEAD, DRAINING = "live", "dead", "draining"
#: Members that left a bucket at most this many lease durations before its last live member are
#: candidates with it (one crash of every copy is seen as one leave per server, seconds apart).
WAVE = 1.0
#: Closed leases kept for the safety record (GET /leases); older ones are dropped.
HISTORY_LIMIT = 4096
#: Trainer epochs whose progress is kept.
PROGRESS_EPOCHS = 32


def _err(code: str, message: str, **extra: Any) -> dict[str, Any]:
    return {"ok": False, "error": code, "message": message, **extra}


class ClusterModel:
    """The cluster configuration. Mutated only by the Raft apply thread, through its methods."""

    def __init__(
        self, n_buckets: int, terms: LeaseTerms, replication: int = 3, min_servers: int = 1
    ) -> None:
        self.n_buckets = n_buckets
        self.terms = terms
        self.replication = replication
        #: Servers needed before buckets are first placed (so a starting cluster spreads evenly).
        self.min_servers = min_servers
        #: The replicated clock: the largest `now` applied so far (never goes back).
        self.clock = 0.0
        #: Routing table version: grows on every change of servers, roles or leases' holders.
        self.version = 0
        #: Count of applied mutating entries (for tests and /status).
        self.applied = 0
        #: id -> {"address", "state", "incarnation", "since", "copies"}; copies: bucket -> [epoch,
        #: seq] of the copies the server offered when it registered (this incarnation)
        self.servers: dict[str, dict[str, Any]] = {}
        #: per bucket: {"want", "holders", "joining", "lease", "holder_inc", "candidates", "lost",
        #: "left"}; holders excludes the primary; candidates: servers whose copy may hold every
        #: acknowledged batch while no member is live (see the module docstring); left: member
        #: -> when it left, for the members that left while others stayed (pruned after a WAVE)
        self.buckets: list[dict[str, Any]] = [
            {
                "want": [],
                "holders": [],
                "joining": [],
                "lease": None,
                "holder_inc": 0,
                "candidates": [],
                "lost": False,
                "left": {},
            }
            for _ in range(n_buckets)
        ]
        #: buckets an operator declared lost (each one logged)
        self.declared_lost = 0
        #: ids of joins: each entry into a bucket's `joining` gets the next one, and a caught-up
        #: report names the join it is about (a report of an earlier join is refused)
        self.joins = 0
        #: closed leases (dicts with "bucket"), oldest first
        self.history: list[dict[str, Any]] = []
        self.layout: dict[str, Any] | None = None
        self.layout_version = 0
        #: str(epoch) -> replica id -> {"progress", "done", "at"}
        self.progress: dict[str, dict[str, dict[str, Any]]] = {}

    # -- helpers ---------------------------------------------------------------------------

    def _tick(self, now: float) -> float:
        self.clock = max(self.clock, float(now))
        self.applied += 1
        return self.clock

    def _live(self, sid: str | None) -> bool:
        return sid is not None and self.servers.get(sid, {}).get("state") in (LIVE, DRAINING)

    def primary_of(self, b: int) -> str | None:
        lease = self.buckets[b]["lease"]
        return None if lease is None else lease.holder

    def _holder_live(self, b: int) -> bool:
        """The lease holder is live *in the incarnation the lease was granted to*.

        A server that restarted (registered again) lost its in-memory state: its old leases are
        neither renewed nor trusted; they run out like those of a dead server.
        """
        bk = self.buckets[b]
        lease: Lease | None = bk["lease"]
        if lease is None or not self._live(lease.holder):
            return False
        return self.servers[lease.holder]["incarnation"] == bk["holder_inc"]

    def eligible(self) -> list[str]:
        """Servers that may receive buckets: live and not draining."""
        return sorted(s for s, rec in self.servers.items() if rec["state"] == LIVE)

    def _grant(self, b: int, holder: str, now: float) -> Lease:
        bucket = self.buckets[b]
        prev: Lease | None = bucket["lease"]
        new = leases.grant(prev, holder, now, self.terms)  # raises if prev may be in use
        if prev is not None:
            self.history.append({"bucket": b, **prev.to_dict()})
            if len(self.history) > HISTORY_LIMIT:
                del self.history[: len(self.history) - HISTORY_LIMIT]
            if prev.holder != holder and self._holder_live(b) and prev.holder in bucket["want"]:
                # A hand-off: the old primary stays as a copy, but re-enters the replica set
                # through a state transfer (it may hold batches that were never acknowledged).
                self._start_join(b, prev.holder)
        if holder in bucket["holders"]:
            bucket["holders"].remove(holder)
        if holder in bucket["joining"]:
            bucket["joining"].remove(holder)
        bucket["lease"] = new
        bucket["holder_inc"] = self.servers[holder]["incarnation"]
        self.version += 1
        return new

    def _settle(self, b: int, now: float, reports: dict[str, Any] | None = None) -> None:
        """Carries bucket `b` as far toward its `want` as the rules allow at `now`."""
        bucket = self.buckets[b]
        before = (list(bucket["holders"]), list(bucket["joining"]))
        bucket["holders"] = [s for s in bucket["holders"] if self._live(s)]
        bucket["joining"] = [s for s in bucket["joining"] if self._live(s)]
        left = bucket.get("left")
        if left:  # who left longer ago than a wave is never a candidate: forget it
            bucket["left"] = {
                s: at for s, at in left.items() if now - at <= WAVE * self.terms.duration
            }
        want = bucket["want"]
        self._add_copies(b)
        self._drop_stale_offers(b)
        target = self._grant_target(b, now, reports)
        if target is not None:
            prev = bucket["lease"]
            # A candidate's copy after every member was gone (logged: from LMDB it may lack the
            # updates of its last flush_interval).
            lost = (
                prev is not None
                and target not in bucket["holders"]
                and not (target == prev.holder and self._holder_live(b))
            )
            if lost:
                epoch, seq = self.servers[target].get("copies", {}).get(b, (0, 0))
                log.warning(
                    "bucket %d: no live member left; candidate %s serves its copy (epoch %d, "
                    "seq %d)",
                    b,
                    target,
                    epoch,
                    seq,
                )
            self._grant(b, target, now)
            bucket["candidates"] = []
            bucket["left"] = {}
            if target != want[0] and target in want:
                want.remove(target)
                want.insert(0, target)
            self._add_copies(b)  # a bucket served again: the wanted copies join now
        # Members outside `want` leave once every wanted live copy is in the replica set.
        primary = self.primary_of(b)
        wanted_live = [s for s in want if self._live(s)]
        if all(s == primary or s in bucket["holders"] for s in wanted_live):
            bucket["holders"] = [s for s in bucket["holders"] if s in want]
            bucket["joining"] = [s for s in bucket["joining"] if s in want]
        if before != (bucket["holders"], bucket["joining"]):
            self.version += 1

    def _drop_stale_offers(self, b: int) -> None:
        """A live server holding no role in a served bucket lets its copy go (roles_of lists it
        nowhere): its offer is void from then on."""
        if self.unavailable(b):
            return
        bk = self.buckets[b]
        keep = set(self.live_members(b)) | set(bk["joining"]) | set(bk.get("candidates", []))
        keep |= set(bk.get("left", {}))  # it may become a candidate with the last member
        for s, rec in self.servers.items():
            if s not in keep and b in rec.get("copies", {}):
                del rec["copies"][b]

    def _start_join(self, b: int, sid: str) -> None:
        bk = self.buckets[b]
        self.joins = getattr(self, "joins", 0) + 1
        bk["joining"].append(sid)
        bk.setdefault("join_ids", {})[sid] = self.joins

    def _lease_in_use(self, lease: Lease | None, now: float) -> dict[str, Any] | None:
        """The refusal of a grant while `lease` may still be in use at `now`, else None."""
        if leases.expired(lease, now, self.terms):
            return None
        until = leases.expires_at(lease, self.terms)
        return _err(
            "conflict",
            f"the lease of epoch {lease.epoch} may be in use until {until:.3f}",  # type: ignore[union-attr]
            reason="lease_active",
            retry_after=round(until - now, 3),
        )

    def _add_copies(self, b: int) -> None:
        """Wanted live servers that hold no copy of `b` yet start one: caught up at once in a
        fresh bucket (nothing to copy), else joining (state transfer from the primary). An
        unavailable bucket has nobody to copy from: its copies join once it is served again."""
        bucket = self.buckets[b]
        if self.unavailable(b):
            return
        want = bucket["want"]
        primary = self.primary_of(b) if self._holder_live(b) else None
        for s in want:
            if (
                self._live(s)
                and s != primary
                and s not in bucket["holders"]
                and s not in bucket["joining"]
            ):
                if bucket["lease"] is None:
                    if s != want[0]:
                        bucket["holders"].append(s)
                else:
                    self._start_join(b, s)

    def _grant_target(
        self, b: int, now: float, reports: dict[str, Any] | None = None
    ) -> str | None:
        """Who gets the next lease of bucket `b` at `now`, if anyone may (read-only)."""
        bucket = self.buckets[b]
        want = bucket["want"]
        lease: Lease | None = bucket["lease"]
        if not want or not leases.expired(lease, now, self.terms):
            return None
        holder_ok = self._holder_live(b) and lease is not None and lease.released_at is None
        if holder_ok and lease.holder == want[0]:  # type: ignore[union-attr]
            return None  # expired but still wanted: it renews on its next heartbeat
        if lease is None:
            return want[0]  # a fresh bucket: no copy holds anything yet
        if want[0] in bucket["holders"] and self._live(want[0]):
            return want[0]
        if holder_ok:
            return None  # a hand-off waits until the target has caught up
        best = self._best_copy(b, reports)
        if best is not None:
            return best
        # No live member is left: the most up-to-date candidate that is back with its copy. None
        # back: the bucket stays unavailable (never re-created empty, never from an older copy).
        return self._best_candidate(b)

    def _wave(self, b: int, now: float) -> list[str]:
        """Members that left bucket `b` within WAVE lease durations before `now`, and whose copy
        may still exist: not yet back, or back offering it."""
        out = []
        for s, at in self.buckets[b].get("left", {}).items():
            rec = self.servers.get(s)
            if rec is None or now - at > WAVE * self.terms.duration:
                continue
            if rec["state"] == DEAD or b in rec.get("copies", {}):
                out.append(s)
        return out

    def _best_candidate(self, b: int) -> str | None:
        """The candidate of bucket `b` that offered the highest (epoch, seq), once every
        candidate is back: until then any of the missing ones may hold the newest copy."""
        bucket = self.buckets[b]
        cands = bucket.get("candidates", [])
        if not cands or not all(self._live(s) for s in cands):
            return None
        cands = [s for s in cands if b in self.servers[s].get("copies", {})]
        if not cands:
            return None
        want = bucket["want"]

        def key(s: str) -> tuple:
            epoch, seq = self.servers[s]["copies"][b]
            return (-epoch, -seq, want.index(s) if s in want else len(want), s)

        return min(cands, key=key)

    def live_members(self, b: int, exclude: str | None = None) -> list[str]:
        """The live members of bucket `b`'s replica set (primary in its incarnation, holders)."""
        bk = self.buckets[b]
        out = [self.primary_of(b)] if self._holder_live(b) else []
        out += [s for s in bk["holders"] if self._live(s)]
        return [s for s in out if s != exclude]

    def unavailable(self, b: int) -> bool:
        """Bucket `b` held data once and no live member of its replica set is left to serve it
        (until a candidate is back, or an operator declares it lost)."""
        return self.buckets[b]["lease"] is not None and not self.live_members(b)

    def grants_due(self, now: float) -> list[int]:
        """Buckets whose lease `reconcile(now)` would grant (the leader asks before proposing)."""
        return [b for b in range(self.n_buckets) if self._grant_target(b, now) is not None]

    def _best_copy(self, b: int, reports: dict[str, Any] | None) -> str | None:
        """The caught-up copy with the highest reported (epoch, seq); ties by placement, id."""
        bucket = self.buckets[b]
        cands = [s for s in bucket["holders"] if self._live(s)]
        if not cands:
            return None
        reports = reports or {}
        want = bucket["want"]

        def key(s: str) -> tuple:
            r = reports.get(s) or (0, 0)
            return (-int(r[0]), -int(r[1]), want.index(s) if s in want else len(want), s)

        return min(cands, key=key)

    def _replan(self, now: float, reports: dict[int, dict[str, Any]] | None = None) -> None:
        """New placement targets over the eligible servers, then settle every bucket."""
        eligible = self.eligible()
        placed = any(bk["want"] or bk["lease"] for bk in self.buckets)
        if not placed and len(eligible) < self.min_servers:
            return
        current = {}
        for b, bk in enumerate(self.buckets):
            p = [self.primary_of(b)] if self._holder_live(b) else []
            current[b] = p + bk["holders"] + bk["joining"]
        target = placement.place(self.n_buckets, current, eligible, self.replication)
        for b, bk in enumerate(self.buckets):
            bk["want"] = list(target[b])
            self._settle(b, now, (reports or {}).get(b))
        self.version += 1

    # -- replicated operations (called through ReplicatedCluster) ----------------------------

    def register(
        self,
        sid: str,
        address: str,
        now: float,
        copies: dict[int, list[int]] | None = None,
    ) -> dict[str, Any]:
        """A server (re)starts, or comes back after it was declared dead: a new incarnation,
        which offers the copies it holds (bucket -> [epoch, seq], from memory or LMDB). Its old
        incarnation leaves every replica set; where that leaves a bucket without a live member,
        its copy becomes a candidate (`_leave`). A copy it no longer offers is no candidate."""
        now = self._tick(now)
        rec = self.servers.get(sid)
        if rec is not None and rec["state"] != DEAD:
            self._leave(sid, now)
        state = DRAINING if rec is not None and rec["state"] == DRAINING else LIVE
        offered = {
            int(b): [int(p[0]), int(p[1])]
            for b, p in (copies or {}).items()
            if 0 <= int(b) < self.n_buckets
        }
        self.servers[sid] = {
            "address": address,
            "state": state,
            "incarnation": (rec["incarnation"] + 1) if rec else 1,
            "since": now,
            "copies": offered,
        }
        for b, bk in enumerate(self.buckets):
            if sid in bk.get("candidates", []) and b not in offered:
                bk["candidates"].remove(sid)
                log.warning("bucket %d: candidate %s came back without its copy", b, sid)
        self._replan(now)
        return {"ok": True, "server": sid, **self.servers[sid]}

    def _leave(self, sid: str, now: float) -> None:
        """The current incarnation of `sid` leaves every replica set (declared dead, or replaced
        by a new incarnation). Where it was the last live member, its copy is a candidate, and
        so are the copies of the members that left shortly before it (`_wave`)."""
        for b, bk in enumerate(self.buckets):
            member = (self.primary_of(b) == sid and self._holder_live(b)) or sid in bk["holders"]
            if member and not self.live_members(b, exclude=sid):
                cands = bk.setdefault("candidates", [])
                for s in [*self._wave(b, now), sid]:
                    if s not in cands:
                        cands.append(s)
                bk["left"] = {}
            elif member:
                bk.setdefault("left", {})[sid] = now
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
            return _err("not_found", f"no server {sid!r}")
        if rec["state"] == DEAD:
            return {"ok": True, "server": sid, "state": DEAD, "changed": False}
        self._leave(sid, now)
        rec["state"] = DEAD
        rec["since"] = now
        self._replan(now, reports)
        return {"ok": True, "server": sid, "state": DEAD, "changed": True}

    def renew(self, sid: str, now: float) -> dict[str, Any]:
        """Renews every lease `sid` holds (one entry per server per heartbeat round).

        A lease whose bucket is being handed over (its target primary has caught up) is not
        renewed: it runs out, then the target gets the next epoch.
        """
        now = self._tick(now)
        rec = self.servers.get(sid)
        if rec is None:
            return _err("not_found", f"no server {sid!r}")
        if rec["state"] == DEAD:
            return _err("conflict", f"server {sid!r} was declared dead; register again", state=DEAD)
        renewed = []
        for b, bk in enumerate(self.buckets):
            lease: Lease | None = bk["lease"]
            if lease is None or lease.holder != sid or lease.released_at is not None:
                continue
            if bk["holder_inc"] != rec["incarnation"]:
                continue  # granted to an earlier incarnation: it runs out
            want = bk["want"]
            if want and want[0] != sid and want[0] in bk["holders"]:
                continue  # hand-off pending
            bk["lease"] = leases.renew(lease, sid, lease.epoch, now)
            renewed.append([b, lease.epoch])
        return {"ok": True, "renewed": renewed, "at": now}

    def reconcile(
        self, now: float, reports: dict[int, dict[str, Any]] | None = None
    ) -> dict[str, Any]:
        """Grants every lease that may be granted at `now` (expired hand-offs and failures)."""
        now = self._tick(now)
        before = self.version
        reports = reports or {}
        for b in range(self.n_buckets):
            self._settle(b, now, reports.get(b))
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
            return _err("unknown_bucket", f"no bucket {b}")
        bk = self.buckets[b]
        lease: Lease | None = bk["lease"]
        if sid not in bk["holders"]:
            return _err("conflict", f"{sid!r} is not a caught-up secondary of bucket {b}")
        epoch = 0 if lease is None else lease.epoch
        if prev_epoch != epoch:
            return _err(
                "stale_epoch", f"bucket {b} is at epoch {epoch}, not {prev_epoch}", epoch=epoch
            )
        busy = self._lease_in_use(lease, now)
        if busy is not None:
            return busy
        chosen = self._best_copy(b, reports)
        if chosen is None:
            return _err("conflict", f"bucket {b} has no live caught-up secondary")
        new = self._grant(b, chosen, now)
        want = bk["want"]
        if chosen in want:
            want.remove(chosen)
        want.insert(0, chosen)
        del want[self.replication :]
        self._settle(b, now)
        return {"ok": True, "bucket": b, "primary": chosen, "epoch": new.epoch}

    def caught_up(self, b: int, sid: str, epoch: int, now: float) -> dict[str, Any]:
        """The previous release's report, sent by the joining copy itself. Kept only so that a
        journal written by that release replays as it was applied; new reports are
        `verified_caught_up`."""
        now = self._tick(now)
        if not 0 <= b < self.n_buckets:
            return _err("unknown_bucket", f"no bucket {b}")
        bk = self.buckets[b]
        lease: Lease | None = bk["lease"]
        if lease is None or lease.epoch != epoch:
            return _err(
                "stale_epoch", f"bucket {b} is at epoch {0 if lease is None else lease.epoch}"
            )
        if sid not in bk["joining"]:
            return _err("conflict", f"{sid!r} is not joining bucket {b}")
        bk["joining"].remove(sid)
        bk["holders"].append(sid)
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
            return _err("unknown_bucket", f"no bucket {b}")
        bk = self.buckets[b]
        lease: Lease | None = bk["lease"]
        if (
            lease is None
            or lease.epoch != epoch
            or lease.holder != primary
            or not self._holder_live(b)
        ):
            return _err(
                "stale_epoch",
                f"{primary!r} is not the primary of epoch {epoch} of bucket {b}",
                epoch=0 if lease is None else lease.epoch,
            )
        ids = bk.setdefault("join_ids", {})
        if (
            join is not None
            and sid in bk["holders"]
            and bk.setdefault("joined", {}).get(sid) == join
        ):
            return {"ok": True, "bucket": b, "server": sid, "repeated": True}  # a retried report
        if sid not in bk["joining"]:
            return _err("conflict", f"{sid!r} is not joining bucket {b}")
        if join is not None and ids.get(sid) != join:
            return _err("conflict", f"join {join} of {sid!r} is over (now {ids.get(sid)})")
        bk["joining"].remove(sid)
        bk.setdefault("joined", {})[sid] = ids.pop(sid, None)
        bk["holders"].append(sid)
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
            return _err("unknown_bucket", f"no bucket {b}")
        bk = self.buckets[b]
        lease: Lease | None = bk["lease"]
        if (
            lease is None
            or lease.holder != primary
            or lease.epoch != epoch
            or not self._holder_live(b)
        ):
            return _err("stale_epoch", f"{primary!r} does not hold epoch {epoch} of bucket {b}")
        changed = False
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
            return _err("unknown_bucket", f"no bucket {b}")
        bk = self.buckets[b]
        lease: Lease | None = bk["lease"]
        if lease is None or lease.holder != sid or lease.epoch != epoch:
            return _err("stale_epoch", f"{sid!r} does not hold epoch {epoch} of bucket {b}")
        bk["lease"] = leases.release(lease, sid, epoch, now)
        self._settle(b, now)
        return {"ok": True, "bucket": b}

    def write_off(self, b: int, now: float) -> dict[str, Any]:
        """An operator gives up on the acknowledged updates of unavailable bucket `b`: the most
        up-to-date copy any live server offered serves it, or else it restarts from the tensors'
        initial values. Logged and counted; the bucket is flagged `lost` for good."""
        now = self._tick(now)
        if not 0 <= b < self.n_buckets:
            return _err("unknown_bucket", f"no bucket {b}")
        bk = self.buckets[b]
        if not self.unavailable(b):
            return _err("conflict", f"bucket {b} is not unavailable: nothing to declare lost")
        busy = self._lease_in_use(bk["lease"], now)
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
            return _err("conflict", f"no live server to take bucket {b}")
        bk["candidates"] = []
        bk["left"] = {}
        bk["holders"], bk["joining"] = [], []
        self._grant(b, target, now)
        if target in bk["want"]:
            bk["want"].remove(target)
        bk["want"].insert(0, target)
        del bk["want"][self.replication :]
        bk["lost"] = True
        self.declared_lost = getattr(self, "declared_lost", 0) + 1
        log.warning(
            "bucket %d declared LOST by an operator: %s serves it from its %s", b, target, source
        )
        self._settle(b, now)
        return {"ok": True, "bucket": b, "primary": target, "from": source}

    def drain(self, sid: str, now: float) -> dict[str, Any]:
        now = self._tick(now)
        rec = self.servers.get(sid)
        if rec is None:
            return _err("not_found", f"no server {sid!r}")
        if rec["state"] == DEAD:
            return _err("conflict", f"server {sid!r} is dead")
        rec["state"] = DRAINING
        rec["since"] = now
        self._replan(now)
        return {"ok": True, "server": sid, "state": DRAINING}

    def rebalance(self, now: float) -> dict[str, Any]:
        now = self._tick(now)
        self._replan(now)
        return {"ok": True, "version": self.version}

    def set_layout(self, layout: dict[str, Any], now: float) -> dict[str, Any]:
        now = self._tick(now)
        if layout.get("n_buckets") != self.n_buckets:
            return _err(
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
        per = self.progress.setdefault(str(epoch), {})
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
        del self.servers[sid]
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

    # -- queries (read-only; callers hold the lock) ---------------------------------------------

    def under_replicated(self) -> int:
        """Buckets with fewer caught-up live copies than the replication factor."""
        return sum(1 for b in range(self.n_buckets) if len(self.holders_of(b)) < self.replication)

    def holders_of(self, b: int) -> list[str]:
        """Caught-up live copies, primary first."""
        bk = self.buckets[b]
        out = [self.primary_of(b)] if self._holder_live(b) else []
        return out + [s for s in bk["holders"] if self._live(s)]

    def bucket_view(self, b: int) -> dict[str, Any]:
        bk = self.buckets[b]
        lease: Lease | None = bk["lease"]
        p = None if lease is None else lease.holder
        return {
            "bucket": b,
            "primary": p,
            "address": self.servers.get(p, {}).get("address") if p else None,
            "epoch": 0 if lease is None else lease.epoch,
            "secondaries": list(bk["holders"]),
            "joining": list(bk["joining"]),
            "want": list(bk["want"]),
            "lease": None
            if lease is None
            else {**lease.to_dict(), "expires_at": leases.expires_at(lease, self.terms)},
            "lost": bk["lost"],
            "candidates": list(bk.get("candidates", [])),
            "state": "unavailable" if self.unavailable(b) else "ok",
        }

    def routing(self) -> dict[str, Any]:
        buckets = []
        for b in range(self.n_buckets):
            v = self.bucket_view(b)
            entry = {k: v[k] for k in ("bucket", "primary", "address", "epoch", "secondaries")}
            entry["state"] = v["state"]
            if v["state"] == "unavailable":  # nobody to send to: no primary to try
                entry.update(primary=None, address=None, secondaries=[])
            buckets.append(entry)
        return {
            "version": self.version,
            "n_buckets": self.n_buckets,
            "buckets": buckets,
            "servers": {
                s: rec["address"] for s, rec in self.servers.items() if rec["state"] != DEAD
            },
            "layout_version": self.layout_version,
        }

    def roles_of(self, sid: str) -> list[dict[str, Any]]:
        out = []
        offered = self.servers.get(sid, {}).get("copies", {})
        for b, bk in enumerate(self.buckets):
            if self.primary_of(b) == sid and self._holder_live(b):
                role = "primary"
            elif sid in bk["holders"]:
                role = "secondary"
            elif sid in bk.get("candidates", []) or (b in offered and self.unavailable(b)):
                # Keep the copy, serve nothing: it may be the freshest one there is (a
                # candidate), or what an operator's declare-lost (write_off) picks.
                role = "standby"
            elif sid in bk["joining"]:
                role = "joining"
            elif b in offered and sid in bk.get("left", {}):
                role = "standby"  # left shortly before: a candidate if the last member leaves
            else:
                continue
            view = self.bucket_view(b)
            view["role"] = role
            view["secondary_addresses"] = {
                s: self.servers.get(s, {}).get("address")
                for s in view["secondaries"] + view["joining"]
            }
            if role == "joining":
                view["join"] = bk.get("join_ids", {}).get(sid, 0)
            out.append(view)
        return out

    def lease_records(self) -> list[dict[str, Any]]:
        """Every lease in the record (closed ones, then the current ones)."""
        current = [
            {"bucket": b, **bk["lease"].to_dict()}
            for b, bk in enumerate(self.buckets)
            if bk["lease"]
        ]
        return [*self.history, *current]

    def cluster_view(self) -> dict[str, Any]:
        per_server: dict[str, dict[str, int]] = {
            s: {"primary": 0, "secondary": 0, "joining": 0} for s in self.servers
        }
        for b in range(self.n_buckets):
            v = self.bucket_view(b)
            if v["primary"] in per_server:
                per_server[v["primary"]]["primary"] += 1
            for s in v["secondaries"]:
                per_server.setdefault(s, {"primary": 0, "secondary": 0, "joining": 0})[
                    "secondary"
                ] += 1
            for s in v["joining"]:
                per_server.setdefault(s, {"primary": 0, "secondary": 0, "joining": 0})[
                    "joining"
                ] += 1
        servers = {}
        for s, rec in sorted(self.servers.items()):
            counts = per_server.get(s, {})
            state = rec["state"]
            if state == DRAINING and not any(counts.values()):
                state = "drained"
            servers[s] = {**rec, "state": state, **counts}
        return {
            "version": self.version,
            "n_buckets": self.n_buckets,
            "replication": self.replication,
            "clock": self.clock,
            "lease_terms": self.terms.to_dict(),
            "servers": servers,
            "buckets": [self.bucket_view(b) for b in range(self.n_buckets)],
            "under_replicated": self.under_replicated(),
            "unassigned": sum(1 for b in range(self.n_buckets) if not self._holder_live(b)),
            "unavailable": [b for b in range(self.n_buckets) if self.unavailable(b)],
            "lost": [b for b in range(self.n_buckets) if self.buckets[b]["lost"]],
            "declared_lost": getattr(self, "declared_lost", 0),
            "layout_version": self.layout_version,
        }


class ReplicatedCluster(SyncObjConsumer):
    """The Raft-replicated face of `ClusterModel`: one @replicated method per operation.

    Arguments are small plain values; `now` is supplied by the caller (the leader's wall clock).
    Readers call `read(fn)`, which runs `fn(model)` under the lock the apply thread also takes.
    """

    def __init__(self, model: ClusterModel) -> None:
        super().__init__()
        self._lock = threading.RLock()
        self._model = model

    # pysyncobj dumps what _serialize returns at log compaction and restores it on restart.
    def _serialize(self) -> dict[str, Any]:
        with self._lock:
            return {"model": copy.deepcopy(self._model)}

    def _deserialize(self, data: dict[str, Any]) -> None:
        with self._lock:
            self._model = data["model"]

    def read(self, fn: Callable[[ClusterModel], Any]) -> Any:
        with self._lock:
            return fn(self._model)

    def _apply(self, name: str, *args: Any) -> dict[str, Any]:
        with self._lock:
            try:
                return getattr(self._model, name)(*args)
            except Exception as exc:  # a bug must not wedge the apply loop of every replica
                log.exception("replicated %s%r failed", name, args)
                return _err("internal", f"{type(exc).__name__}: {exc}")

    @replicated
    def register(
        self, sid: str, address: str, now: float, copies: dict | None = None
    ) -> dict[str, Any]:
        return self._apply("register", sid, address, now, copies)

    @replicated
    def declare_dead(self, sid: str, now: float, reports: dict | None = None) -> dict[str, Any]:
        return self._apply("declare_dead", sid, now, reports)

    @replicated
    def renew(self, sid: str, now: float) -> dict[str, Any]:
        return self._apply("renew", sid, now)

    @replicated
    def reconcile(self, now: float, reports: dict | None = None) -> dict[str, Any]:
        return self._apply("reconcile", now, reports)

    @replicated
    def role_change(
        self, b: int, sid: str, prev_epoch: int, reports: dict, now: float
    ) -> dict[str, Any]:
        return self._apply("role_change", b, sid, prev_epoch, reports, now)

    @replicated
    def caught_up(self, b: int, sid: str, epoch: int, now: float) -> dict[str, Any]:
        # The previous release's entry (the journal replays it); new reports: verified_caught_up.
        return self._apply("caught_up", b, sid, epoch, now)

    @replicated
    def drop_secondary(
        self, b: int, primary: str, epoch: int, sid: str, now: float
    ) -> dict[str, Any]:
        return self._apply("drop_secondary", b, primary, epoch, sid, now)

    @replicated
    def release(self, b: int, sid: str, epoch: int, now: float) -> dict[str, Any]:
        return self._apply("release", b, sid, epoch, now)

    @replicated
    def drain(self, sid: str, now: float) -> dict[str, Any]:
        return self._apply("drain", sid, now)

    @replicated
    def rebalance(self, now: float) -> dict[str, Any]:
        return self._apply("rebalance", now)

    @replicated
    def set_layout(self, layout: dict, now: float) -> dict[str, Any]:
        return self._apply("set_layout", layout, now)

    # pysyncobj numbers replicated methods by sorted name (within a `ver`), and the journal
    # stores the numbers: a new method must sort after every existing one, or a journal written
    # by the previous version replays as the wrong operations (tests/core/test_raft_method_ids.py).
    @replicated
    def sweep_dead(self, sid: str, dead_before: float, now: float) -> dict[str, Any]:
        return self._apply("sweep_dead", sid, dead_before, now)

    # Issue 11's operations. Their names sort after every earlier one (see above); `ver` is no
    # way out: pysyncobj enables a higher `ver` only after an explicit setCodeVersion.
    @replicated
    def verified_caught_up(
        self, b: int, primary: str, epoch: int, sid: str, now: float, join: int | None = None
    ) -> dict[str, Any]:
        return self._apply("verified_caught_up", b, primary, epoch, sid, now, join)

    @replicated
    def write_off(self, b: int, now: float) -> dict[str, Any]:
        return self._apply("write_off", b, now)

    @replicated
    def report_progress(
        self, epoch: int, replica: str, progress: float, done: bool, now: float
    ) -> dict[str, Any]:
        return self._apply("report_progress", epoch, replica, progress, done, now)


def raft_conf(
    *,
    password: str,
    journal_file: str,
    dump_file: str,
    fast: bool = True,
    **overrides: Any,
) -> SyncObjConf:
    """pysyncobj settings: always a password, a journal AND a full dump, fast elections.

    Timings: a follower starts an election 0.3-0.9 s after the last append from the leader, so a
    new leader is normally in place within ~1-2 s of a crash; a leader that hears from no
    majority for 1 s steps down (the default 30 s would let a cut-off leader believe it leads).
    """
    if not password:
        raise ValueError("pysyncobj needs a password: its port carries pickled data")
    if not journal_file or not dump_file:
        raise ValueError("both a journal file and a full-dump file are required")
    opts: dict[str, Any] = {
        "password": password,
        "journalFile": journal_file,
        "fullDumpFile": dump_file,
        # Fork-free dumps: the controller also runs an aiohttp thread, and the state is small.
        "useFork": False,
        "commandsWaitLeader": False,
        "dynamicMembershipChange": False,
    }
    if fast:
        opts.update(
            raftMinTimeout=0.3,
            raftMaxTimeout=0.9,
            appendEntriesPeriod=0.05,
            connectionTimeout=1.5,
            connectionRetryTime=0.3,
            leaderFallbackTimeout=1.0,
            autoTickPeriod=0.02,
        )
    opts.update(overrides)
    return SyncObjConf(**opts)


def make_node(
    self_addr: str,
    partners: list[str],
    cluster: ReplicatedCluster,
    conf: SyncObjConf,
    limits: RaftLimits | None = None,
) -> SyncObj:
    """A Raft node on `self_addr` (host:port) replicating `cluster` with `partners`, on the
    bounded transport (bound to its own address; controller/raft_transport.py)."""
    return SyncObj(
        self_addr,
        partners,
        conf=conf,
        consumers=[cluster],
        transportClass=transport_class(limits or RaftLimits()),
    )
