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
    group_of,
    pack_groups,
    parse_shard_id,
    placement_key,
    split_tensor,
    stable_bucket,
    ungrouped,
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


# -- placement groups -----------------------------------------------------------------------

#: buckets of plain shard ids (64 and 8 buckets) as the code before placement groups computed
#: them: existing runs, their LMDB copies and their checkpoints are placed where they were
PLAIN = {
    "conv1.w/0": (22, 6), "fc1.w/3": (1, 1), "fc1.w@g/3": (1, 1), "default..fc.weight/0": (12, 4),
    "k2..conv1-p1of2.w/0": (31, 7), "conv1-p0of2.b/0": (26, 2), "x/15": (0, 0),
    "t..a@lbfgs.s0/2": (17, 1),
}  # fmt: skip


@pytest.mark.parametrize(("sid", "want"), PLAIN.items())
def test_a_name_without_a_group_keeps_its_bucket(sid: str, want: tuple[int, int]) -> None:
    assert (stable_bucket(sid, 64), stable_bucket(sid, 8)) == want
    assert placement_key(sid) == sid.replace("@g", "").replace("@lbfgs.s0", "")


def test_a_groups_tensors_share_one_bucket_with_their_vectors() -> None:
    specs = [TensorSpec("r..{0}conv.w", (8, 1, 3, 3)), TensorSpec("r..{0}conv.b", (8,)),
             TensorSpec("r..{0}fc.w", (300, 100)), TensorSpec("r..{0}fc.w@g", (300, 100)),
             TensorSpec("r..{1}head.w", (10, 300)), TensorSpec("r..big", (2000, 300))]  # fmt: skip
    layout = Layout(specs, n_buckets=64, max_shard_elems=10_000)
    g0 = {layout.bucket_of[s.id] for n in layout.tensors if "{0}" in n for s in layout.shards_of[n]}
    assert len(layout.shards_of["r..{0}fc.w"]) == 3  # several shards, still one bucket
    assert g0 == {stable_bucket("r..{0}", 64)} and placement_key("r..{0}fc.w@g/2") == "r..{0}"
    # the group's name includes the part before the tag: another run's group 0 is another group
    assert placement_key("s..{0}fc.w/0") == "s..{0}"
    assert len(layout.buckets_of_tensor("r..big")) > 1  # an ungrouped tensor still spreads
    assert group_of("r..{1}head.w/0") == "r..{1}" and group_of("r..big/0") is None
    assert ungrouped("r..{1}head.w") == "r..head.w" == ungrouped("r..head.w")


def test_a_group_within_a_model_partition_stays_in_the_partitions_buckets() -> None:
    for n_buckets in (8, 64):
        for k in (0, 1):
            ids = [f"r..{{g{k}}}conv1-p{k}of2.w/0", f"r..{{g{k}}}conv1-p{k}of2.b/0",
                   f"r..{{g{k}}}fc1-p{k}of2.w/3"]  # fmt: skip
            buckets = {stable_bucket(i, n_buckets) for i in ids}
            assert len(buckets) == 1 and buckets.pop() % 2 == k


@pytest.mark.parametrize(
    "name",
    ["a{b", "a}b", "{}x", "r..{a.b}x", "r..{g}", "{g}{h}x", "{g}x{h}y", "r..{" + "g" * 33 + "}x",
     "{g}" + "x" * 129, "x" * 129 + "{g}y", "{g}x@", "r..{g\n}x"],
)  # fmt: skip
def test_a_bad_group_name_is_refused_naming_the_rule(name: str) -> None:
    with pytest.raises(LayoutError, match="placement group"):
        TensorSpec(name, (4,))


def test_good_group_names() -> None:
    for name in ("{g}x", "r..{0}x", "r..{a-b_C9}fc.w@v", "{" + "g" * 32 + "}" + "x" * 128):
        TensorSpec(name, (4,))


def test_pack_groups_first_fit_within_one_shard() -> None:
    sizes = [200_000, 200_000, 50_000, 50_000, 600_000, 262_144, 7]
    got = pack_groups(sizes)
    assert got == [0, 1, 0, 1, None, None, 0]  # 600,000: several shards; 262,144: alone
    assert got == pack_groups(list(sizes))  # from the sizes and their order alone
    for g in set(got) - {None}:
        assert sum(n for n, h in zip(sizes, got, strict=True) if h == g) <= MAX_SHARD_ELEMS
    # a small convnet's 12 tensors: one group, one bucket
    convnet = [288, 32, 32, 32, 18_432, 64, 64, 64, 57_344, 56, 3_840, 10]
    assert pack_groups(convnet) == [0] * 12
    assert pack_groups([5]) == [None] and pack_groups([]) == []
    assert pack_groups([3, 3, 3], max_elems=6) == [0, 0, None]


def test_the_numpy_engine_packs_its_layers_by_the_same_code() -> None:
    from trainer.model import Model, builtin, fuse_layers, in_namespace

    spec = fuse_layers(in_namespace(builtin("adam-mnist"), "r"), "r")
    names = [layer["name"] for layer in spec["layers"]]
    assert names == ["r..{0}conv1", "r..pool1", "r..{0}conv2", "r..pool2", "r..{0}fc1",
                     "r..{1}fc2", "r..{0}out"]  # fmt: skip
    tensors = Model(spec).tensors()
    layout = Layout([TensorSpec(n, s) for n, s in tensors], n_buckets=64)
    assert len(set(layout.bucket_of.values())) == 2  # 10 tensors, 2 buckets
    plain = Layout([TensorSpec(n, s) for n, s in Model(builtin("adam-mnist")).tensors()])
    assert len(set(plain.bucket_of.values())) > 2
    # one layer's weight and bias are two tensors: one group (no run: the tag comes first)
    assert fuse_layers(builtin("softmax-mnist"))["layers"][0]["name"] == "{0}out"
