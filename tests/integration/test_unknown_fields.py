"""A field an op does not take is refused, not ignored (found by a client written from docs/
only, session 19): a `round` with `fetch_row` for `fetch_rows`, a `vec` `scale` carrying `x`,
a `push_dense` with `hypr` for `hyper` were answered 200 and the misspelled part silently did
nothing. Now every op declares its fields once (adamps/server/api/opfields.py) and one check,
on `POST /rpc` and on the data port, answers `400 bad_request` naming the op and the field,
before anything is applied; the values pulled back are unchanged and the server keeps serving.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from adamps.client.dataplane import DataPlaneClient
from adamps.client.rpc import RpcError
from adamps.wire.protocol import ProtocolError
from tests.integration.test_hostile import TOKEN, Ps, _dp_answer

DIM = 4
IDS = np.array([1, 2, 3], np.int64)


@pytest.fixture(scope="module")
def ps(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Ps]:
    s = Ps(tmp_path_factory.mktemp("unknown-fields-ps"))
    s.call("create", name="w", shape=[100], optimizer={"kind": "sgd", "lr": -1.0})
    s.call("create", name="w@d", shape=[100], init={"kind": "constant", "value": 1.0})
    s.call("create_table", name="t", dim=DIM, init={"kind": "constant", "value": 0.5},
           optimizer={"kind": "sgd", "lr": 1.0})  # fmt: skip
    try:
        yield s
    finally:
        s.close()


def _state(ps: Ps) -> tuple[np.ndarray, dict[str, int], np.ndarray, np.ndarray]:
    """Everything the refused requests could have changed: w and its vector, and t's rows."""
    w = ps.call("pull", shards=["w/0"])
    d = ps.call("pull", tensors=["w@d"])["tensors"]["w@d"]
    rows = ps.call("pull_rows", table="t", ids=IDS)["rows"]
    return np.array(w["shards"]["w/0"]), w["versions"], np.array(d), np.array(rows)


def _assert_same(ps: Ps, before: tuple[Any, ...]) -> None:
    after = _state(ps)
    np.testing.assert_array_equal(after[0], before[0])
    assert after[1] == before[1]
    np.testing.assert_array_equal(after[2], before[2])
    np.testing.assert_array_equal(after[3], before[3])


def _grads() -> np.ndarray:
    return np.ones((len(IDS), DIM), np.float32)


#: op, fields (one of them unknown to the op), the unknown field
RPC_CASES: list[tuple[str, dict[str, Any], str]] = [
    ("round", {"rows": [{"table": "t", "ids": IDS, "grads": _grads()}],
               "fetch_row": [{"table": "t", "ids": IDS}]}, "fetch_row"),
    ("push_dense", {"tensor": "w", "delta": np.ones(100, np.float32),
                    "hypr": {"w": {"lr": -2.0}}}, "hypr"),
    ("pull", {"tensors": ["w"], "shard": ["w/0"]}, "shard"),
    ("vec", {"kind": "axpy", "shards": ["w/0"], "y": "", "x": "d", "alhpa": 2.0}, "alhpa"),
    ("push_rows", {"table": "t", "ids": IDS, "grads": _grads(), "lr": 0.5}, "lr"),
    ("pull_rows", {"table": "t", "ids": IDS, "fetch": True}, "fetch"),
]  # fmt: skip


@pytest.mark.parametrize(("op", "fields", "unknown"), RPC_CASES, ids=[c[0] for c in RPC_CASES])
def test_an_unknown_field_is_refused_on_rpc_naming_it(
    ps: Ps, op: str, fields: dict[str, Any], unknown: str
) -> None:
    before = _state(ps)
    with pytest.raises(RpcError) as err:
        ps.call(op, **fields)
    assert err.value.status == 400 and err.value.code == "bad_request", err.value
    assert f"op {op!r}" in err.value.message and repr(unknown) in err.value.message, err.value
    _assert_same(ps, before)


@pytest.mark.parametrize(
    ("kind", "fields", "extra"),
    [
        ("scale", {"alpha": 2.0, "x": "d"}, "'x'"),
        ("scale", {"alpha": 2.0, "values": np.ones(3, np.float32)}, "'values'"),
        ("copy", {"x": "d", "alpha": 2.0}, "'alpha'"),
        ("mul", {"x": "d", "offset": 1}, "'offset'"),
    ],
)
def test_a_vec_field_of_another_kind_is_refused(
    ps: Ps, kind: str, fields: dict[str, Any], extra: str
) -> None:
    """`vec` takes x, alpha, values and offset, each for some kinds only (docs/protocol-ps.md,
    "Vector operations"): a `scale` carrying `x` was applied as a plain scale."""
    before = _state(ps)
    with pytest.raises(RpcError) as err:
        ps.call("vec", kind=kind, shards=["w/0"], y="", **fields)
    assert err.value.status == 400 and err.value.code == "bad_request", err.value
    assert f"kind {kind!r}" in err.value.message and extra in err.value.message, err.value
    _assert_same(ps, before)


def test_an_unknown_field_of_an_entry_is_refused(ps: Ps) -> None:
    """The maps inside a request (a round's `rows` and `fetch_rows` entries, a `layers` layer)
    are held to their fields too: nothing applied."""
    ps.call("create", name="m", shape=[4, 5], optimizer={"kind": "sgd", "lr": -1.0})
    before, m0 = _state(ps), ps.pull("m")
    a, e = np.ones((1, 5), np.float32), np.ones((1, 4), np.float32)
    cases = [
        ("round", {"rows": [{"table": "t", "ids": IDS, "grads": _grads(), "scale": 2.0}]},
         "'rows'", "'scale'"),
        ("round", {"fetch_rows": [{"table": "t", "id": IDS, "ids": IDS}]}, "'fetch_rows'", "'id'"),
        ("round", {"layers": {"m": {"a": a, "e": e, "shard": ["m/0"]}}}, "layer 'm'", "'shard'"),
        ("push_fc", {"layers": {"m": {"a": a, "e": e, "lr": 1.0}}}, "layer 'm'", "'lr'"),
    ]  # fmt: skip
    for op, fields, where, unknown in cases:
        with pytest.raises(RpcError) as err:
            ps.call(op, **fields)
        assert err.value.status == 400 and err.value.code == "bad_request", err.value
        assert where in err.value.message and unknown in err.value.message, err.value
    _assert_same(ps, before)
    np.testing.assert_array_equal(ps.pull("m"), m0)


def test_an_unknown_field_is_refused_on_the_data_port(ps: Ps) -> None:
    """The data port's frames (push_dense, pull) and its message ops (round, push_rows,
    pull_rows: the /rpc message as the frame's meta) take the same check."""
    before = _state(ps)
    ones = np.ones(100, np.float32)
    frames = [
        ("push_dense", {"tensor": "w", "clinet": "c"}, ones.tobytes(), "clinet"),
        ("pull", {"tensor": "w", "shard": ["w/0"]}, b"", "shard"),
    ]
    for op, fields, payload, unknown in frames:
        meta = {"op": op, "v": 1, "rid": "u", "token": TOKEN, **fields}
        got = _dp_answer(ps.data_port, meta, payload)
        assert got["kind"] == 3 and got["error"]["code"] == "bad_request", got
        assert repr(unknown) in got["error"]["message"], got
        assert got["error"]["unknown"] == [unknown], got
    messages = [(op, fields, unknown) for op, fields, unknown in RPC_CASES
                if op in ("round", "push_rows", "pull_rows")]  # fmt: skip
    for op, fields, unknown in messages:
        with DataPlaneClient("127.0.0.1", ps.data_port, TOKEN) as dp:
            assert dp.send_message(op, **fields)
            with pytest.raises(ProtocolError) as err:
                dp.read_message_reply()
        assert err.value.code == "bad_request", (op, err.value)
        assert f"op {op!r}" in err.value.message and repr(unknown) in err.value.message
    _assert_same(ps, before)


def test_each_op_without_the_unknown_field_is_served(ps: Ps) -> None:
    """The same requests, typo removed, are applied (on both transports): the refusals above
    are the unknown field's, not the request's."""
    ps.call("round", rows=[{"table": "t", "ids": IDS, "grads": _grads()}],
            fetch_rows=[{"table": "t", "ids": IDS}])  # fmt: skip
    ps.call("push_dense", tensor="w", delta=np.ones(100, np.float32), hyper={"w": {"lr": -2.0}})
    ps.call("vec", kind="scale", shards=["w/0"], y="", alpha=0.5)
    np.testing.assert_array_equal(ps.call("pull", tensors=["w"])["tensors"]["w"], np.ones(100))
    with DataPlaneClient("127.0.0.1", ps.data_port, TOKEN) as dp:
        dp.push_dense("w", np.ones(100, np.float32))
        np.testing.assert_array_equal(dp.pull("w")[0], np.full(100, 2.0))
        assert dp.send_message("pull_rows", table="t", ids=IDS)
        rows = dp.read_message_reply()["rows"]
    np.testing.assert_allclose(np.asarray(rows).reshape(-1, DIM), np.full((3, DIM), -0.5))


def test_an_unknown_field_of_an_install_or_a_definition_is_refused(ps: Ps) -> None:
    """The maps inside `ckpt_install` (a shard's {v, a, n}, a row shard's {b, n}) and each
    definition of `create_tensors` ({name, shape, init, optimizer}) are held to their fields
    (an accumulator sent as `acc` was dropped and the shard restored without it; a
    definition's `optimiser` made a tensor with the default optimizer). So is `create`'s init
    spec. Nothing is applied or created."""
    b = ps.ps.store.layout.bucket_of["w/0"]
    read = ps.call("ckpt_read", bucket=b)
    rec = read["shards"]["w/0"]
    before, names = _state(ps), ps.call("list")["tensors"]
    row_id = next(iter(read["rows"]), None)
    cases: list[tuple[str, dict[str, Any], str, str]] = [
        ("ckpt_install", {"bucket": b, "force": True,
                          "shards": {"w/0": {"v": rec["v"] + 1, "acc": np.ones(100, np.float32)}}},
         "shard 'w/0'", "'acc'"),
        # a ckpt_read record as read: its `version` is `n` in an install
        ("ckpt_install", {"bucket": b, "force": True,
                          "shards": {"w/0": {"v": rec["v"] + 1, "version": 3}}},
         "shard 'w/0'", "'version'"),
        ("create_tensors", {"tensors": [{"name": "new", "shape": [4],
                                         "optimiser": {"kind": "adagrad"}}]},
         "tensors[0]", "'optimiser'"),
        ("create", {"name": "new", "shape": [4], "init": {"kind": "constant", "valeu": 2.0}},
         "init 'constant'", "valeu"),
    ]  # fmt: skip
    if row_id is not None:
        cases.append(("ckpt_install", {"bucket": b, "force": True,
                                       "rows": {row_id: {"b": read["rows"][row_id]["b"], "v": 1}}},
                      f"row shard {row_id!r}", "'v'"))  # fmt: skip
    for op, fields, where, unknown in cases:
        with pytest.raises(RpcError) as err:
            ps.call(op, **fields)
        assert err.value.status == 400 and err.value.code == "bad_request", (op, err.value)
        assert where in err.value.message and unknown in err.value.message, err.value
    _assert_same(ps, before)
    assert ps.call("list")["tensors"] == names
