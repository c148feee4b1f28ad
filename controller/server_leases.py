"""Leases renewed per server (issue 40): a renewal round records one time per server, not one
per bucket.

A round used to renew each lease of each server in it: 100,000 leases a second at 100,000
buckets, nearly all of the leader's steady-state CPU (issue 40's scale simulation, cProfile of
its steady phase: `renew` and `lease.renew` were 0.39 of the leader's 0.42 CPU s/s). Now:

* `renewals` (replicated): server -> [rounds, at], how many renewal entries renewed it and the
  clock of the last one.
* A bucket's lease *follows* its holder while the per-bucket renewal would have renewed it
  (`_would_renew`: held, not released, by its holder's current incarnation, the holder not
  dead, no hand-off pending). Its marker `follows` = [holder, epoch, rounds when it started
  following] (replicated, in the bucket record). Its renewal time is then the later of its
  lease's `renewed_at` and its holder's last round *after* the marker was set (`lease_of`).
* When a bucket stops following, its renewal time is written into its lease (frozen): the time
  of the last round that renewed it, as the per-bucket renewal left it.

Every entry that changes a bucket's record marks it (`_mark`, `_set_want`), and the next
entry re-decides the marked buckets before anything else (`_sync_follows`, from `_tick`). No
round happens between two entries, so a bucket's renewal time is the same whether it is
re-decided at the end of the entry that changed it or at the start of the next: each lease's
renewal time, and the list of leases a round answers, are exactly those of the per-bucket
renewal (tests/core/test_server_leases.py compares them over random histories).

Lease safety (adamps/core/lease.py): a round's answer lists the buckets that follow the server
(`renewed`), and only those renewal times move with the round; its holder times each listed
lease from before it sent its heartbeat, which arrived before the round's clock was read.
"""

from __future__ import annotations

from typing import Any

from adamps.core import lease as leases
from adamps.core.lease import Lease
from controller.cluster_rules import DEAD, refusal


class ServerLeases:
    """Renewal rounds and the leases that follow them.

    A part of :class:`controller.state.ClusterModel`, which holds the records its methods read
    and change (``servers``, ``buckets``, ``renewals``, ``follow_check``): plain, deterministic,
    no clock, no IO, never raises on bad input."""

    def renew(self, sid: str, now: float) -> dict[str, Any]:
        """Renews every lease `sid` holds that follows it (one entry per server: the journal of
        an earlier release; new rounds are `renew_round`). `renewed`: [bucket, epoch] of each.

        A lease whose bucket is being handed over (its target primary has caught up) is not
        renewed: it runs out, then the target gets the next epoch."""
        now = self._tick(now)
        rec = self.servers.get(sid)
        if rec is None:
            return refusal("not_found", f"no server {sid!r}")
        if rec["state"] == DEAD:
            return refusal(
                "conflict", f"server {sid!r} was declared dead; register again", state=DEAD
            )
        r = self._renewals().setdefault(sid, [0, now])
        r[0] += 1
        r[1] = now  # the replicated clock never goes back
        return {"ok": True, "renewed": self._following(sid), "at": now}

    def renew_round(self, sids: list[str], now: float) -> dict[str, Any]:
        """One renewal round: every server in `sids`, as `renew` renews it, in one entry (issue
        40: 1,000 servers heartbeating every second were 1,000 entries a second). `servers`:
        each server's own answer (a refusal for one dead or unknown)."""
        now = self._tick(now)
        out = {sid: self.renew(sid, now) for sid in dict.fromkeys(str(s) for s in sids or [])}
        self.applied -= len(out)  # one entry, counted once
        return {"ok": True, "servers": out, "at": now}

    def lease_of(self, b: int) -> Lease | None:
        """Bucket `b`'s lease with its renewal time: its holder's last round since the lease
        started following it, when later than the lease's own record (read-only)."""
        bk = self.buckets[b]
        lease: Lease | None = bk["lease"]
        f = bk.get("follows")
        if lease is None or f is None or lease.released_at is not None:
            return lease
        if f[0] != lease.holder or f[1] != lease.epoch:
            return lease  # a marker of the lease before (re-decided at the next entry)
        r = self.__dict__.get("renewals", {}).get(f[0])
        if r is None or r[0] <= f[2] or r[1] <= lease.renewed_at:
            return lease
        return leases.renew(lease, lease.holder, lease.epoch, r[1])

    def _would_renew(self, b: int) -> bool:
        """A renewal of its holder renews bucket `b`'s lease (the per-bucket rule of before)."""
        bk = self.buckets[b]
        lease: Lease | None = bk["lease"]
        if lease is None or lease.released_at is not None:
            return False
        rec = self.servers.get(lease.holder)
        if rec is None or rec["state"] == DEAD or bk["holder_inc"] != rec["incarnation"]:
            return False  # dead, or granted to an earlier incarnation: it runs out
        want = bk["want"]
        return not (want and want[0] != lease.holder and want[0] in bk["holders"])  # hand-off

    def _renewals(self) -> dict[str, list]:
        r = self.__dict__.get("renewals")
        if r is None:  # a state from before leases per server: every bucket is re-decided
            r = self.renewals = {}
            self.follow_check = set(range(self.n_buckets))
        return r

    def _recheck(self, b: int) -> None:
        """Bucket `b`'s record changes in this entry: whether it follows its holder is
        re-decided at the start of the next entry."""
        check = self.__dict__.get("follow_check")
        if check is not None:
            check.add(b)

    def _sync_follows(self) -> None:
        """Re-decides the marked buckets (the first thing each entry does: `_tick`)."""
        renewals = self._renewals()
        check = self.follow_check
        if not check:
            return
        index = self.__dict__.get("_attached")
        for b in sorted(check):
            bk = self.buckets[b]
            old = bk.get("follows")
            lease: Lease | None = bk["lease"]
            same = (
                old is not None
                and lease is not None
                and (old[0], old[1]) == (lease.holder, lease.epoch)
            )
            if self._would_renew(b):
                if same:
                    continue
                new = [lease.holder, lease.epoch, renewals.get(lease.holder, (0,))[0]]  # type: ignore[union-attr]
            elif old is None:
                continue
            else:
                new = None
                if same:  # stops following: its renewal time is frozen into the lease
                    bk["lease"] = self.lease_of(b)
            if new is None:
                del bk["follows"]
            else:
                bk["follows"] = new
            if index is not None:
                if old is not None:
                    index.get(old[0], {}).pop(b, None)
                    self._answers.pop(old[0], None)
                if new is not None:
                    index.setdefault(new[0], {})[b] = new[1]
                    self._answers.pop(new[0], None)
        check.clear()

    def _following(self, sid: str) -> list[list[int]]:
        """[bucket, epoch] of the leases following `sid`, ascending. From an index beside the
        state (never dumped; one pass over the buckets on first use), and the list itself kept
        until one of them changes: a round's answer reads no bucket and builds no list per
        lease (a list of 100 pairs per heartbeat was most of what the rounds still cost)."""
        if self.__dict__.get("_attached") is None:
            index: dict[str, dict[int, int]] = {}
            for b, bk in enumerate(self.buckets):
                f = bk.get("follows")
                if f is not None:
                    index.setdefault(f[0], {})[b] = f[1]
            self._attached, self._answers = index, {}
        out = self._answers.get(sid)
        if out is None:
            out = [[b, e] for b, e in sorted(self._attached.get(sid, {}).items())]
            self._answers[sid] = out
        return list(out)  # the pairs are shared: the answer is read, never changed
