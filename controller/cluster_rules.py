"""The rules of the controllers' model: who may hold a bucket's lease and when, which copies
join, which members leave, and which copies are candidates when no member is left. Pure: every
rule takes `now` from the caller (see controller/state.py)."""

from __future__ import annotations

import logging
from typing import Any

from adamps.core import lease as leases
from adamps.core.lease import Lease
from controller import placement

log = logging.getLogger("controller.state")

LIVE, DEAD, DRAINING = "live", "dead", "draining"
#: Members that left a bucket at most this many lease durations before its last live member are
#: candidates with it (one crash of every copy is seen as one leave per server, seconds apart).
WAVE = 1.0
#: Closed leases kept for the safety record (GET /leases); older ones are dropped.
HISTORY_LIMIT = 4096
#: Trainer epochs whose progress is kept.
PROGRESS_EPOCHS = 32
#: Replicas of one run (the part of a replica's name before '/'; the operator's names have
#: none) whose progress one epoch keeps, and of all runs (issue 39: the board took any number,
#: 1,500 posted were 255 KB of Raft state). A new replica past either is refused (413).
PROGRESS_REPLICAS_PER_RUN = 256
PROGRESS_REPLICAS = 1024


def shared_storage_fault(live: int, durable: int) -> bool:
    """Whether servers that cannot persist are a strict majority of the `live` ones (`durable`
    of them can): a cause they share, which moves no bucket.

    Most live servers unable to persist at once is not one server's disk but something under
    them all (an overloaded machine, one volume): moving every bucket onto the few left cures
    nothing, leaves each bucket copies short, and moves them all again as servers recover
    (issue 39: three servers starved of CPU reported "the disk stalls" together, their buckets
    moved, and one stayed without a primary for a minute). Each server then keeps its buckets
    (refusing pushes while it cannot persist); with a durable majority, those of the others
    move to it, as before (issue 29)."""
    return 2 * (live - durable) > live


def refusal(code: str, message: str, **extra: Any) -> dict[str, Any]:
    """A replicated method's answer when it refuses (it never raises: see controller/state.py)."""
    return {"ok": False, "error": code, "message": message, **extra}


class BucketRules:
    """Leases, replica sets and candidates of the buckets.

    A part of :class:`controller.state.ClusterModel`, which holds the records its methods read
    and change (``servers``, ``buckets``, ``history``, ...): plain, deterministic, no clock, no
    IO, never raises on bad input."""

    def _tick(self, now: float) -> float:
        self.clock = max(self.clock, float(now))
        self.applied += 1
        self._sync_follows()  # the buckets the entry before changed (controller/server_leases.py)
        return self.clock

    def _live(self, sid: str | None) -> bool:
        return sid is not None and self.servers.get(sid, {}).get("state") in (LIVE, DRAINING)

    def leased_to(self, sid: str) -> list[int]:
        """The buckets whose lease names `sid` (any incarnation, released or not), ascending.

        From an index kept beside the state (never pickled: rebuilt on first use, so a dump of
        an earlier release loads as it was): one heartbeat's renewal visits the server's own
        leases, not every bucket (issue 26's scale simulation: 1,000 servers renewing every
        second over 100,000 buckets were 1e8 steps per second of the apply thread)."""
        index = self.__dict__.get("_leased")
        if index is None:
            index = {}
            for b, bk in enumerate(self.buckets):
                if bk["lease"] is not None:
                    index.setdefault(bk["lease"].holder, set()).add(b)
            self._leased = index
        return sorted(index.get(sid, ()))

    def touching(self, sid: str) -> set[int]:
        """The buckets where `sid` may be a secondary, a joining copy, a candidate or a member
        that left: a superset (entries are added as `sid` enters those lists, and pruned by
        `roles_of` once it is in none). Beside the state like `leased_to`: a heartbeat's roles
        read these buckets, not every bucket (issue 26's scale simulation: during a recovery,
        when every heartbeat reads its roles, 100 servers x 10,000 buckets already took more
        than the leader's one CPU second per second)."""
        index = self.__dict__.get("_touching")
        if index is None:
            index = {}
            for b, bk in enumerate(self.buckets):
                for s in (
                    *bk["holders"],
                    *bk["joining"],
                    *bk.get("candidates", []),
                    *bk.get("left", {}),
                ):
                    index.setdefault(s, set()).add(b)
            self._touching = index
        return index.setdefault(sid, set())

    def _maybe_unavailable(self, b: int) -> None:
        """Bucket `b` lost its last live member: `unavailable_buckets` looks at it."""
        index = self.__dict__.get("_unavail")
        if index is not None:
            index.add(b)

    def _mark(self, b: int) -> None:
        """Bucket `b`'s record changes in this entry: the heartbeat answers' deltas
        (`Views.changed_since`) and the leader's `grants_due` look at it again. Derived indexes
        beside the state, like `leased_to`: a no-op until they are first read."""
        self._recheck(b)  # whether its lease follows its holder's renewals (server_leases.py)
        d = self.__dict__
        if "_dirty" in d:
            d["_dirty"].add(b)
        if "_unsettled" in d:
            d["_unsettled"].add(b)

    def _touch(self, sid: str, b: int) -> None:
        """`sid` enters a list of bucket `b` that `touching` covers."""
        index = self.__dict__.get("_touching")
        if index is not None:
            index.setdefault(sid, set()).add(b)

    def primary_of(self, b: int) -> str | None:
        lease = self.buckets[b]["lease"]
        return None if lease is None else lease.holder

    def holder_live(self, b: int) -> bool:
        """The lease holder is live *in the incarnation the lease was granted to*.

        A server that restarted (registered again) lost its in-memory state: its old leases are
        neither renewed nor trusted; they run out like those of a dead server.
        """
        bk = self.buckets[b]
        lease: Lease | None = bk["lease"]
        if lease is None or not self._live(lease.holder):
            return False
        return self.servers[lease.holder]["incarnation"] == bk["holder_inc"]

    def racks(self) -> dict[str, str]:
        """server -> rack, for the servers that named one (issue 26)."""
        return {s: rec["rack"] for s, rec in self.servers.items() if rec.get("rack")}

    def eligible(self) -> list[str]:
        """Servers that may receive buckets: live and not draining, and able to persist (issue
        29: a server whose flushes fail or stall is drained) unless most of them cannot
        (`shared_storage_fault`: then nothing moves for storage)."""
        live = sorted(s for s, rec in self.servers.items() if rec["state"] == LIVE)
        durable = [s for s in live if not self.servers[s].get("not_durable")]
        return live if shared_storage_fault(len(live), len(durable)) else durable

    def _grant(self, b: int, holder: str, now: float) -> Lease:
        bucket = self.buckets[b]
        prev = self.lease_of(b)  # with its renewal time (controller/server_leases.py)
        new = leases.grant(prev, holder, now, self.terms)  # raises if prev may be in use
        self._mark(b)
        if prev is not None:
            self.history.append({"bucket": b, **prev.to_dict()})
            if len(self.history) > HISTORY_LIMIT:
                del self.history[: len(self.history) - HISTORY_LIMIT]
            stays = prev.holder in bucket["want"] or self._drain_keeps(b, prev.holder, now)
            if prev.holder != holder and self.holder_live(b) and stays:
                # A hand-off: the old primary stays in the replica set, as a secondary. It holds
                # every acknowledged batch, and applied only batches every member had prepared
                # (the new primary commits those first), so nothing needs transferring. Making
                # it re-join instead left the bucket a copy short: a crash of the new primary
                # and the other secondary (nemesis seed 451: the new primary died before it even
                # learned its grant) then lost acknowledged pushes while the old primary lived.
                if prev.holder not in bucket["holders"]:
                    bucket["holders"].append(prev.holder)
                    self._touch(prev.holder, b)
        if holder in bucket["holders"]:
            bucket["holders"].remove(holder)
        if holder in bucket["joining"]:
            bucket["joining"].remove(holder)
        bucket["lease"] = new
        index = self.__dict__.get("_leased")
        if index is not None:
            if prev is not None:
                index.get(prev.holder, set()).discard(b)
            index.setdefault(holder, set()).add(b)
        if prev is not None and prev.holder != holder:
            self._touch(prev.holder, b)  # the old primary's next delta tells it its new role
        bucket["holder_inc"] = self.servers[holder]["incarnation"]
        self.version += 1
        return new

    def _settle(
        self,
        b: int,
        now: float,
        reports: dict[str, Any] | None = None,
        offers: dict[int, list[str]] | None = None,
    ) -> None:
        """Carries bucket `b` as far toward its `want` as the rules allow at `now`. `offers`
        (`_offers_by_bucket`) spares a pass over every bucket a scan of every server per bucket."""
        bucket = self.buckets[b]
        self._mark(b)
        # The lists a server's role reads (`Views._role_view`): a change of any moves the
        # version, so that a heartbeat's answer carries it (issue 40: a member that left
        # dropping out of `left`, or a stale offer voided, changed a role without it).
        before = (list(bucket["holders"]), list(bucket["joining"]), list(bucket.get("left", {})))
        bucket["holders"] = [s for s in bucket["holders"] if self._live(s)]
        bucket["joining"] = [s for s in bucket["joining"] if self._live(s)]
        left = bucket.get("left")
        if left:  # who left longer ago than a wave is never a candidate: forget it
            bucket["left"] = {
                s: at for s, at in left.items() if now - at <= WAVE * self.terms.duration
            }
        want = bucket["want"]
        self._add_copies(b)
        dropped = self._drop_stale_offers(b, None if offers is None else offers.get(b, []))
        target = self._grant_target(b, now, reports)
        self._note_digest_conflict(b, target)
        if target is not None:
            prev = bucket["lease"]
            # A candidate's copy after every member was gone (logged: from LMDB it may lack the
            # updates of its last flush_interval).
            lost = (
                prev is not None
                and target not in bucket["holders"]
                and not (target == prev.holder and self.holder_live(b))
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
                self._set_want(b, [target, *(s for s in want if s != target)])
                want = bucket["want"]
            self._add_copies(b)  # a bucket served again: the wanted copies join now
        # Members outside `want` leave once every wanted live copy is in the replica set; a
        # draining member only once the drain no longer needs its copy (`_drain_keeps`). The
        # primary counts only in the incarnation its lease was granted to: a primary that
        # restarted holds no copy as a member (it re-joins), and counting its new incarnation
        # as "in the replica set" let every other member leave, with no candidate kept, so
        # the bucket stayed unavailable until an operator acted (issue 29's every-disk-full
        # test in CI: the old primary came back within the server timeout, the only durable
        # server, so `want` was it alone).
        primary = self.primary_of(b) if self.holder_live(b) else None
        wanted_live = [s for s in want if self._live(s)]
        if all(s == primary or s in bucket["holders"] for s in wanted_live):
            bucket["holders"] = [
                s for s in bucket["holders"] if s in want or self._drain_keeps(b, s, now)
            ]
            bucket["joining"] = [s for s in bucket["joining"] if s in want]
        if dropped or before != (
            bucket["holders"],
            bucket["joining"],
            list(bucket.get("left", {})),
        ):
            self.version += 1

    def _drain_keeps(self, b: int, sid: str, now: float) -> bool:
        """Draining server `sid`, or one that cannot persist, stays a member of bucket `b` (a
        caught-up secondary): its hold has not passed (a server that failed with the drain may
        not be known dead yet), or `b` has fewer wanted live members than the drain's floor
        (see `Operations.drain` and `write_storage`)."""
        rec = self.servers.get(sid)
        if rec is None or not (
            rec["state"] == DRAINING or (rec["state"] == LIVE and rec.get("not_durable"))
        ):
            return False
        if now < rec.get("hold_until", now):
            return True
        want = self.buckets[b]["want"]
        kept = [s for s in self.live_members(b, exclude=sid) if s in want]
        return len(kept) < rec.get("drain_floor", 0)

    def _drop_stale_offers(self, b: int, offering: list[str] | None = None) -> bool:
        """A live server holding no role in a served bucket lets its copy go (roles_of lists it
        nowhere): its offer is void from then on. `offering`: the servers that offered a copy of
        `b` (None: look at every server). True if an offer went."""
        if self.unavailable(b):
            return False
        dropped = False
        bk = self.buckets[b]
        keep = set(self.live_members(b)) | set(bk["joining"]) | set(bk.get("candidates", []))
        keep |= set(bk.get("left", {}))  # it may become a candidate with the last member
        if offering is None:
            offering = self.offering(b)
        for s in offering:
            rec = self.servers[s]
            if s not in keep and b in rec.get("copies", {}):
                del rec["copies"][b]
                self._offer(s, b, False)
                self._touch(s, b)  # its next answer's delta tells it to drop the copy
                dropped = True
        return dropped

    def _offers_by_bucket(self) -> dict[int, list[str]]:
        """bucket -> the servers that offered a copy of it. A pass over every bucket settles
        each with this index: scanning every server per bucket cost servers x buckets per
        entry (issue 26's scale simulation: 1,000 x 100,000 = 1e8 steps for one reconcile)."""
        out: dict[int, list[str]] = {}
        for s, rec in self.servers.items():
            for b in rec.get("copies", {}):
                out.setdefault(b, []).append(s)
        return out

    def _start_join(self, b: int, sid: str) -> None:
        bk = self.buckets[b]
        self._mark(b)
        self.joins = getattr(self, "joins", 0) + 1
        bk["joining"].append(sid)
        self._touch(sid, b)
        bk.setdefault("join_ids", {})[sid] = self.joins

    def _lease_in_use(self, lease: Lease | None, now: float) -> dict[str, Any] | None:
        """The refusal of a grant while `lease` may still be in use at `now`, else None."""
        if leases.expired(lease, now, self.terms):
            return None
        until = leases.expires_at(lease, self.terms)
        return refusal(
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
        primary = self.primary_of(b) if self.holder_live(b) else None
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
                        self._touch(s, b)
                else:
                    self._start_join(b, s)

    def _grant_target(
        self, b: int, now: float, reports: dict[str, Any] | None = None
    ) -> str | None:
        """Who gets the next lease of bucket `b` at `now`, if anyone may (read-only)."""
        bucket = self.buckets[b]
        want = bucket["want"]
        lease = self.lease_of(b)
        if not want or not leases.expired(lease, now, self.terms):
            return None
        holder_ok = self.holder_live(b) and lease is not None and lease.released_at is None
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
        return self._digest_verdict(b, cands)[0]

    def _digest_verdict(self, b: int, cands: list[str]) -> tuple[str | None, dict[str, Any] | None]:
        """(the candidate to serve bucket `b`, the digest disagreement found or None).

        The most up-to-date candidates (highest (epoch, seq)) should hold bit-identical values.
        Those that sent a digest at the same committed seq are compared: if they disagree, a
        digest held by a strict majority of them wins (the others' copies are passed over);
        without a majority nobody serves the bucket (None) until an operator acts. Never
        settled silently: `_note_digest_conflict` logs and counts it.

        Except at committed seq 0: no update was ever committed to such a copy, so nothing
        acknowledged can be lost by serving any of them. Their values are the deterministic
        initial ones, and they differ only where a tensor's create reached some servers and
        not others (an interrupted create, which the client's retry completes) or one copy
        is damaged in memory. A majority still wins; without one the best candidate by
        placement serves, and the others rejoin by state transfer from it (logged, counted)."""
        want = self.buckets[b]["want"]

        def key(s: str) -> tuple:
            epoch, seq = self.servers[s]["copies"][b][:2]
            return (-epoch, -seq, want.index(s) if s in want else len(want), s)

        best = min(cands, key=key)
        top = [s for s in cands if key(s)[:2] == key(best)[:2]]
        digests = {s: self.servers[s].get("digests", {}).get(b) for s in top}
        committed = max((d[0] for d in digests.values() if d), default=None)
        compared = {s: d[1] for s, d in digests.items() if d and d[0] == committed}
        if len(set(compared.values())) <= 1:
            return best, None
        votes: dict[str, list[str]] = {}
        for s, dig in sorted(compared.items()):
            votes.setdefault(dig, []).append(s)
        conflict = {"committed": committed, "digests": {d: v for d, v in sorted(votes.items())}}
        winner = [v for v in votes.values() if 2 * len(v) > len(compared)]
        if not winner:
            return (best if committed == 0 else None), conflict
        chosen = min([*winner[0], *(s for s in top if s not in compared)], key=key)
        return chosen, conflict

    def _note_digest_conflict(self, b: int, target: str | None) -> None:
        """Logs and counts, once per distinct disagreement, a bucket whose tied candidates
        reported different digests (see `_digest_verdict`)."""
        bk = self.buckets[b]
        if not self.unavailable(b):
            bk.pop("digest_conflict", None)
            return
        cands = [
            s
            for s in bk.get("candidates", [])
            if self._live(s) and b in self.servers[s].get("copies", {})
        ]
        if not cands or not all(self._live(s) for s in bk.get("candidates", [])):
            return
        _, conflict = self._digest_verdict(b, cands)
        if conflict is None or bk.get("digest_conflict") == conflict:
            return
        bk["digest_conflict"] = conflict
        self.digest_conflicts = getattr(self, "digest_conflicts", 0) + 1
        n = sum(len(v) for v in conflict["digests"].values())
        if target is None:
            verdict = "no majority: the bucket stays unavailable until an operator acts"
        elif any(2 * len(v) > n for v in conflict["digests"].values()):
            verdict = f"serving the majority's copy on {target}"
        else:
            verdict = (
                f"no majority at seq 0 (nothing ever committed: initial values, which differ "
                f"after an interrupted create): serving {target}'s copy; the others rejoin by "
                "state transfer"
            )
        log.error(
            "bucket %d: candidates at the same (epoch, seq) disagree on their values' digest "
            "%s: %s",
            b,
            conflict["digests"],
            verdict,
        )

    def live_members(self, b: int, exclude: str | None = None) -> list[str]:
        """The live members of bucket `b`'s replica set (primary in its incarnation, holders)."""
        bk = self.buckets[b]
        out = [self.primary_of(b)] if self.holder_live(b) else []
        out += [s for s in bk["holders"] if self._live(s)]
        return [s for s in out if s != exclude]

    def unavailable(self, b: int) -> bool:
        """Bucket `b` held data once and no live member of its replica set is left to serve it
        (until a candidate is back, or an operator declares it lost)."""
        return self.buckets[b]["lease"] is not None and not self.live_members(b)

    def grants_due(self, now: float) -> list[int]:
        """Buckets whose lease `reconcile(now)` would grant (the leader asks before proposing)."""
        return [b for b in self.unsettled() if self._grant_target(b, now) is not None]

    def unsettled(self) -> list[int]:
        """The buckets whose lease some time may let be granted, ascending: a superset of those
        `_grant_target` names at any `now`. A bucket is *settled* while it is placed nowhere
        or its lease is held, unreleased, by its live wanted primary: then no time grants it
        (it renews), until an entry changes its record (`_mark` adds it back) or its holder's
        liveness (a registration or death, which settles the holder's buckets). The leader
        asked `_grant_target` of every bucket four times a second (issue 40's scale
        simulation: 0.32 CPU s/s at 100,000 buckets in steady state); `reconcile` reads it
        too. Derived beside the state (never dumped), rebuilt by one pass on first use."""
        index = self.__dict__.get("_unsettled")
        if index is None:
            index = self._unsettled = set(range(self.n_buckets))
        for b in [b for b in index if self._settled(b)]:
            index.discard(b)
        return sorted(index)

    def _settled(self, b: int) -> bool:
        bk = self.buckets[b]
        want, lease = bk["want"], bk["lease"]
        if not want:
            return True
        return (
            lease is not None
            and lease.released_at is None
            and lease.holder == want[0]
            and self.holder_live(b)
        )

    def holds_due(self, now: float) -> list[str]:
        """Draining servers (or ones that cannot persist) whose hold passed by `now` and that no
        reconcile has seen since: `reconcile(now)` lets them leave the buckets that no longer
        need them."""
        return sorted(
            s
            for s, rec in self.servers.items()
            if rec["state"] in (DRAINING, LIVE) and rec.get("hold_until", now + 1) <= now
        )

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

    def _replan(
        self,
        now: float,
        reports: dict[int, dict[str, Any]] | None = None,
        touched: set[int] | None = None,
    ) -> None:
        """New placement targets over the eligible servers, then settle the buckets: every one,
        or (`touched` given: the buckets of the one server whose registration or death this
        is) those whose target changed, those in `touched` and those with offered copies. The
        others' records are as the last entry left them, and what time alone changes in them
        (leases that may be granted, drain holds that passed) is a `reconcile`'s, which the
        leader proposes when `grants_due` or `holds_due` says so (issue 26's scale simulation:
        settling 100,000 buckets per death was seconds of the apply thread each)."""
        eligible = self.eligible()
        placed = any(bk["want"] or bk["lease"] for bk in self.buckets)
        if not placed and len(eligible) < self.min_servers:
            return
        current = {}
        for b, bk in enumerate(self.buckets):
            p = [self.primary_of(b)] if self.holder_live(b) else []
            current[b] = p + bk["holders"] + bk["joining"]
        target = placement.place(
            self.n_buckets, current, eligible, self.replication, racks=self.racks()
        )
        offers = self._offers_by_bucket()
        self.__dict__.pop("_wanted", None)  # every target may move: counted again when read
        for b, bk in enumerate(self.buckets):
            new = list(target[b])
            if touched is None or new != bk["want"] or b in touched or b in offers:
                bk["want"] = new
                self._settle(b, now, (reports or {}).get(b), offers)
        self.version += 1
