"""adamps.wire.protocol: envelope, zero-copy arrays, and every kind of bad input named."""

from __future__ import annotations

import json

import msgpack
import numpy as np
import pytest

from adamps.wire import protocol
from adamps.wire.protocol import ProtocolError


@pytest.mark.parametrize("dtype", sorted(protocol.ALLOWED_DTYPES))
def test_array_round_trip_zero_copy(dtype: str) -> None:
    arr = (np.arange(24) % 7).astype(dtype).reshape(2, 3, 4)
    body = protocol.encode(protocol.request("push", x=arr, nested={"y": [arr[0]]}))
    msg = protocol.decode(body)
    np.testing.assert_array_equal(msg["x"], arr)
    np.testing.assert_array_equal(msg["nested"]["y"][0], arr[0])
    assert not msg["x"].flags.writeable  # a view of the received bytes
    assert msg["op"] == "push" and msg["v"] == protocol.VERSION and isinstance(msg["rid"], str)


def test_non_contiguous_and_big_endian_arrays_are_sent_correctly() -> None:
    a = np.arange(20, dtype=np.float32).reshape(4, 5)[:, ::2]
    b = np.arange(5, dtype=">f4")
    msg = protocol.decode(protocol.encode({"a": a, "b": b}))
    np.testing.assert_array_equal(msg["a"], a)
    np.testing.assert_array_equal(msg["b"], b)


def test_rids_are_unique() -> None:
    assert len({protocol.new_rid() for _ in range(1000)}) == 1000


def _err(fn, code: str) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        fn()
    assert info.value.code == code, info.value
    return info.value


def test_malformed_bodies() -> None:
    e = _err(lambda: protocol.decode(b"\xc1garbage"), "malformed")
    # the message names the problem, not an empty "...: " (msgpack's FormatError has no text)
    assert e.message.endswith("FormatError (a byte that starts no msgpack value)"), e.message
    e = _err(lambda: protocol.decode(b"\x91" * 100_000 + b"\x00"), "malformed")
    assert e.message.endswith("StackError (arrays or maps nested too deeply)"), e.message
    _err(lambda: protocol.decode(msgpack.packb([1, 2])), "malformed")
    _err(lambda: protocol.decode(b""), "malformed")


def test_bad_arrays_named() -> None:
    def body(**arr) -> bytes:
        return msgpack.packb({"op": "push", "v": 1, "x": arr})

    e = _err(
        lambda: protocol.decode(body(dtype="complex64", shape=[1], data=b"\0" * 8)), "bad_dtype"
    )
    assert "complex64" in e.message
    e = _err(
        lambda: protocol.decode(body(dtype="float32", shape=[3], data=b"\0" * 8)), "bad_length"
    )
    assert "12" in e.message and "8" in e.message
    _err(lambda: protocol.decode(body(dtype="float32", shape=[-1], data=b"")), "bad_array")
    _err(lambda: protocol.decode(body(dtype="float32", shape="3", data=b"")), "bad_array")


def test_envelope_and_fields() -> None:
    _err(lambda: protocol.check_message({"op": "pull", "v": 2}, {"pull"}), "unsupported_version")
    _err(lambda: protocol.check_message({"op": "zap", "v": 1}, {"pull"}), "unknown_op")
    assert protocol.check_message({"op": "pull", "v": 1}, {"pull"}) == "pull"
    _err(lambda: protocol.require({}, "name", str), "bad_request")
    _err(lambda: protocol.require({"n": True}, "n", int), "bad_request")
    assert protocol.require({"lr": 1}, "lr", float) == 1.0
    _err(lambda: protocol.require_array({"x": np.zeros(2, np.float64)}, "x"), "bad_dtype")
    _err(
        lambda: protocol.require_array({"x": np.zeros((2, 3), np.float32)}, "x", shape=(None, 4)),
        "bad_shape",
    )
    _err(
        lambda: protocol.require_array({"x": np.array([1.0, np.nan], np.float32)}, "x"),
        "non_finite",
    )
    _err(lambda: protocol.require_array({"x": np.array([np.inf], np.float32)}, "x"), "non_finite")


def test_error_body_round_trip() -> None:
    body = protocol.error_body("not_primary", "bucket 3 moved", "r1", bucket=3, epoch=7)
    assert json.loads(body)["error"]["code"] == "not_primary"
    err = protocol.error_from_body(409, body)
    assert err.code == "not_primary" and err.extra == {"bucket": 3, "epoch": 7}
    assert protocol.error_from_body(502, b"<html>").code == "internal"
    with pytest.raises(ValueError):
        ProtocolError("no_such_code", "x")


def test_encode_parts_is_encode_in_pieces_with_arrays_uncopied() -> None:
    """A large reply is written piece by piece (adamps.wire.web.send_message, issue 39): the pieces
    join into exactly `encode`'s bytes, and each array's piece is the array's own memory."""
    big = np.arange(70_000, dtype=np.int64)
    msg = {"a": 1, "x": np.ones(3, np.float32), "y": [np.zeros(0, np.float32), big],
           "z": {"q": np.ones((2, 300), np.float32)}, "s": "text"}  # fmt: skip
    parts, total = protocol.encode_parts(msg)
    joined = b"".join(bytes(p) for p in parts)
    assert joined == protocol.encode(msg) and total == len(joined)
    assert any(isinstance(p, memoryview) and p.obj is not None and len(p) == big.nbytes
               and np.shares_memory(np.frombuffer(p, np.int64), big) for p in parts)  # fmt: skip
    assert protocol.encode_parts({"a": 1})[0] == [protocol.encode({"a": 1})]


@pytest.mark.parametrize("empty", [{}, []], ids=["maps", "lists"])
def test_a_message_of_more_containers_than_the_limit_is_refused(empty: object) -> None:
    """The decoder counts every map and list it builds (issue 12) and stops past the limit,
    whichever kind; exactly the limit decodes."""
    half = protocol.MAX_CONTAINERS // 2
    body = msgpack.packb({"v": 1, "a": [empty] * half, "b": [empty] * half})
    with pytest.raises(ProtocolError) as e:
        protocol.decode(body)
    assert e.value.code == "too_large"
    ok = msgpack.packb({"v": 1, "a": [empty] * (half - 3), "b": [empty] * half})
    assert len(protocol.decode(ok)["b"]) == half


def _oob(arr_map: dict, payload: bytes) -> dict:
    return protocol.decode(msgpack.packb({"a": arr_map}), payload)


@pytest.mark.parametrize(
    ("arr_map", "code"),
    [
        ({"dtype": "float32", "shape": [2], "at": -1}, "bad_array"),
        ({"dtype": "float32", "shape": [2], "at": True}, "bad_array"),
        ({"dtype": "float32", "shape": [2], "at": 17}, "bad_array"),
        ({"dtype": "float32", "shape": [2], "at": "0"}, "bad_array"),
        ({"dtype": "float16x", "shape": [2], "at": 0}, "bad_dtype"),
        ({"dtype": 3, "shape": [2], "at": 0}, "bad_array"),
        ({"dtype": "float32", "shape": 2, "at": 0}, "bad_array"),
        ({"dtype": "float32", "shape": [2, -1], "at": 0}, "bad_array"),
        ({"dtype": "float32", "shape": [2.0], "at": 0}, "bad_array"),
        ({"dtype": "float32", "shape": [3], "at": 8}, "bad_length"),
        ({"dtype": "float32", "shape": [5], "at": 0}, "bad_length"),
    ],
)
def test_an_out_of_band_array_outside_its_payload_is_refused(arr_map: dict, code: str) -> None:
    """An out-of-band array map (the data plane's repl_multi frames) is checked as an inline
    one is before a view is made: offset, dtype, shape, and its bytes inside the payload."""
    with pytest.raises(ProtocolError) as e:
        _oob(arr_map, bytes(16))
    assert e.value.code == code


def test_an_out_of_band_array_is_a_read_only_view_of_the_payload() -> None:
    payload = bytearray(np.arange(6, dtype=np.float32).tobytes())
    arr = _oob({"dtype": "float32", "shape": [2, 2], "at": 8}, payload)["a"]
    assert arr.dtype == np.float32 and arr.shape == (2, 2) and not arr.flags.writeable
    assert arr.tolist() == [[2.0, 3.0], [4.0, 5.0]]
    empty = _oob({"dtype": "int64", "shape": [0, 3], "at": 24}, payload)["a"]
    assert empty.shape == (0, 3) and empty.dtype == np.int64
