"""The client's checks of a whole push before any part is sent (issue 39), and the error of a push
applied in part. Pure: no process (the cluster tests are tests/system/test_split_push.py)."""

from __future__ import annotations

import numpy as np
import pytest

from adamps.client import PartialPushError, push_checks
from adamps.client.partial import NOT_SENT, partial_of
from adamps.client.rpc import RpcError
from adamps.layout import Layout, TensorSpec
from adamps.server.decode import fc
from adamps.server.updates import bounds
from adamps.wire import protocol

LAYOUT = Layout([TensorSpec("w", (6, 4)), TensorSpec("v", (10,))], n_buckets=4, max_shard_elems=8)


def refused(code: str, fn, *args):  # type: ignore[no-untyped-def]
    with pytest.raises(RpcError) as exc:
        fn(*args)
    assert exc.value.code == code, exc.value
    assert 400 <= exc.value.http_status < 500 and "nothing was sent" in str(exc.value)
    return exc.value


def test_the_client_checks_against_the_servers_bounds() -> None:
    assert push_checks.MAX_GRAD == bounds.MAX_GRAD == protocol.MAX_GRAD
    assert push_checks.MAX_FC_K == protocol.MAX_FC_K == fc.MAX_FC_K


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_non_finite_value_anywhere_refuses_every_kind_of_push(bad: float) -> None:
    w = np.ones((6, 4), np.float32)
    w[5, 3] = bad  # in the last shard only
    err = refused("non_finite", push_checks.dense, LAYOUT, "w", w)
    assert "holds 1 NaN/Inf" in str(err)
    last = LAYOUT.shards_of["w"][-1]
    refused("non_finite", push_checks.shards, LAYOUT, {last.id: w.reshape(-1)[last.start :]})
    g = np.ones((3, 2), np.float32)
    g[2, 1] = bad
    refused("non_finite", push_checks.rows, np.arange(3), g, 2)
    e = np.ones((2, 6), np.float32)
    e[1, 1] = bad
    refused("non_finite", push_checks.fc, LAYOUT, "w", np.ones((2, 4)), e)
    sid = LAYOUT.shards_of["v"][0].id
    update = {"tau": bad, "words": np.array([0], np.uint32)}
    refused("non_finite", push_checks.compressed, LAYOUT, {sid: update})


def test_shapes_dtypes_ids_and_sizes_are_checked() -> None:
    refused("unknown_tensor", push_checks.dense, LAYOUT, "nope", np.ones(3))
    refused("bad_shape", push_checks.dense, LAYOUT, "w", np.ones((4, 6)))
    refused("bad_dtype", push_checks.dense, LAYOUT, "w", np.full((6, 4), "x"))
    refused("unknown_tensor", push_checks.shards, LAYOUT, {"nope/0": np.ones(8)})
    sid = LAYOUT.shards_of["w"][0].id
    refused("bad_shape", push_checks.shards, LAYOUT, {sid: np.ones(7)})
    refused("bad_shape", push_checks.rows, np.arange(3), np.ones((2, 2)), 2)
    refused("bad_shape", push_checks.rows, np.arange(3), np.ones((3, 3)), 2)
    refused("bad_shape", push_checks.fc, LAYOUT, "w", np.ones((2, 4)), np.ones((3, 6)))
    refused("bad_shape", push_checks.fc, LAYOUT, "w", np.ones((2, 5)), np.ones((2, 6)))
    refused("bad_request", push_checks.fc, LAYOUT, "v", np.ones((2, 1)), np.ones((2, 10)))
    vid = LAYOUT.shards_of["v"][0].id
    for bad in (
        {"tau": 1.0},
        {"tau": -1.0, "words": np.array([0], np.uint32)},
        {"tau": 1.0, "words": np.array([4, 2], np.uint32)},  # not sorted
        {"tau": 1.0, "words": np.array([100], np.uint32)},  # beyond the shard
        {"tau": 1.0, "rice": np.zeros(2, np.uint8), "n": 99, "k": 1},
        # both encodings: the servers refuse it, so the client must before any part is sent
        {
            "tau": 1.0,
            "words": np.array([0], np.uint32),
            "rice": np.zeros(1, np.uint8),
            "n": 1,
            "k": 0,
        },
    ):
        refused("bad_request", push_checks.compressed, LAYOUT, {vid: bad})
    refused("bad_dtype", push_checks.compressed, LAYOUT, {vid: {"tau": 1.0, "words": np.zeros(1)}})


def test_values_beyond_the_servers_bound_are_refused_before_sending() -> None:
    refused("bad_request", push_checks.dense, LAYOUT, "v", np.full(10, 2e12))
    refused("bad_request", push_checks.fc, LAYOUT, "w", np.full((2, 4), 1e6), np.full((2, 6), 1e6))
    vid = LAYOUT.shards_of["v"][0].id
    update = {"tau": 1e13, "words": np.array([0], np.uint32)}
    refused("bad_request", push_checks.compressed, LAYOUT, {vid: update})


def test_good_pushes_pass_as_float32_of_their_shapes() -> None:
    w = push_checks.dense(LAYOUT, "w", np.ones((6, 4), np.float64))
    assert w.dtype == np.float32 and w.flags.c_contiguous
    got = push_checks.shards(LAYOUT, {s.id: np.ones(s.size) for s in LAYOUT.shards_of["w"]})
    assert all(got[s.id].shape == s.shape for s in LAYOUT.shards_of["w"])
    a, e = push_checks.fc(LAYOUT, "w", np.ones((3, 4)), np.ones((3, 6)))
    assert a.dtype == e.dtype == np.float32
    assert push_checks.rows(np.arange(2), np.ones((2, 5)), None).shape == (2, 5)
    vid = LAYOUT.shards_of["v"][0].id
    push_checks.compressed(LAYOUT, {vid: {"tau": 0.5, "words": np.array([0, 3, 9], np.uint32)}})


def test_a_partial_push_names_the_parts_applied_and_the_others() -> None:
    cause = RpcError("unavailable", "bucket 3 has no primary", 503)
    assert partial_of(cause, "push_rows", "c1", 7, {1: "http://a"}, [], [1, 3]) is None
    err = partial_of(cause, "push_rows", "c1", 7, {1: "http://a", 2: "http://b"}, [1], [1, 2, 3])
    assert isinstance(err, PartialPushError) and not isinstance(err, RpcError)
    assert err.applied == {1: "http://a"}
    assert err.unconfirmed == {2: "http://b", 3: NOT_SENT}
    assert err.code == "unavailable" and err.cause is cause and err.seq == 7
    text = str(err)
    assert "[1] on http://a applied" in text and "seq=7" in text and "unavailable" in text
