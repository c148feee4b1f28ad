"""A sweep of every port with what tests/integration/test_fuzz.py, test_ps_hardening.py and
system/test_ps_bad_input.py do not send (session 20), each server in-process on loopback:

- the parameter server's /rpc: every field of a sample of ops replaced, one at a time, by a
  value of each wrong type: a 4xx with a JSON error naming the field, nothing changed;
- its data port: a valid frame cut at every boundary (inside the header, the meta, the
  payload) and frames whose lengths claim more than the limits: an error frame or a closed
  connection, never a wait for bytes that will not come, nothing changed, the port serving;
- the data server's port: bytes that are not HTTP, and its elastic ops (/lease, /complete,
  /heartbeat) and /stream with wrong types and unknown fields: a 4xx JSON error;
- the controller: every write endpoint with a body that is not JSON, JSON that is not an
  object, and JSON nested past the parser's depth: a 4xx JSON error, nothing proposed.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from typing import Any

import msgpack
import numpy as np
import pytest

from adamps.client.dataplane import REQUEST, frame_header
from adamps.client.rpc import RpcError
from adamps.server.api import dataplane
from adamps.wire import protocol
from tests.integration.test_fuzz import (
    ControllerUnderTest,
    DataServerUnderTest,
    assert_client_error,
    healthy,
    http_call,
)
from tests.integration.test_hostile import TOKEN, Ps

DIM = 4
IDS = np.array([1, 2, 3], np.int64)


@pytest.fixture(scope="module")
def ps(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Ps]:
    s = Ps(tmp_path_factory.mktemp("sweep-ps"))
    s.call("create", name="w", shape=[100], init={"kind": "constant", "value": 1.0})
    s.call("create_table", name="t", dim=DIM, init={"kind": "constant", "value": 0.5})
    try:
        yield s
    finally:
        s.close()


def _state(ps: Ps) -> tuple[bytes, Any, bytes, Any]:
    w = ps.call("pull", tensors=["w"])
    rows = ps.call("pull_rows", table="t", ids=IDS)["rows"]
    return (np.asarray(w["tensors"]["w"]).tobytes(), w["versions"],
            np.asarray(rows).tobytes(), ps.call("list_tables")["tables"])  # fmt: skip


# -- the parameter server's /rpc: wrong types, field by field -----------------------------------

#: a value of each wire type (an f64 array is a well-formed array of a dtype the PS refuses)
WRONG: dict[str, Any] = {
    "bool": True,
    "int": 7,
    "float": 1.5,
    "str": "x",
    "list": [],
    "map": {},
    "f64": np.zeros(2, np.float64),
}
#: the wire types each field may take (the others are wrong for it)
RIGHT = {
    "str": ("str",), "int": ("int",), "float": ("float", "int"), "list": ("list",),
    "map": ("map",), "array": (), "ids": ("list",),
}  # fmt: skip


def _grads() -> np.ndarray:
    return np.ones((len(IDS), DIM), np.float32)


#: op -> (a valid request, its fields' kinds (RIGHT's keys))
SAMPLE: dict[str, tuple[dict[str, Any], dict[str, str]]] = {
    "push_dense": ({"tensor": "w", "delta": np.ones(100, np.float32), "client": "c", "seq": 1},
                   {"tensor": "str", "delta": "array", "client": "str", "seq": "int"}),
    "push_rows": ({"table": "t", "ids": IDS, "grads": _grads()},
                  {"table": "str", "ids": "ids", "grads": "array"}),
    "put_rows": ({"table": "t", "ids": IDS, "values": _grads()},
                 {"table": "str", "ids": "ids", "values": "array"}),
    "vec": ({"kind": "scale", "shards": ["w/0"], "y": "", "alpha": 2.0},
            {"kind": "str", "shards": "list", "y": "str", "alpha": "float"}),
    "round": ({"rows": [{"table": "t", "ids": IDS, "grads": _grads()}], "fetch_shards": ["w/0"]},
              {"rows": "list", "fetch_shards": "list"}),
    "create_table": ({"name": "t2", "dim": DIM, "init": {"kind": "zeros"}},
                     {"name": "str", "dim": "int", "init": "map"}),
    "create": ({"name": "w2", "shape": [8], "optimizer": {"kind": "sgd"}},
               {"name": "str", "shape": "list", "optimizer": "map"}),
    "ckpt_hold": ({"cut": "c1", "seconds": 1.0}, {"cut": "str", "seconds": "float"}),
}  # fmt: skip

CASES = [
    (op, name, wrong)
    for op, (_msg, kinds) in SAMPLE.items()
    for name, kind in kinds.items()
    for wrong in WRONG
    if wrong not in RIGHT[kind]
]


@pytest.mark.parametrize(("op", "field", "wrong"), CASES, ids=[f"{o}-{f}-{w}" for o, f, w in CASES])
def test_a_field_of_a_wrong_type_is_refused_naming_it(
    ps: Ps, op: str, field: str, wrong: str
) -> None:
    before = _state(ps)
    msg = {**SAMPLE[op][0], field: WRONG[wrong]}
    with pytest.raises(RpcError) as err:
        ps.call(op, **msg)
    assert 400 <= err.value.status < 500, (op, field, wrong, err.value)
    assert field in err.value.message or err.value.code in ("bad_dtype", "bad_shape"), err.value
    assert _state(ps) == before


def test_the_sample_requests_are_valid(ps: Ps) -> None:
    """The base of every case above is served: a refusal there is its wrong field's."""
    for op in ("vec", "round", "push_rows"):
        ps.call(op, **SAMPLE[op][0])


# -- the parameter server's data port: truncated and oversized frames ---------------------------


def _exchange(port: int, data: bytes, close: bool = True) -> tuple[bytes, float]:
    """Sends `data`, half-closes (if `close`), returns what came back and how long it took."""
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(data)
        if close:
            s.shutdown(socket.SHUT_WR)
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
        except (ConnectionResetError, TimeoutError):
            pass
    return out, time.monotonic() - t0


def _frames(reply: bytes) -> list[tuple[int, Any]]:
    out, pos = [], 0
    while pos + dataplane.HEADER.size <= len(reply):
        _m, _v, kind, _z, mlen, plen = dataplane.HEADER.unpack_from(reply, pos)
        start = pos + dataplane.HEADER.size
        out.append((kind, msgpack.unpackb(reply[start : start + mlen])))
        pos = start + mlen + plen
    return out


def _push_frame(value: float) -> bytes:
    meta = protocol.encode(protocol.request("push_dense", tensor="w", token=TOKEN))
    payload = np.full(100, value, np.float32).tobytes()
    return frame_header(REQUEST, len(meta), len(payload)) + meta + payload


def test_a_frame_cut_anywhere_is_dropped_and_changes_nothing(ps: Ps) -> None:
    frame = _push_frame(5.0)
    meta_end = len(frame) - 400  # the payload: 100 float32
    before = _state(ps)
    for cut in (1, 7, dataplane.HEADER.size - 1, dataplane.HEADER.size, meta_end - 3, meta_end,
                meta_end + 1, len(frame) - 1):  # fmt: skip
        reply, took = _exchange(ps.data_port, frame[:cut])
        assert took < 5, cut
        for kind, meta in _frames(reply):  # nothing, or an error that is not internal
            assert kind == dataplane.ERROR and meta["error"]["code"] != "internal", (cut, meta)
    assert _state(ps) == before
    healthy(ps.port)


@pytest.mark.parametrize(
    ("meta_len", "payload_len"),
    [(1 << 31, 0), (2**32 - 1, 2**64 - 1), (64, 1 << 62), (64, (1 << 40) + 3)],
)
def test_a_frame_claiming_more_than_the_limits_is_refused_at_once(
    ps: Ps, meta_len: int, payload_len: int
) -> None:
    """The header alone is enough to refuse it: not a wait for gigabytes that never come."""
    before = _state(ps)
    header = dataplane.HEADER.pack(dataplane.MAGIC, 1, dataplane.REQUEST, 0, meta_len, payload_len)
    reply, took = _exchange(ps.data_port, header + b"\0" * 64, close=False)
    assert took < 5
    for kind, meta in _frames(reply):
        assert kind == dataplane.ERROR and meta["error"]["code"] in ("too_large", "malformed"), meta
    assert _state(ps) == before
    healthy(ps.port)


# -- the data server's port ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def data_server() -> Iterator[DataServerUnderTest]:
    d = DataServerUnderTest()
    try:
        yield d
    finally:
        d.close()


@pytest.mark.parametrize(
    "junk",
    [b"\x00\xff" * 64, b"GARBAGE\r\n\r\n", b"POST /stream HTTP/9.9\r\n\r\n",
     b"POST /lease HTTP/1.1\r\nContent-Length: -5\r\n\r\n", b"\x16\x03\x01\x02\x00\x01\x00"],
)  # fmt: skip
def test_garbage_on_the_data_servers_port_is_a_json_4xx(
    data_server: DataServerUnderTest, junk: bytes
) -> None:
    reply, took = _exchange(data_server.port, junk)
    assert took < 5
    assert reply.startswith((b"HTTP/1.1 4", b"HTTP/1.0 4")) or reply == b"", reply[:200]
    if reply:
        assert b"application/json" in reply, reply[:300]
    healthy(data_server.port)


ELASTIC = {
    "/lease": {"op": "lease", "run": "r", "replica": "a", "epochs": 1, "seq": 1},
    "/complete": {"op": "complete", "run": "r", "replica": "a", "epoch": 0, "slice": 0},
    "/heartbeat": {"op": "heartbeat", "run": "r", "replica": "a"},
    "/stream": {"op": "stream", "replica": 0, "n_replicas": 1, "epoch": 0, "batch_size": 8},
}
DS_CASES = [
    (path, {**msg, **change}, named)
    for path, msg in ELASTIC.items()
    for change, named in (
        ({"replica": 1.5}, "replica"),
        ({"replica": None}, "replica"),
        ({"run": ["r"]} if "run" in msg else {"epoch": "0"}, "run" if "run" in msg else "epoch"),
        ({"replcia": "a"}, "replcia"),  # an unknown field: refused, not ignored
    )
]


@pytest.mark.parametrize(("path", "msg", "named"), DS_CASES)
def test_a_data_server_request_of_a_wrong_type_or_field_is_refused(
    data_server: DataServerUnderTest, path: str, msg: dict[str, Any], named: str
) -> None:
    runs = data_server.server.elastic.status()
    body = msgpack.packb({"v": 1, "rid": "x", **msg}, use_bin_type=True)
    status, reply, ctype = http_call(data_server.port, "POST", path, body)
    err = assert_client_error(status, reply, ctype)
    assert named in err["error"]["message"], err
    assert data_server.server.elastic.status() == runs


# -- the controller's HTTP API ------------------------------------------------------------------


@pytest.fixture(scope="module")
def controller(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControllerUnderTest]:
    c = ControllerUnderTest(tmp_path_factory.mktemp("sweep-ctl"))
    try:
        yield c
    finally:
        c.close()


WRITES = [
    "/progress", "/layout", "/rebalance", "/runs", "/runs/r/usage", "/servers/ps-1/register",
    "/servers/ps-1/heartbeat", "/servers/ps-1/drain", "/servers/ps-1/undrain",
    "/servers/ps-1/peer-keys", "/buckets/0/role-change", "/buckets/0/caught-up",
    "/buckets/0/release", "/buckets/0/drop-secondary", "/buckets/0/declare-lost",
]  # fmt: skip
BODIES = [
    b"\x93\x01\x02\x03",  # msgpack, not JSON
    b"{'a': 1}",
    b'{"a": 1',
    b"[1, 2]",
    b'"text"',
    b"[" * 50_000 + b"]" * 50_000,  # past the decoder's recursion limit
    b'{"a": ' * 30_000 + b"1" + b"}" * 30_000,
]


@pytest.mark.parametrize("path", WRITES)
def test_every_controller_write_refuses_bodies_that_are_not_a_json_object(
    controller: ControllerUnderTest, path: str
) -> None:
    before = controller.applied()
    for body in BODIES:
        status, reply, ctype = http_call(
            controller.port, "POST", path, body, {"Content-Type": "application/json"}
        )
        err = assert_client_error(status, reply, ctype)
        assert err["error"]["code"] in ("malformed", "too_large", "bad_request", "not_found"), (
            path, body[:20], err)  # fmt: skip
        assert controller.applied() == before, (path, body[:20])
    healthy(controller.port)
    json.loads(http_call(controller.port, "GET", "/routing", None)[1])
