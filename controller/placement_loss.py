"""Placement after servers are lost: new targets for the buckets that lost a member, only (pure).

`placement.place` recomputes every bucket's target from the whole assignment: at 1,000 servers
and 100,000 buckets one decision took seconds (13 s the worst of a rack failure, issue 40's
scale simulation), and a rack of 50 failing is 50 decisions, each holding the apply thread.
A death changes nothing for the buckets the dead server did not hold, so only its buckets get
new targets here, by the same goals (docs/protocol-controller.md, "Placement"):

1. each affected bucket keeps its surviving copies (in their order) and gets new ones up to
   min(replication, eligible servers), each on the eligible server with the fewest wanted
   copies among those in a rack the bucket does not use (while the racks suffice), ties
   broken by a stable rotation per bucket (spreads a dead server's buckets over many servers);
2. a bucket whose primary was lost gets, among its surviving caught-up copies (`holders`), the
   one with the fewest wanted primaries, a server under its share (ceil(buckets / servers))
   first: a direct choice among two copies, no chain of moves;
3. a server left above its share hands the primary of such a bucket (one whose primary changes
   anyway: a free move) to another caught-up copy below its share.

Balance is the cluster's counts (`copies`, `primaries`: every bucket's target, which the model
keeps beside its state), so each decision costs the affected buckets times a vector operation
over the servers, not the whole assignment. The whole re-placement stays for what moves every
bucket's target: a server added, drained or returned, an operator's rebalance.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from controller.placement import Assignment, domain


def place_lost(
    affected: Mapping[int, Sequence[str]],
    holders: Mapping[int, Sequence[str]],
    servers: Iterable[str],
    copies: Mapping[str, int],
    primaries: Mapping[str, int],
    n_buckets: int,
    replication: int = 3,
    racks: Mapping[str, str] | None = None,
) -> Assignment:
    """New targets ([primary, secondaries...]) of the `affected` buckets (bucket -> its current
    target, primary first, lost servers included) over the eligible `servers`. `holders`:
    per affected bucket, its caught-up copies (those that may be primary at once). `copies`,
    `primaries`: wanted copies and primaries per server over every bucket, the affected ones'
    current targets included. Deterministic."""
    live = sorted(set(servers))
    if not live:
        return {b: [] for b in affected}
    width = min(replication, len(live))
    at = {s: i for i, s in enumerate(live)}
    dom_of = {s: domain(s, racks) for s in live}
    dom_ids = {d: i for i, d in enumerate(sorted(set(dom_of.values())))}
    doms = np.array([dom_ids[dom_of[s]] for s in live], dtype=np.int64)
    strict = len(dom_ids) >= width
    load = np.array([copies.get(s, 0) for s in live], dtype=np.int64)
    prim = {s: primaries.get(s, 0) for s in live}
    hi = -(-n_buckets // len(live))
    out: Assignment = {}
    orphans = []
    for b in sorted(affected):
        old = list(dict.fromkeys(affected[b]))
        alive = [s for s in old if s in at]
        keep = alive
        if strict:  # a copy sharing a rack with an earlier one moves (as `place` does)
            used: set[int] = set()
            keep = [s for s in keep if not (doms[at[s]] in used or used.add(doms[at[s]]))]
        keep = keep[:width]
        for s in alive:
            if s not in keep:
                load[at[s]] -= 1
        out[b] = keep
        if not old or old[0] not in keep:
            orphans.append(b)
            if old and old[0] in prim:
                prim[old[0]] -= 1
    for b in sorted(out, key=lambda b: (len(out[b]), b)):
        while len(out[b]) < width:
            out[b].append(_least_loaded(b, out[b], at, load, doms, strict, live))
    # Primaries of the buckets that lost theirs: the caught-up copy with the fewest.
    for b in orphans:
        caught = [s for s in out[b] if s in holders.get(b, ())] or out[b][:1]
        if not caught:
            continue
        rank = {s: i for i, s in enumerate(holders.get(b, ()))}
        p = min(caught, key=lambda s: (prim[s] >= hi, prim[s], rank.get(s, 0), _mix(b, s)))
        out[b].remove(p)
        out[b].insert(0, p)
        prim[p] += 1
    # Direct moves: a server above its share gives an orphan's primary to another caught-up copy.
    for b in orphans:
        p = out[b][0] if out[b] else None
        if p is None or prim[p] <= hi:
            continue
        room = [s for s in out[b][1:] if s in holders.get(b, ()) and prim[s] < hi]
        if room:
            t = min(room, key=lambda s: (prim[s], s))
            out[b].remove(t)
            out[b].insert(0, t)
            prim[p] -= 1
            prim[t] += 1
    return out


def _mix(b: int, s: str) -> int:
    """A stable tie-breaker (placement's own: not Python's salted hash)."""
    return zlib.crc32(f"{b}/{s}".encode())


def _least_loaded(
    b: int,
    have: list[str],
    at: Mapping[str, int],
    load: np.ndarray,
    doms: np.ndarray,
    strict: bool,
    live: list[str],
) -> str:
    """The server for a new copy of bucket `b` (held by `have`): not holding it, in a rack the
    bucket does not use (while the racks suffice; else any rack, unused ones first), with the
    fewest wanted copies; among those, a stable rotation by bucket. Its load is counted."""
    idx = [at[s] for s in have]
    fresh = np.ones(len(live), dtype=bool)
    for i in idx:
        fresh &= doms != doms[i]
    ok = fresh
    if not ok.any():
        if strict:  # no unused rack left at all: impossible while width <= racks
            raise AssertionError(f"placement: no rack left for bucket {b}")
        ok = np.ones(len(live), dtype=bool)
        ok[idx] = False
    cand = np.flatnonzero(ok)
    cand = cand[load[cand] == load[cand].min()]
    pick = int(cand[zlib.crc32(f"{b}".encode()) % len(cand)])
    load[pick] += 1
    return live[pick]
