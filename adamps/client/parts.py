"""How `PSClient` cuts a pull or a push into requests that fit a server's limits (issue 30: a
push of a 1 GiB model was one request per server, beyond its `max_body`, and failed with
`too_large`). Pure: no IO, no clock.

A server refuses a request body over `max_body` bytes and more than `max_shards_per_request`
shard ids (both in its `GET /status` `config`). A push is planned once, before it is sent:

* its shards are grouped by bucket (what the servers deduplicate by: a bucket applies one
  `(client, seq)` pair once, with the shards it carried the first time);
* every bucket whose shards fit one request is a **unit** under the push's own pair;
* a bucket too large for one request is cut into chunks, chunk i under the pair
  (`client#i`, `seq`) (chunk 0 keeps `client`): each chunk is a pair of its own, derived from
  the push's, so sending the whole push again with the same `seq` is still exactly once;
* at send time, the units of each server (by the routing table of that attempt) are packed
  into requests under its limits; units under one pair may share a request (they are
  different buckets), units under different pairs never do.

So a multi-part push is exactly once per part and never atomic across parts, as a push over
several buckets never was (docs/protocol-ps.md, "client and seq").
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from adamps.layout import Shard

#: bytes of a request besides its shards' payloads (msgpack map, op, pair, rid, HTTP headers
#: are not in the body but a frame's meta is): kept free of every budget
HEADROOM = 16 << 10
#: bytes a shard's entry adds besides its payload (its id and msgpack/ext headers), estimated
#: high
PER_SHARD = 96


@dataclass(frozen=True)
class Limits:
    """A server's request limits."""

    max_body: int = 256 << 20
    max_shards: int = 4096

    @classmethod
    def of_status(cls, status: Mapping[str, Any]) -> Limits:
        """From a server's `GET /status`, which names both (`config.max_body`,
        `config.max_shards_per_request`); ValueError naming what is missing otherwise."""
        cfg = status.get("config")
        try:
            return cls(int(cfg["max_body"]), int(cfg["max_shards_per_request"]))  # type: ignore[index]
        except (TypeError, KeyError, ValueError) as exc:
            raise ValueError(
                "the server's /status names no config.max_body and "
                f"config.max_shards_per_request ({exc!r}): not a parameter server of this version"
            ) from None

    @classmethod
    def tightest(cls, limits: Iterable[Limits]) -> Limits:
        got = list(limits)
        if not got:
            return cls()
        return cls(min(x.max_body for x in got), min(x.max_shards for x in got))

    def budget(self, fixed: int = 0) -> int:
        """Payload bytes one request may carry (at least one byte: a lone oversized shard is
        still sent alone, and the server's 413 names the problem)."""
        return max(1, self.max_body - min(HEADROOM, self.max_body // 4) - fixed)


@dataclass(frozen=True)
class Unit:
    """Shards of one bucket sent together under the pair (`client_suffix` appended to the
    client id, the push's seq)."""

    bucket: int
    shards: tuple[Shard, ...]
    client_suffix: str = ""


def chunk(
    items: Sequence[Shard], size_of: Callable[[Shard], int], budget: int, max_shards: int
) -> list[list[Shard]]:
    """`items` in order, cut greedily into runs of at most `max_shards` and `budget` bytes."""
    out: list[list[Shard]] = []
    run: list[Shard] = []
    used = 0
    for s in items:
        n = size_of(s) + PER_SHARD
        if run and (used + n > budget or len(run) >= max_shards):
            out.append(run)
            run, used = [], 0
        run.append(s)
        used += n
    if run:
        out.append(run)
    return out


def plan_push(
    shards: Sequence[Shard],
    bucket_of: Mapping[str, int],
    size_of: Callable[[Shard], int],
    limits: Limits,
    fixed: int = 0,
) -> list[Unit]:
    """The units of a push (see the module docstring), in the order of their first shard."""
    by_bucket: dict[int, list[Shard]] = {}
    for s in shards:
        by_bucket.setdefault(bucket_of[s.id], []).append(s)
    units = []
    for b, group in by_bucket.items():
        parts = chunk(group, size_of, limits.budget(fixed), limits.max_shards)
        for i, part in enumerate(parts):
            units.append(Unit(b, tuple(part), f"#{i}" if i else ""))
    return units


def pack(
    units: Sequence[Unit], size_of: Callable[[Shard], int], limits: Limits, fixed: int = 0
) -> list[list[Unit]]:
    """The requests to one server: units of one pair packed greedily, in order."""
    budget = limits.budget(fixed)
    requests: list[list[Unit]] = []
    open_by_pair: dict[str, tuple[list[Unit], list[int]]] = {}  # pair -> (request, [bytes, n])
    for u in units:
        n = sum(size_of(s) + PER_SHARD for s in u.shards)
        cur = open_by_pair.get(u.client_suffix)
        if cur is not None:
            req, used = cur
            if used[0] + n <= budget and used[1] + len(u.shards) <= limits.max_shards:
                req.append(u)
                used[0] += n
                used[1] += len(u.shards)
                continue
        req = [u]
        requests.append(req)
        open_by_pair[u.client_suffix] = (req, [n, len(u.shards)])
    return requests
