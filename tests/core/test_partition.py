"""The vertical cut of a model (trainer/partition.py, Adam 3.2 figure 6): pure, no sockets."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from adamps.layout import Layout, TensorSpec, stable_bucket
from trainer.model import Model
from trainer.partition import (
    assemble,
    check_partitions,
    max_message_bytes,
    partition_tensors,
    slice_params,
    split,
)


@pytest.mark.parametrize("n,parts", [(10, 1), (10, 2), (10, 3), (400, 3), (7, 7), (11, 4)])
def test_split_covers_every_unit_once_in_near_equal_ranges(n, parts):
    ranges = split(n, parts)
    assert ranges[0][0] == 0 and ranges[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))
    sizes = [hi - lo for lo, hi in ranges]
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1


def test_partitions_own_rows_of_every_weight_and_bias():
    full = dict(Model("adam-mnist").tensors())
    for parts in (2, 3):
        seen: dict[str, int] = {}
        for k in range(parts):
            for name, shape in partition_tensors("adam-mnist", k, parts):
                assert name.split(".")[0].endswith(f"-p{k}of{parts}")
                base = name.split("-p")[0] + "." + name.rsplit(".", 1)[1]
                assert shape[1:] == full[base][1:]  # whole rows: a server cuts them as usual
                seen[base] = seen.get(base, 0) + shape[0]
        assert seen == {n: s[0] for n, s in full.items()}


def test_slices_assemble_back_into_the_model():
    full = Model("adam-mnist")
    full.init_params(5)
    parts = 3
    tensors = {}
    for k in range(parts):
        tensors.update(slice_params(full, k, parts))
    again = assemble("adam-mnist", parts, tensors)
    np.testing.assert_array_equal(again.params, full.params)


def test_a_cut_needs_a_unit_per_partition():
    with pytest.raises(ValueError, match="conv1 has 10"):
        check_partitions("adam-mnist", 11)
    with pytest.raises(ValueError, match=">= 1"):
        check_partitions("adam-mnist", 0)


def test_the_segment_holds_the_largest_message():
    # adam-mnist, K=2, batch 8: the largest slice is conv2's input, 12x12 x 5 channels
    assert max_message_bytes("adam-mnist", 2, 8) == 8 * 12 * 12 * 5 * 4
    # K=3 cuts 10 channels 4/3/3: the widest slice counts
    assert max_message_bytes("adam-mnist", 3, 1) == 12 * 12 * 4 * 4


def test_each_partition_has_buckets_of_its_own():
    """Adam 4.4.2: a partition talks only to the parameter-server shards of its partition."""
    for parts in (2, 3):
        specs = [
            TensorSpec(n, s)
            for k in range(parts)
            for n, s in partition_tensors("adam-mnist", k, parts)
        ]
        layout = Layout(specs, 64, max_shard_elems=1000)  # many shards per tensor
        for sid, bucket in layout.bucket_of.items():
            k = int(sid.split("-p")[1].split("of")[0])
            assert bucket % parts == k and 0 <= bucket < parts * (64 // parts)
        for k in range(parts):  # and they spread over its buckets
            own = {b for sid, b in layout.bucket_of.items() if f"-p{k}of" in sid}
            assert len(own) > 10


def test_other_shards_hash_as_before():
    for sid in ("fc1.w/3", "conv1.b/0", "adamps.board/0", "x-p1of2/0", "fc1-p5of2.w/1"):
        h = int.from_bytes(hashlib.blake2b(sid.encode(), digest_size=8).digest(), "little")
        assert stable_bucket(sid, 64) == h % 64
    # fewer buckets (or owner threads) than partitions: the plain hash, always in range
    assert stable_bucket("fc1-p2of3.w/0", 2) in (0, 1)
    assert all(0 <= stable_bucket(f"fc1-p{k}of3.w/{i}", 4) < 4 for k in range(3) for i in range(20))
