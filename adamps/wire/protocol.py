"""The wire protocol: the one module that knows msgpack.

Every request is a msgpack map ``{"op": str, "v": int, "rid": str, ...fields}``; every successful
reply is a msgpack map ``{"rid": str, ...fields}``; every error reply is JSON (so that curl and a
human can read it) ``{"error": {"code": str, "message": str, ...}, "rid": str | null}`` with the
HTTP status of its code.

A numpy array anywhere inside a message travels as the map ``{"dtype": str, "shape": [int],
"data": bin}`` (C order, little endian). It is decoded with ``np.frombuffer`` on the received bytes:
no copy, and the result is read-only, so a handler cannot scribble on a request by accident.
``docs/protocol.md`` is the specification that a client in another language is written from.
"""

from __future__ import annotations

import itertools
import json
import math
import os
from collections.abc import Collection, Mapping
from typing import Any

import msgpack
import numpy as np

VERSION = 1

#: the most magnitude of one push's gradient element (and of k * max|a| * max|e| for
#: activation/error vectors): docs/protocol-ps.md, "Finite values". Here, not in the servers'
#: bounds, because the client checks a whole push against it before sending any part (issue 39)
MAX_GRAD = 1e12
#: most rows k of the activation/error vectors of one push_fc (the same reason)
MAX_FC_K = 65_536

#: dtype name on the wire -> numpy dtype (explicit little endian, whatever the host).
ALLOWED_DTYPES: dict[str, np.dtype] = {
    "float32": np.dtype("<f4"),
    "float64": np.dtype("<f8"),
    "int32": np.dtype("<i4"),
    "int64": np.dtype("<i8"),
    "uint8": np.dtype("u1"),
    "uint32": np.dtype("<u4"),
}

#: error code -> (HTTP status, what it means). docs/protocol.md lists the same table.
ERRORS: dict[str, tuple[int, str]] = {
    "malformed": (400, "the body is not a msgpack (or JSON) map"),
    "unsupported_version": (400, "field v is not a protocol version this server speaks"),
    "unknown_op": (400, "field op names no operation of this endpoint"),
    "bad_request": (400, "a field is missing, has the wrong type or an invalid value"),
    "bad_array": (400, "an array map lacks dtype/shape/data or has the wrong types"),
    "bad_dtype": (
        400,
        "an array's dtype is not one of the allowed dtypes, or not the expected one",
    ),
    "bad_shape": (400, "an array's shape does not match what the operation expects"),
    "bad_length": (400, "an array's byte length is not prod(shape) x itemsize"),
    "non_finite": (400, "an array holds NaN or Inf"),
    "unauthorized": (401, "the token is missing, or neither the cluster token nor a run's"),
    "forbidden": (
        403,
        "the credential is valid but may not do this (a replication op without a server's peer "
        "credential, or one sent as another server; a run's token outside its namespace or on "
        "an operator's op)",
    ),
    "quota_exceeded": (
        403,
        "the request would take a run past one of its quotas (extra: quota, limit); nothing "
        "changed",
    ),
    "unknown_tensor": (404, "no tensor of that name"),
    "unknown_shard": (404, "no shard of that id on this server"),
    "unknown_bucket": (404, "no bucket of that id"),
    "unknown_table": (404, "no embedding table of that name"),
    "not_found": (404, "no such resource"),
    "exists": (409, "a resource of that name exists with a different definition"),
    "not_primary": (
        409,
        "this server is not the primary of the bucket (extra: bucket, epoch, primary)",
    ),
    "stale_epoch": (409, "the message's lease epoch is older than the current one"),
    "conflict": (409, "the request conflicts with the current state"),
    "table_full": (
        409,
        "the push would create rows beyond the table's row limit (on_full = reject); nothing "
        "was applied (extra: table, bucket, limit)",
    ),
    "read_only": (
        409,
        "this endpoint does not take writes on this server (data plane of a replicated server)",
    ),
    "rate_limited": (
        429,
        "a run's push_bytes_per_s quota is spent for now: nothing was applied; retry after "
        "Retry-After seconds (extra: quota, limit, retry_after)",
    ),
    "slow_request": (408, "the request body did not arrive within the body timeout"),
    "too_large": (413, "the body, or what it asks to allocate, exceeds a configured limit"),
    "internal": (500, "an unexpected error; the server logged it and keeps serving"),
    "no_quorum": (503, "the controller cluster has no quorum; retry later"),
    "unavailable": (503, "the server cannot serve this now (starting, catching up, draining)"),
    "primary_changed": (
        503,
        "the primary lost its role while the push was in a replication round: its outcome is "
        "unknown; retry it with the same (client, seq) (extra: bucket, epoch, primary)",
    ),
    "bucket_unavailable": (
        503,
        "no live copy of the bucket can serve it: nothing was applied; retry (extra: bucket)",
    ),
    "not_durable": (
        503,
        "this server's flushes have failed or stalled past max_unflushed: nothing was applied; "
        "retry (the controllers move its buckets to servers that can persist)",
    ),
    "held": (
        503,
        "writes are held for the cut of a consistent checkpoint (milliseconds; expires by "
        "itself): nothing was applied; retry (extra: retry_after)",
    ),
    "timeout": (504, "the operation did not complete in time; its outcome is unknown"),
}


class ProtocolError(Exception):
    """An error with a code from ERRORS; becomes a JSON error reply with the code's HTTP status."""

    def __init__(self, code: str, message: str, **extra: Any) -> None:
        if code not in ERRORS:
            raise ValueError(f"unknown error code {code!r}")
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.extra = extra

    @property
    def status(self) -> int:
        return ERRORS[self.code][0]

    def to_dict(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, **self.extra}


# -- request ids ---------------------------------------------------------------------------------

_rid_prefix = os.urandom(4).hex()
_rid_counter = itertools.count(1)


def new_rid() -> str:
    """A request id unique across processes (random prefix) and within one (counter)."""
    return f"{_rid_prefix}-{next(_rid_counter)}"


def request(op: str, **fields: Any) -> dict[str, Any]:
    """A request message with a fresh rid."""
    return {"op": op, "v": VERSION, "rid": new_rid(), **fields}


# -- arrays --------------------------------------------------------------------------------------


def _pack_default(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        return array_to_wire(obj)
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(f"cannot encode {type(obj).__name__}")


#: an allowed dtype in its wire byte order -> its wire name. ``dtype.name`` is computed in Python
#: by numpy 2 (about 17 us a call here, 30% of a data server's CPU in issue 27's profile); a
#: dict lookup is under half a microsecond
_WIRE_NAMES: dict[np.dtype, str] = {dt: name for name, dt in ALLOWED_DTYPES.items()}


def array_to_wire(arr: np.ndarray) -> dict[str, Any]:
    name = _WIRE_NAMES.get(arr.dtype)
    if name is None:  # not allowed, or big-endian: the slow path names it
        name = arr.dtype.name
        if name not in ALLOWED_DTYPES:
            raise TypeError(f"dtype {name} is not allowed on the wire")
        arr = arr.astype(ALLOWED_DTYPES[name])
    # A C-contiguous array is sent from its own memory (msgpack takes the buffer): no copy. An
    # empty one has no bytes (numpy's view of a (0, n) array cannot be cast: TypeError).
    data = memoryview(np.ascontiguousarray(arr)).cast("B") if arr.size else memoryview(b"")
    return {"dtype": name, "shape": list(arr.shape), "data": data}


#: out-of-band arrays start at multiples of this in the payload (aligned views for every dtype)
OOB_ALIGN = 8


def encode_oob(
    msg: Mapping[str, Any], starts: list[int] | None = None
) -> tuple[bytes, list[memoryview], int]:
    """A message whose arrays travel out of band, after it (the data plane's ``repl_multi``):
    returns the msgpack meta, in which each array is ``{"dtype", "shape", "at": offset}``, the
    buffers to send after it in order (the arrays' own memory, and padding), and their length.
    No array byte is copied here. `starts`, if given, receives the index in the buffers of each
    array's (its padding follows it)."""
    parts: list[memoryview] = []
    size = 0

    def default(obj: Any) -> Any:
        nonlocal size
        if isinstance(obj, np.ndarray):
            d = array_to_wire(obj)
            data = d.pop("data")
            d["at"] = size
            if starts is not None:
                starts.append(len(parts))
            parts.append(data)
            size += len(data)
            pad = -size % OOB_ALIGN
            if pad:
                parts.append(memoryview(bytes(pad)))
                size += pad
            return d
        return _pack_default(obj)

    meta = msgpack.packb(msg, default=default, use_bin_type=True)
    return meta, parts, size


def _array_at(d: Mapping[str, Any], payload: memoryview) -> np.ndarray:
    """The view of ``payload`` an out-of-band array map names, checked like an inline array
    (array_from_wire's checks, made here once: issue 36's profile of a click-through step at
    RF 3 found this path, two arrays per row update, checked twice over a second dict built
    for it, 7% of a server's event loop)."""
    at, name, shape = d["at"], d["dtype"], d["shape"]
    if not isinstance(at, int) or isinstance(at, bool) or not 0 <= at <= len(payload):
        raise ProtocolError("bad_array", f"array offset {at!r} outside the payload")
    dtype = ALLOWED_DTYPES.get(name) if isinstance(name, str) else None
    if dtype is None or not isinstance(shape, list):
        return array_from_wire({"dtype": name, "shape": shape, "data": b""})  # raises
    n = dtype.itemsize
    for x in shape:
        if not isinstance(x, int) or x < 0:
            raise ProtocolError(
                "bad_array", f"array shape must be a list of ints >= 0, got {shape!r}"
            )
        n *= x
    if at + n > len(payload):
        raise ProtocolError("bad_length", f"array of {n} bytes at {at} overruns the payload")
    return np.frombuffer(payload[at : at + n], dtype=dtype).reshape(shape)


def array_from_wire(d: Mapping[str, Any]) -> np.ndarray:
    dtype_name, shape, data = d["dtype"], d["shape"], d["data"]
    if not isinstance(dtype_name, str) or not isinstance(data, bytes | bytearray | memoryview):
        raise ProtocolError("bad_array", "array map needs dtype (str), shape (list), data (bin)")
    if not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape):
        raise ProtocolError("bad_array", f"array shape must be a list of ints >= 0, got {shape!r}")
    dtype = ALLOWED_DTYPES.get(dtype_name)
    if dtype is None:
        raise ProtocolError(
            "bad_dtype",
            f"dtype {dtype_name!r} not allowed; expected one of {sorted(ALLOWED_DTYPES)}",
        )
    expected = math.prod(shape) * dtype.itemsize
    if len(data) != expected:
        raise ProtocolError(
            "bad_length",
            f"array of dtype {dtype_name} and shape {shape} needs {expected} bytes, got {len(data)}",
        )
    return np.frombuffer(data, dtype=dtype).reshape(shape)


#: Bounds on what one message may make the decoder build (issue 12: a 16 MB body of empty maps
#: took 6.4 s and 1.27 GiB). msgpack checks the lengths before allocating; the container count is
#: checked as containers are built, so decoding stops early. Strings are names and ids, bins the
#: array payloads (bounded by the body size anyway).
MAX_STR_LEN = 64 << 10
MAX_ARRAY_LEN = 1 << 18
MAX_MAP_LEN = 1 << 18
MAX_CONTAINERS = 1 << 18


class _Counter:
    """Counts the maps and lists one decode builds; past MAX_CONTAINERS the decode fails."""

    __slots__ = ("n", "limit", "payload", "offsets")

    def __init__(
        self, limit: int, payload: memoryview | None = None, offsets: list[int] | None = None
    ) -> None:
        self.n = 0
        self.limit = limit
        #: the frame's payload: out-of-band arrays are views of it
        self.payload = payload
        #: where the out-of-band arrays start, in the order met (None: not collected)
        self.offsets = offsets

    def tick(self) -> None:
        self.n += 1
        if self.n > self.limit:
            raise ProtocolError("too_large", f"message holds more than {self.limit} maps and lists")

    def object_hook(self, d: dict[str, Any]) -> Any:
        # called for every map decoded: tick() and the array-map tests inline (issue 36: a
        # hundred maps per training step per server, two calls each)
        self.n += 1
        if self.n > self.limit:
            self.tick()  # raises
        if len(d) != 3 or "dtype" not in d or "shape" not in d:
            return d
        if "data" in d:
            return array_from_wire(d)
        if self.payload is not None and "at" in d:
            arr = _array_at(d, self.payload)
            if self.offsets is not None:
                self.offsets.append(d["at"])
            return arr
        return d

    def list_hook(self, x: list[Any]) -> list[Any]:
        self.n += 1
        if self.n > self.limit:
            self.tick()  # raises
        return x


# -- messages ------------------------------------------------------------------------------------


def encode(msg: Mapping[str, Any]) -> bytes:
    """A message (numpy arrays anywhere inside) as msgpack bytes."""
    return msgpack.packb(msg, default=_pack_default, use_bin_type=True)


def encode_parts(msg: Mapping[str, Any]) -> tuple[list[bytes | memoryview], int]:
    """The bytes of `encode(msg)` as pieces, each array's data its own memory (not copied),
    and their total length: a large reply is written piece by piece instead of being copied
    whole on the event loop (issue 39). Each array is packed with a unique placeholder as its
    data, which is then replaced by a bin header and the array's memory."""
    marker = os.urandom(16)
    datas: list[memoryview] = []

    def default(obj: Any) -> Any:
        if isinstance(obj, np.ndarray):
            d = array_to_wire(obj)
            datas.append(d["data"])
            d["data"] = marker + len(datas).to_bytes(4, "little")
            return d
        return _pack_default(obj)

    packed = msgpack.packb(msg, default=default, use_bin_type=True)
    parts: list[bytes | memoryview] = []
    pos = 0
    for i, data in enumerate(datas, 1):
        tag = b"\xc4\x14" + marker + i.to_bytes(4, "little")
        at = packed.index(tag, pos)
        n = len(data)
        head = (
            b"\xc4" + n.to_bytes(1, "big")
            if n < 1 << 8
            else b"\xc5" + n.to_bytes(2, "big")
            if n < 1 << 16
            else b"\xc6" + n.to_bytes(4, "big")
        )
        parts += [packed[pos:at], head, data]
        pos = at + len(tag)
    parts.append(packed[pos:])
    return parts, sum(len(p) for p in parts)


def decode(
    body: bytes | bytearray | memoryview,
    payload: bytes | bytearray | memoryview | None = None,
    offsets: list[int] | None = None,
) -> dict[str, Any]:
    """msgpack bytes as a message; arrays come back zero-copy and read-only. With `payload`
    (``encode_oob``'s buffers as received) its out-of-band arrays are views of the payload, and
    `offsets`, if given, receives where each of them starts (a frame's MAC segments,
    adamps.security.peer_auth.segment_digests).

    Raises ProtocolError (malformed, bad_array, bad_dtype, bad_length) on bad input.
    """
    counter = _Counter(
        MAX_CONTAINERS,
        None if payload is None else memoryview(payload).cast("B").toreadonly(),
        offsets,
    )
    try:
        msg = msgpack.unpackb(
            body,
            raw=False,
            object_hook=counter.object_hook,
            list_hook=counter.list_hook,
            strict_map_key=True,
            max_str_len=MAX_STR_LEN,
            max_array_len=MAX_ARRAY_LEN,
            max_map_len=MAX_MAP_LEN,
            max_ext_len=0,
        )
    except ProtocolError:
        raise
    except Exception as exc:  # msgpack raises several unrelated types for garbage
        # msgpack's FormatError (a reserved byte such as 0xc1) and StackError (nesting deeper
        # than its stack) carry no text: say what they mean
        why = str(exc) or _UNPACK_ERRORS.get(type(exc).__name__, type(exc).__name__)
        raise ProtocolError("malformed", f"body is not valid msgpack: {why}") from None
    if not isinstance(msg, dict):
        raise ProtocolError("malformed", f"message must be a map, got {type(msg).__name__}")
    return msg


def check_message(msg: Mapping[str, Any], ops: Collection[str]) -> str:
    """Checks the envelope (v, op); returns op."""
    v = msg.get("v")
    # Strict: the int 1, not True or 1.0 (which compare equal to it).
    if type(v) is not int or v != VERSION:
        raise ProtocolError("unsupported_version", f"v must be {VERSION}, got {v!r}")
    op = msg.get("op")
    if not isinstance(op, str) or op not in ops:
        raise ProtocolError("unknown_op", f"unknown op {op!r}; expected one of {sorted(ops)}")
    return op


_MISSING = object()


def one_form(msg: Mapping[str, Any], first: str, second: str) -> None:
    """Refuses a request naming both of an op's two forms (`first`, `second`): serving one
    would silently drop the other, and /rpc and the data plane once picked differently."""
    if first in msg and second in msg:
        raise ProtocolError(
            "bad_request", f"names both {first!r} and {second!r}: send one form or the other"
        )


#: the fields every request may carry beside its op's (docs/protocol.md, "Envelope"; `token`: a
#: data-plane frame's credential, docs/protocol-ps.md "Binary data plane")
ENVELOPE = frozenset({"op", "v", "rid", "token"})


def only_fields(msg: Mapping[str, Any], what: str, takes: Collection[str], **extra: Any) -> None:
    """Refuses a map (a request, or an entry of one) naming a field not in `takes`: ignored, a
    misspelled field silently did nothing (a `round`'s `fetch_row`, session 19)."""
    unknown = [str(k) for k in msg if k not in takes]
    if unknown:
        # A request's own fields are listed without the envelope's; an entry's (a replicated
        # update's "v", a ckpt_install shard's "v") are listed whole, though one is named "v".
        own = set(takes) - ENVELOPE if ENVELOPE <= set(takes) else set(takes)
        raise ProtocolError(
            "bad_request",
            f"{what} takes no field {', '.join(map(repr, unknown))}; its fields are {sorted(own)}",
            unknown=unknown,
            fields=sorted(own),
            **extra,
        )


def require(
    msg: Mapping[str, Any], name: str, type_: type | tuple[type, ...], default: Any = _MISSING
) -> Any:
    """Field `name` of `msg`, checked to be of `type_` (bool is not accepted as int)."""
    value = msg.get(name, _MISSING)
    if value is _MISSING or value is None:
        if default is not _MISSING:
            return default
        raise ProtocolError("bad_request", f"field {name!r} is required")
    types = type_ if isinstance(type_, tuple) else (type_,)
    if isinstance(value, bool) and bool not in types:
        raise ProtocolError("bad_request", f"field {name!r} must be {_type_names(types)}, got bool")
    if not isinstance(value, types):
        if float in types and isinstance(value, int):
            return float(value)
        raise ProtocolError(
            "bad_request",
            f"field {name!r} must be {_type_names(types)}, got {type(value).__name__}",
        )
    return value


def _type_names(types: tuple[type, ...]) -> str:
    return " or ".join("array" if t is np.ndarray else t.__name__ for t in types)


def require_array(
    msg: Mapping[str, Any],
    name: str,
    *,
    dtype: str = "float32",
    shape: tuple[int | None, ...] | None = None,
    finite: bool = True,
) -> np.ndarray:
    """Field `name` as an array of `dtype`; `shape` entries of None match any size."""
    arr = require(msg, name, np.ndarray)
    if arr.dtype != ALLOWED_DTYPES[dtype]:
        raise ProtocolError("bad_dtype", f"field {name!r} must be {dtype}, got {arr.dtype.name}")
    if shape is not None and (
        len(shape) != arr.ndim
        or any(s is not None and s != a for s, a in zip(shape, arr.shape, strict=True))
    ):
        want = [("*" if s is None else s) for s in shape]
        raise ProtocolError(
            "bad_shape", f"field {name!r} must have shape {want}, got {list(arr.shape)}"
        )
    if finite:
        check_finite(name, arr)
    return arr


def check_finite(name: str, arr: np.ndarray) -> None:
    if arr.dtype.kind == "f" and arr.size and not np.isfinite(arr).all():
        bad = int(arr.size - np.count_nonzero(np.isfinite(arr)))
        raise ProtocolError("non_finite", f"field {name!r} holds {bad} NaN/Inf values")


#: what msgpack's text-less exceptions mean
_UNPACK_ERRORS = {
    "FormatError": "FormatError (a byte that starts no msgpack value)",
    "StackError": "StackError (arrays or maps nested too deeply)",
}


def error_body(code: str, message: str, rid: str | int | None = None, **extra: Any) -> bytes:
    """The JSON body of an error reply."""
    return json.dumps({"error": {"code": code, "message": message, **extra}, "rid": rid}).encode()


def error_from_body(status: int, body: bytes) -> ProtocolError:
    """Rebuilds the ProtocolError that an error reply describes (client side)."""
    try:
        err = json.loads(body)["error"]
        code, message = err.pop("code"), err.pop("message")
        if code not in ERRORS:
            raise ValueError(code)
        return ProtocolError(code, message, **err)
    except Exception:
        text = body[:200].decode("utf-8", "replace")
        code = "internal" if status >= 500 else "bad_request"
        return ProtocolError(code, f"HTTP {status}: {text}", http_status=status)


#: a controller read's header (docs/protocol-controller.md, "Transport"): the Raft log index the
#: answering controller must have applied; a client sends the highest ``applied_index`` its writes'
#: answers named, so it reads its own writes through any controller
MIN_APPLIED_HEADER = "X-Adamps-Min-Applied"
