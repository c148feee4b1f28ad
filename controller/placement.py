"""Bucket placement: which servers hold each bucket, and which of them is its primary (pure).

Project Adam 3.3.3: three copies of every bucket on distinct parameter servers, one of them the
primary; the buckets of a failed machine are relocated *evenly* over the live ones. Here placement
is a pure function of (current assignment, eligible servers): no IO, no clock, no randomness, so
every controller replica computes the same answer inside a replicated method.

Goals, in order:
1. every bucket gets min(replication, live) distinct eligible servers (fewer = under-replicated);
2. per server, replica counts differ by at most 1, and primary counts differ by at most 1;
3. few moves: a replica that may stay where it is stays (a move copies a bucket over the network),
   and a primary that may stay primary stays (a change of primary costs a lease hand-off).

The replica step keeps existing replicas up to each server's quota and fills the gaps greedily
(most constrained bucket first, emptiest server first), with a one-swap repair for the rare bucket
whose only servers with room already hold it. The primary step is a bipartite assignment of
buckets to one of their own replicas under per-server quotas, solved exactly with augmenting paths
(a few thousand buckets x ten servers: milliseconds).
"""

from __future__ import annotations

import zlib
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy as np

#: Copies of each bucket (primary + secondaries), as in the paper.
REPLICATION = 3

Assignment = dict[int, list[str]]
"""bucket -> [primary, secondary, ...]: distinct server ids, primary first."""


def _quotas(servers: Sequence[str], total: int, current: Mapping[str, int]) -> dict[str, int]:
    """Splits `total` slots over `servers` as evenly as possible (counts differ by at most 1).

    The servers that get the extra slot are those already holding the most (fewer moves), ties
    broken by id (determinism).
    """
    n = len(servers)
    base, extra = divmod(total, n)
    ranked = sorted(servers, key=lambda s: (-current.get(s, 0), s))
    return {s: base + (1 if i < extra else 0) for i, s in enumerate(ranked)}


def place(
    n_buckets: int,
    current: Mapping[int, Sequence[str]],
    servers: Iterable[str],
    replication: int = REPLICATION,
) -> Assignment:
    """The new assignment of buckets 0..n_buckets-1 over the eligible `servers`.

    `current` maps bucket -> its present holders, primary first (missing or empty for a bucket
    never placed). Holders not in `servers` (dead, draining) are dropped. Deterministic.
    """
    live = sorted(set(servers))
    if n_buckets < 0:
        raise ValueError("n_buckets must be >= 0")
    if not live:
        return {b: [] for b in range(n_buckets)}
    width = min(replication, len(live))
    live_set = set(live)
    cur = {
        b: [s for s in dict.fromkeys(current.get(b, ())) if s in live_set] for b in range(n_buckets)
    }

    # -- replicas ------------------------------------------------------------------------------
    held: dict[str, int] = {s: 0 for s in live}
    for holders in cur.values():
        for s in holders[:width]:
            held[s] += 1
    quota = _quotas(live, n_buckets * width, held)
    kept: dict[int, list[str]] = {b: list(cur[b][:width]) for b in range(n_buckets)}
    load = dict(held)
    # Trim over-full servers. Primaries stay (a dropped primary is a lease hand-off as well as a
    # copy); among its secondaries a server gives up first those of buckets that lost nothing yet
    # (no bucket loses two copies while another keeps all), spread over the buckets' primaries
    # (the server receiving the copies then holds buckets of every over-full primary, so that
    # primaries can be handed over to it directly), then by bucket id (determinism).
    lost_by_primary: dict[str, int] = {}
    for s in sorted(live, key=lambda s: (quota[s] - load[s], s)):
        excess = load[s] - quota[s]
        if excess <= 0:
            continue
        as_secondary = [b for b in range(n_buckets) if s in kept[b][1:]]
        nth: dict[str, int] = {}
        ranked = []
        for b in sorted(as_secondary, key=lambda b: (-len(kept[b]), b)):
            p = kept[b][0]
            nth[p] = nth.get(p, 0) + 1
            ranked.append((-len(kept[b]), nth[p] + lost_by_primary.get(p, 0), b))
        ranked.sort()
        drop = [b for _, _, b in ranked[:excess]]
        if len(drop) < excess:  # only primaries left to give up
            drop += [b for b in range(n_buckets) if kept[b][:1] == [s]][: excess - len(drop)]
        for b in drop:
            kept[b].remove(s)
            load[s] -= 1
            if kept[b]:
                lost_by_primary[kept[b][0]] = lost_by_primary.get(kept[b][0], 0) + 1

    def room(s: str) -> int:
        return quota[s] - load[s]

    # How often two servers share a bucket: a new copy goes preferably where the bucket's other
    # holders have few buckets in common with it, so that the buckets of any one server have
    # their other copies spread over all the others (a failure then spreads its load evenly).
    # Kept as a servers x servers matrix, so that choosing a copy's server is a few vector
    # operations instead of a Python loop over every server (issue 26's scale simulation: the
    # first placement of 100,000 buckets over 1,000 servers took minutes that way).
    at = {s: i for i, s in enumerate(live)}
    pairs = np.zeros((len(live), len(live)), dtype=np.int32)
    for holders in kept.values():
        idx = [at[h] for h in holders]
        for i, a in enumerate(idx):
            for c in idx[i + 1 :]:
                pairs[a, c] += 1
                pairs[c, a] += 1
    rooms = np.array([room(s) for s in live], dtype=np.int64)
    names = [s.encode() for s in live]

    # Most constrained buckets first: those missing the most replicas.
    order = sorted(range(n_buckets), key=lambda b: (len(kept[b]), b))
    for b in order:
        while len(kept[b]) < width:
            idx = [at[h] for h in kept[b]]
            s = _best_server(b, idx, pairs, rooms, names, live)
            if s is not None:
                i = at[s]
                for h in idx:
                    pairs[i, h] += 1
                    pairs[h, i] += 1
                kept[b].append(s)
                load[s] += 1
                rooms[i] -= 1
                continue
            _repair(b, kept, live, room, load)
            rooms = np.array([room(s) for s in live], dtype=np.int64)

    # -- primaries -----------------------------------------------------------------------------
    # The primary that may stay is the bucket's *present* primary only (not a survivor that
    # moved to the front of the list because the primary died).
    present = {b: (current.get(b) or [None])[0] for b in range(n_buckets)}
    primaries = _assign_primaries(n_buckets, kept, live, present, cur)
    result: Assignment = {}
    for b in range(n_buckets):
        p = primaries[b]
        rest = [s for s in kept[b] if s != p]
        # Keep the secondaries in their previous order (stable output, fewer spurious diffs).
        prev = cur[b]
        rest.sort(key=lambda s: (prev.index(s) if s in prev else len(prev), s))
        result[b] = [p, *rest]
    return result


def _best_server(
    b: int,
    holders: list[int],
    pairs: np.ndarray,
    rooms: np.ndarray,
    names: list[bytes],
    live: list[str],
) -> str | None:
    """The server for a new copy of bucket `b` (held by the servers at indexes `holders`): among
    those with room that do not hold it, the fewest buckets shared with its holders, then the
    most room, then `_mix` (computed only for the servers still tied). None: nobody may."""
    ok = rooms > 0
    ok[holders] = False
    if not ok.any():
        return None
    shared = pairs[holders].sum(axis=0) if holders else np.zeros(len(live), dtype=np.int64)
    shared = np.where(ok, shared, np.iinfo(np.int64).max)
    tied = ok & (shared == shared.min())
    most = np.where(tied, rooms, -1)
    tied = np.flatnonzero(most == most.max())
    if len(tied) == 1:
        return live[tied[0]]
    prefix = zlib.crc32(f"{b}/".encode())  # crc32 continued over the name = _mix(b, s)
    return live[min(tied, key=lambda i: zlib.crc32(names[i], prefix))]


def _mix(b: int, s: str) -> int:
    """A stable pseudo-random tie-breaker (not Python's salted hash)."""
    return zlib.crc32(f"{b}/{s}".encode())


def _repair(
    b: int,
    kept: dict[int, list[str]],
    live: list[str],
    room: Callable[[str], int],
    load: dict[str, int],
) -> None:
    """Bucket `b` lacks a replica but every server with room already holds it.

    Find a server `s` with room (it holds b) and another bucket b2 holding some `t` that b lacks
    while b2 lacks `s`: move b2's replica from t to s and give t to b. One extra move.
    """
    with_room = [s for s in live if room(s) > 0]
    for s in with_room:
        for b2 in sorted(kept):
            if b2 == b or s in kept[b2]:
                continue
            for t in kept[b2]:
                if t not in kept[b] and t != s:
                    i = kept[b2].index(t)
                    kept[b2][i] = s
                    load[s] += 1
                    kept[b].append(t)
                    return
    raise AssertionError(f"placement: cannot fill bucket {b}")  # impossible when width <= len(live)


def _assign_primaries(
    n_buckets: int,
    kept: dict[int, list[str]],
    live: list[str],
    present: Mapping[int, str | None],
    cur: Mapping[int, list[str]],
) -> dict[int, str]:
    """One primary per bucket among its replicas, counts per server within [lo, hi], present kept.

    Every bucket first keeps its present primary (if it still holds a replica) or takes its
    emptiest replica; then excess primaries are pushed along the cheapest chain of buckets to a
    server with room (0-1 BFS: moving a bucket whose primary changes anyway costs nothing, moving
    one that keeps its present primary costs one change).
    """
    lo = n_buckets // len(live)
    hi = -(-n_buckets // len(live))
    owner: dict[int, str] = {}
    count = {s: 0 for s in live}
    by_server: dict[str, list[int]] = {s: [] for s in live}
    orphans = []
    for b in range(n_buckets):
        p = present[b]
        if p in kept[b]:
            owner[b] = p  # type: ignore[assignment]
            count[p] += 1  # type: ignore[index]
            by_server[p].append(b)  # type: ignore[index]
        else:
            orphans.append(b)
    # Orphans (primary gone) go to a replica with room, preferring the one listed first in the
    # current assignment (callers list caught-up copies before copies still being transferred),
    # the most constrained buckets first.
    orphans.sort(key=lambda b: (min(count[s] for s in kept[b]) if kept[b] else 0, b))
    for b in orphans:
        rank = {s: i for i, s in enumerate(cur[b])}
        p = min(
            kept[b], key=lambda s: (count[s] >= hi, rank.get(s, len(rank)), count[s], _mix(b, s))
        )
        owner[b] = p
        count[p] += 1
        by_server[p].append(b)

    # Above hi: push to anyone below hi. Then below lo: pull from anyone above lo. Each step
    # takes the cheapest chain over all candidate sources.
    def step(sources: list[str], accepts: Callable[[str], bool]) -> bool:
        found = _cheapest_chain(sources, accepts, kept, count, owner, by_server, present)
        if found is None:
            return False
        t, via = found
        count[t] += 1
        while t in via:
            b, u = via[t]
            by_server[u].remove(b)
            by_server[t].append(b)
            owner[b] = t
            t = u
        count[t] -= 1  # t is now the source the chain started from
        return True

    def move(b: int, t: str) -> None:
        src = owner[b]
        by_server[src].remove(b)
        by_server[t].append(b)
        owner[b] = t
        count[src] -= 1
        count[t] += 1

    # Direct moves first (one bucket, one hop), free ones before paid ones: cheap to find, and
    # what most joins and leaves need; the chains below handle what is left.
    for paid in (False, True):
        for src in sorted(live):
            if paid and any(owner[b] != present[b] for b in by_server[src]):
                continue  # it owns a free bucket: a chain through it may cost nothing
            for b in sorted(by_server[src], key=lambda b: (owner[b] == present[b], b)):
                if count[src] <= hi:
                    break
                if (owner[b] == present[b]) != paid:
                    continue
                room = [t for t in kept[b] if t != src and count[t] < hi]
                if room:
                    move(b, min(room, key=lambda t: (count[t], t)))
    while True:
        over = sorted(s for s in live if count[s] > hi)
        if not over or not step(over, lambda t: count[t] < hi):
            break
    while True:
        under = sorted(s for s in live if count[s] < lo)
        if not under:
            break
        target = under[0]
        if not step(sorted(s for s in live if count[s] > lo), lambda t, target=target: t == target):
            break
    return owner


def _cheapest_chain(
    sources: list[str],
    accepts: Callable[[str], bool],
    kept: dict[int, list[str]],
    count: dict[str, int],
    owner: dict[int, str],
    by_server: dict[str, list[int]],
    present: Mapping[int, str | None],
) -> tuple[str, dict[str, tuple[int, str]]] | None:
    """The cheapest chain of primary moves from any of `sources` to a server that `accepts` one.

    Multi-source 0-1 BFS over servers; returns the target and, per server on the chain, the
    bucket that moves to it and the server it comes from.
    """
    dist = dict.fromkeys(sources, 0)
    via: dict[str, tuple[int, str]] = {}
    queue: deque[str] = deque(sources)
    done: set[str] = set()
    while queue:
        u = queue.popleft()
        if u in done:
            continue
        done.add(u)
        for b in by_server[u]:
            w = 0 if owner[b] != present[b] else 1
            for t in kept[b]:
                if t == u or t in done:
                    continue
                d = dist[u] + w
                if t not in dist or d < dist[t]:
                    dist[t] = d
                    via[t] = (b, u)
                    if w == 0:
                        queue.appendleft(t)
                    else:
                        queue.append(t)
    targets = [t for t in via if accepts(t)]
    if not targets:
        return None
    t = min(targets, key=lambda t: (dist[t], count[t], t))
    return t, via


def moves(
    before: Mapping[int, Sequence[str]], after: Mapping[int, Sequence[str]]
) -> tuple[int, int]:
    """(replica copies needed, primary changes) to go from `before` to `after`."""
    copies = 0
    changes = 0
    for b, new in after.items():
        old = before.get(b, ())
        copies += len(set(new) - set(old))
        if new and (not old or old[0] != new[0]):
            changes += 1
    return copies, changes


def min_moves(
    n_buckets: int,
    before: Mapping[int, Sequence[str]],
    servers: Iterable[str],
    replication: int = REPLICATION,
) -> tuple[int, int]:
    """Lower bounds on (replica copies, primary changes) for any balanced placement.

    Copies: every slot above what the live servers may keep must be filled by a copy, and every
    server below its smallest possible quota must receive copies. Primaries: likewise per server.
    """
    live = sorted(set(servers))
    if not live:
        return 0, 0
    width = min(replication, len(live))
    live_set = set(live)
    held = {s: 0 for s in live}
    prim = {s: 0 for s in live}
    for b in range(n_buckets):
        holders = [s for s in dict.fromkeys(before.get(b, ())) if s in live_set][:width]
        for s in holders:
            held[s] += 1
        if before.get(b) and before[b][0] in live_set:
            prim[before[b][0]] += 1
    total = n_buckets * width
    lo, hi = total // len(live), -(-total // len(live))
    need_copies = max(
        sum(max(0, lo - h) for h in held.values()), total - sum(min(h, hi) for h in held.values())
    )
    plo, phi = n_buckets // len(live), -(-n_buckets // len(live))
    need_changes = max(
        sum(max(0, plo - p) for p in prim.values()),
        n_buckets - sum(min(p, phi) for p in prim.values()),
    )
    return need_copies, need_changes


def under_replicated(
    assignment: Mapping[int, Sequence[str]], replication: int = REPLICATION
) -> int:
    """Number of buckets with fewer than `replication` holders."""
    return sum(1 for holders in assignment.values() if len(holders) < replication)
