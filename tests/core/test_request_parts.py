"""The parts of a pull or a push cut to a server's limits (adamps/client/parts.py, issue 30)."""

from __future__ import annotations

import random

import pytest

from adamps.client.parts import HEADROOM, PER_SHARD, Limits, chunk, pack, plan_push
from adamps.layout import Layout, TensorSpec

LAYOUT = Layout([TensorSpec("x", (64_000,)), TensorSpec("b", (10,))], 8, max_shard_elems=1_000)
SHARDS = [s for n in ("x", "b") for s in LAYOUT.shards_of[n]]


def size(s) -> int:
    return 4 * s.size


def test_limits_from_a_servers_status() -> None:
    status = {"config": {"max_body": 65536, "max_shards_per_request": 4}}
    assert Limits.of_status(status) == Limits(65536, 4)
    for bad in ({}, {"config": {"max_body": 65536}}, {"config": None}):
        with pytest.raises(ValueError, match="config.max_body"):
            Limits.of_status(bad)  # no defaults guessed for a server of another version
    assert Limits.tightest([Limits(10_000, 9), Limits(20_000, 3)]) == Limits(10_000, 3)
    assert Limits(65536, 4).budget() == 65536 - HEADROOM
    assert Limits(1024, 4).budget() == 768, "headroom at most a quarter of a small body"
    assert Limits(1024, 4).budget(fixed=5000) == 1, "a part always carries one shard"


def test_a_push_that_fits_is_one_request_per_server_under_its_own_pair() -> None:
    units = plan_push(SHARDS, LAYOUT.bucket_of, size, Limits())
    assert {u.client_suffix for u in units} == {""}
    assert len(units) == len({LAYOUT.bucket_of[s.id] for s in SHARDS}), "one unit per bucket"
    (request,) = pack(units, size, Limits())
    assert sorted(s.id for u in request for s in u.shards) == sorted(s.id for s in SHARDS)


def test_large_buckets_are_cut_into_parts_with_pairs_of_their_own() -> None:
    limits = Limits(max_body=64 << 10, max_shards=4)
    units = plan_push(SHARDS, LAYOUT.bucket_of, size, limits)
    assert sorted(s.id for u in units for s in u.shards) == sorted(s.id for s in SHARDS)
    for b in {u.bucket for u in units}:
        mine = [u for u in units if u.bucket == b]
        suffixes = [u.client_suffix for u in mine]
        # Within a bucket every part is a distinct pair (the bucket deduplicates by pair);
        # the first keeps the push's own pair.
        assert suffixes == [""] + [f"#{i}" for i in range(1, len(mine))]
        assert all(LAYOUT.bucket_of[s.id] == b for u in mine for s in u.shards)
    requests = pack(units, size, limits)
    for req in requests:
        assert len({u.client_suffix for u in req}) == 1, "one pair per request"
        shards = [s for u in req for s in u.shards]
        assert len(shards) <= limits.max_shards
        assert sum(size(s) + PER_SHARD for s in shards) <= limits.budget()
        assert len({u.bucket for u in req}) == len(req), "a bucket at most once per request"
    # The same push planned again is the same parts under the same pairs (a retry).
    assert plan_push(SHARDS, LAYOUT.bucket_of, size, limits) == units


def test_chunk_keeps_order_and_bounds() -> None:
    rng = random.Random(3)
    for _ in range(50):
        items = SHARDS[: rng.randrange(1, len(SHARDS))]
        budget, most = rng.randrange(1, 20_000), rng.randrange(1, 9)
        runs = chunk(items, size, budget, most)
        assert [s for r in runs for s in r] == items
        for r in runs:
            assert len(r) <= most
            assert len(r) == 1 or sum(size(s) + PER_SHARD for s in r) <= budget
