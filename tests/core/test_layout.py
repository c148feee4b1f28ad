"""adamps.layout: every element in exactly one shard, round trips, stable buckets (Adam 3.3.1)."""

from __future__ import annotations

import itertools
import subprocess
import sys

import numpy as np
import pytest

from adamps.layout import (
    MAX_SHARD_ELEMS,
    Layout,
    LayoutError,
    TensorSpec,
    parse_shard_id,
    split_tensor,
    stable_bucket,
)

SHAPES = [(1,), (7,), (262_144,), (262_145,), (600_000,), (3, 5), (400, 320), (1000, 1000),
          (1, 300_000), (3, 300_000), (10, 1, 5, 5), (20, 10, 5, 5), (2048, 257)]  # fmt: skip


# Every shape against every shard size, except combinations with over 20,000 shards (slow, and
# nothing they would check that the others do not).
CASES = [
    (shape, m)
    for shape in SHAPES
    for m in (1, 7, 1000, MAX_SHARD_ELEMS)
    if TensorSpec("t", shape).size // m <= 20_000
]


@pytest.mark.parametrize(("shape", "max_elems"), CASES)
def test_every_element_in_exactly_one_shard(shape: tuple[int, ...], max_elems: int) -> None:
    spec = TensorSpec("t", shape)
    shards = split_tensor(spec, max_elems)
    covered = np.zeros(spec.size, dtype=np.int32)
    for s in shards:
        assert 0 < s.size <= max_elems
        covered[s.start : s.stop] += 1
        if s.rows_aligned and len(shape) > 1:
            assert s.start == s.row_start * spec.row_size and s.stop == s.row_stop * spec.row_size
            assert s.shape == (s.row_stop - s.row_start, *shape[1:])
    assert (covered == 1).all()
    # Contiguous and ordered.
    assert [s.index for s in shards] == list(range(len(shards)))
    assert all(a.stop == b.start for a, b in itertools.pairwise(shards))


def test_matrix_cut_on_whole_rows_within_one_megabyte() -> None:
    shards = split_tensor(TensorSpec("fc.w", (1000, 1000)))
    assert all(s.rows_aligned for s in shards)
    assert shards[0].shape == (262, 1000)  # 262 rows x 1000 floats <= 262,144
    assert sum(s.row_stop - s.row_start for s in shards) == 1000


def test_rows_longer_than_a_shard_fall_back_to_flat_cuts() -> None:
    shards = split_tensor(TensorSpec("wide", (2, 300_000)))
    assert not any(s.rows_aligned for s in shards)
    assert sum(s.size for s in shards) == 600_000


@pytest.mark.parametrize("shape", [(7,), (400, 320), (1000, 1000), (20, 10, 5, 5), (3, 300_000)])
def test_split_join_round_trip(shape: tuple[int, ...]) -> None:
    layout = Layout([TensorSpec("t", shape)], max_shard_elems=50_000)
    values = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    parts = layout.split("t", values)
    assert all(np.shares_memory(p, values) for p in parts)  # views, no copy
    np.testing.assert_array_equal(layout.join("t", [p.copy() for p in parts]), values)


def test_buckets_stable_across_processes() -> None:
    """The same shard ids land in the same buckets in another interpreter (different hash seed)."""
    layout = Layout([TensorSpec(f"t{i}", (1000, 1000)) for i in range(5)], n_buckets=64)
    code = (
        "from adamps.layout import Layout, TensorSpec;"
        "l = Layout([TensorSpec(f't{i}', (1000, 1000)) for i in range(5)], n_buckets=64);"
        "print(sorted(l.bucket_of.items()))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True,
        env={"PYTHONHASHSEED": "12345", "PATH": ""},
    ).stdout.strip()  # fmt: skip
    assert out == str(sorted(layout.bucket_of.items()))


def test_buckets_spread_and_in_range() -> None:
    counts = np.bincount([stable_bucket(f"t/{i}", 64) for i in range(64_000)], minlength=64)
    assert counts.min() > 800 and counts.max() < 1200


def test_layout_dict_round_trip_and_lookups() -> None:
    layout = Layout([TensorSpec("a", (400, 320)), TensorSpec("b", (10,))], n_buckets=16)
    again = Layout.from_dict(layout.to_dict())
    assert again == layout and again.bucket_of == layout.bucket_of
    for b in range(16):
        for s in layout.shards_in_bucket(b):
            assert layout.bucket_of[s.id] == b
    assert parse_shard_id("fc1.w/3") == ("fc1.w", 3)


@pytest.mark.parametrize(
    "bad",
    [lambda: TensorSpec("", (1,)), lambda: TensorSpec("a b", (1,)), lambda: TensorSpec("a", (0,)),
     lambda: TensorSpec("a", ()), lambda: TensorSpec("a", (2,), "int8"),
     lambda: Layout([TensorSpec("a", (1,)), TensorSpec("a", (2,))]), lambda: Layout([], n_buckets=0),
     lambda: parse_shard_id("nope")],
)  # fmt: skip
def test_bad_specs_are_clear_errors(bad) -> None:
    with pytest.raises(LayoutError):
        bad()
