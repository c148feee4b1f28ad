"""The model's placement after a death: the targets of the dead server's buckets only
(``controller/placement_loss.py``), against counts of every server's wanted copies and
primaries kept beside the state; and the index of offered copies by bucket (issue 40)."""

from __future__ import annotations

from collections import Counter
from itertools import chain
from typing import Any

from controller import placement_loss


class WantCounts:
    """Wanted copies and primaries per server, and the re-placement after a loss.

    A part of :class:`controller.state.ClusterModel` (``buckets``, ``servers``, ...): plain,
    deterministic, no clock, no IO."""

    def offering(self, b: int) -> list[str]:
        """The servers that offered a copy of bucket `b` (and still do). From an index beside
        the state (never dumped, rebuilt on first use, kept by `_offer`): a caught-up report's
        apply and dry run looked at every server's offers (issue 40's scale simulation: 15,000
        reports after a rack of 50 failed, over 1,000 servers each). A dry run's copy of the
        model holds the index of its one bucket (`controller.state.dry_run`)."""
        index = self.__dict__.get("_offers")
        if index is None:
            index = self._offers = {}
            for s, rec in self.servers.items():
                for c in rec.get("copies", {}):
                    index.setdefault(c, set()).add(s)
        return sorted(index.get(b, ()))

    def offers_only(self, b: int, servers: list[str]) -> None:
        """This copy of the model (a dry run about bucket `b`) indexes the offers of `b` only."""
        self._offers = {b: set(servers)}

    def _offer(self, sid: str, b: int, on: bool) -> None:
        """`sid`'s offer of a copy of `b` appears (`on`) or goes: the index follows."""
        index = self.__dict__.get("_offers")
        if index is None:
            return
        if on:
            index.setdefault(b, set()).add(sid)
        else:
            index.get(b, set()).discard(sid)

    def wanted_counts(self) -> tuple[Counter[str], Counter[str]]:
        """(copies, primaries) per server over every bucket's `want`. Derived beside the state
        (never dumped): rebuilt by one pass on first use, then kept by `_set_want`; an entry
        that re-places every bucket drops it (`_replan`)."""
        index = self.__dict__.get("_wanted")
        if index is None:
            copies = Counter(chain.from_iterable(bk["want"] for bk in self.buckets))
            prims = Counter(bk["want"][0] for bk in self.buckets if bk["want"])
            index = self._wanted = (copies, prims)
        return index

    def _want_changed(self, old: list[str], new: list[str]) -> None:
        """A bucket's `want` went from `old` to `new`: the counts follow (if kept)."""
        index = self.__dict__.get("_wanted")
        if index is None or old == new:
            return
        copies, prims = index
        copies.subtract(old)
        copies.update(new)
        if old:
            prims[old[0]] -= 1
        if new:
            prims[new[0]] += 1

    def _set_want(self, b: int, new: list[str]) -> None:
        bk = self.buckets[b]
        self._want_changed(bk["want"], new)
        bk["want"] = new
        self._recheck(b)  # a hand-off may start or end (controller/server_leases.py)

    def _replan_lost(
        self, now: float, reports: dict[int, dict[str, Any]] | None, touched: set[int]
    ) -> None:
        """After `touched`'s server died: new targets for its buckets that lost a wanted copy
        (`placement_loss.place_lost`), then those buckets and the ones with offered copies are
        settled, as `_replan` settles them. Every other bucket keeps its target: a death moves
        no other bucket, and the placement decision costs the dead server's buckets, not the
        whole assignment (issue 40's scale simulation: 13 s the worst decision of a rack of
        50 failing, at 1,000 servers and 100,000 buckets)."""
        eligible = self.eligible()
        if not eligible or not any(bk["want"] or bk["lease"] for bk in self.buckets):
            self._replan(now, reports, touched)  # nothing placed yet, or nobody to place on
            return
        ok = set(eligible)
        width = min(self.replication, len(eligible))
        affected, holders = {}, {}
        for b in sorted(touched):
            want = self.buckets[b]["want"]
            if want and (len(want) < width or any(s not in ok for s in want)):
                affected[b] = list(want)
                holders[b] = self.live_members(b)
        copies, prims = self.wanted_counts()
        target = placement_loss.place_lost(
            affected,
            holders,
            eligible,
            copies,
            prims,
            self.n_buckets,
            self.replication,
            racks=self.racks(),
        )
        for b, new in target.items():
            self._set_want(b, new)
        moved = self._balance_primaries(eligible)
        offers = self._offers_by_bucket()
        for b in sorted(set(touched) | moved | set(offers)):
            self._settle(b, now, (reports or {}).get(b), offers)
        self.version += 1

    def _balance_primaries(self, eligible: list[str]) -> set[int]:
        """Direct moves of wanted primaries until no eligible server is above its share
        (ceil(buckets / servers)) or below floor(buckets / servers), where one move can do it:
        a primary to one of the bucket's own caught-up secondaries. A death's buckets go to
        their surviving copies, so the dead server's rack-mates (which hold none of its
        buckets, racks apart) gain none: they take primaries of buckets they hold a copy of
        from servers above the floor. Each such move is a hand-off (the lease runs out, then
        the secondary is granted), so only servers out of bounds move any. Visits the buckets
        the indexes name for those servers (supersets, filtered by exact conditions: every
        controller makes the same moves). The buckets moved."""
        copies, prims = self.wanted_counts()
        n = len(eligible)
        lo, hi = self.n_buckets // n, -(-self.n_buckets // n)
        ok = set(eligible)
        moved: set[int] = set()

        def caught_up(b: int, s: str) -> bool:
            return s in self.buckets[b]["holders"] and s in ok

        for s in [x for x in eligible if prims[x] > hi]:
            for b in sorted(set(self.leased_to(s)) | self.touching(s)):
                if prims[s] <= hi:
                    break
                want = self.buckets[b]["want"]
                if not want or want[0] != s or s not in self.live_members(b):
                    continue
                room = [t for t in want[1:] if caught_up(b, t) and prims[t] < hi]
                if room:
                    t = min(room, key=lambda t: (prims[t], t))
                    self._set_want(b, [t, *(x for x in want if x != t)])
                    moved.add(b)
        for u in [x for x in eligible if prims[x] < lo]:
            for b in sorted(self.touching(u)):
                if prims[u] >= lo:
                    break
                want = self.buckets[b]["want"]
                if not want or want[0] == u or u not in want or not caught_up(b, u):
                    continue
                if prims[want[0]] <= lo:
                    continue
                self._set_want(b, [u, *(x for x in want if x != u)])
                moved.add(b)
        return moved
