"""Property-based fuzzing (hypothesis) of every port a token holder or a buggy client reaches:
the PS's /rpc and binary data port, the controller's HTTP API, the data server's /stream.

Each server runs in-process on loopback, on an event loop in a background thread, so that the
hypothesis-driven test body stays synchronous. The properties, for every generated request:

- the reply is a 4xx with a JSON error ``{"error": {"code", "message"}, "rid"}`` (or, for a
  request that happens to be valid, a 200), never a 5xx, within a bounded time;
- after a 4xx, the state is unchanged (PS: every value and version; controller: no Raft entry
  was even applied; data port: a clean error frame or a closed connection);
- the server keeps serving (/healthz).

Bounded: a few hundred examples in all, ``deadline=None`` but a per-request timeout; the module
takes about 30-40 s on 2 cores.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import math
import socket
import threading
import time
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from adamps.client.rpc import SyncRpc
from adamps.server.api import dataplane
from adamps.server.api.app import ParameterServer
from adamps.server.config import PsConfig
from adamps.up.procs import free_port
from adamps.wire import protocol
from adamps.wire import web as aweb

TOKEN = "fuzz-token"
REQUEST_TIMEOUT = 10.0
FUZZ = settings(
    max_examples=250,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    derandomize=True,  # the same examples in CI every time: a failure reproduces
    database=None,  # nothing written into the working tree
)


class LoopThread:
    """An asyncio loop in a daemon thread; `run(coro)` waits for the result."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = 30.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


def http_call(
    port: int,
    method: str,
    path: str,
    body: bytes | None,
    headers: dict[str, str] | None = None,
) -> tuple[int, bytes, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=REQUEST_TIMEOUT)
    try:
        hdrs = {"Authorization": f"Bearer {TOKEN}", **(headers or {})}
        conn.request(method, path, body=body, headers=hdrs)
        resp = conn.getresponse()
        return resp.status, resp.read(), resp.getheader("Content-Type", "")
    finally:
        conn.close()


def assert_client_error(status: int, body: bytes, ctype: str) -> dict[str, Any]:
    assert 400 <= status < 500, (status, body[:300])
    assert ctype.startswith("application/json"), (status, ctype, body[:200])
    err = json.loads(body)
    assert set(err) == {"error", "rid"} and {"code", "message"} <= set(err["error"]), err
    return err


def healthy(port: int) -> None:
    status, body, _ = http_call(port, "GET", "/healthz", None)
    assert status == 200 and json.loads(body) == {"ok": True}


# -- values -------------------------------------------------------------------------------------

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),  # what msgpack can carry
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.binary(max_size=64),
)
DTYPES = ["float32", "float64", "int32", "uint8", "float16", "complex64", "", "<f4"]


@st.composite
def wire_arrays(draw: st.DrawFn) -> dict[str, Any]:
    """Array maps, mostly almost right: a dtype, a shape, data of some length."""
    shape = draw(
        st.one_of(
            st.lists(st.integers(min_value=-2, max_value=60), max_size=3),
            st.just([2**40]),
            st.just([2**62, 4]),
            scalars,
        )
    )
    n = draw(st.integers(min_value=0, max_value=256))
    fill = draw(st.sampled_from([0.0, 1.0, 3e38, float("nan"), float("inf"), 1e13]))
    data = np.full(n, fill, np.float32).tobytes()
    return {"dtype": draw(st.sampled_from(DTYPES)), "shape": shape, "data": data}


values = st.recursive(
    st.one_of(scalars, wire_arrays()),
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)

PS_OPS = ["create", "pull", "push_dense", "push_fc", "flush", "list", "describe", "repl_x", ""]
PS_FIELDS = [
    "name", "shape", "init", "optimizer", "tensors", "shards", "tensor", "delta", "a", "e",
    "client", "seq", "rid",
]  # fmt: skip
READ_ONLY_OPS = {"pull", "list", "describe", "flush"}


#: inits and optimizers near and beyond the finite bounds (adamps/server/updates/bounds.py)
EDGY_INITS = [
    {"kind": "normal", "std": 1e300}, {"kind": "normal", "std": 1e20}, {"kind": "constant", "value": 1e39},
    {"kind": "constant", "value": 3e38}, {"kind": "uniform", "low": -1e30, "high": 1.0},
    {"kind": "xavier", "gain": 1e25}, {"kind": "zeros"}, {"kind": "constant", "value": -2.5},
]  # fmt: skip
EDGY_OPTIMIZERS = [
    {"kind": "sgd", "lr": 1e30}, {"kind": "sgd", "lr": -1.0}, {"kind": "sgd", "lr": 1e12},
    {"kind": "adagrad", "lr": 1e13}, {"kind": "adagrad", "lr": 0.5, "initial_accumulator": 1e30},
    {"kind": "adagrad", "lr": 0.5},
]  # fmt: skip


@st.composite
def near_valid_creates(draw: st.DrawFn) -> dict[str, Any]:
    """Well-formed creates whose numbers may overflow float32 once stored or pushed."""
    return {
        "op": "create",
        "v": 1,
        "rid": "c",
        "name": draw(st.sampled_from(["n1", "n2", "n3", "n4"])),
        "shape": draw(st.sampled_from([[8], [2, 3], [1 << 27], [0], [2**63 - 1]])),
        "init": draw(st.sampled_from(EDGY_INITS)),
        "optimizer": draw(st.sampled_from(EDGY_OPTIMIZERS)),
    }


@st.composite
def near_valid_pushes(draw: st.DrawFn) -> dict[str, Any]:
    """Well-formed dense pushes to `w` (40 x 50) with edgy values."""
    fill = draw(st.sampled_from([1e12, 1e13, 3e38, -3e38, 0.5, float("nan"), float("inf")]))
    delta = np.full((40, 50), fill, np.float32)
    if draw(st.booleans()):
        return {"op": "push_dense", "v": 1, "rid": "p", "tensor": "w", "delta": delta}
    return {"op": "push_dense", "v": 1, "rid": "p", "shards": {"w/0": delta[:25]}}


@st.composite
def rpc_messages(draw: st.DrawFn) -> dict[str, Any]:
    kind = draw(st.integers(0, 5))
    if kind == 0:
        return draw(near_valid_creates())
    if kind == 1:
        return draw(near_valid_pushes())
    msg: dict[str, Any] = {
        "op": draw(st.one_of(st.sampled_from(PS_OPS), scalars)),
        "v": draw(st.sampled_from([1, 1, 1, True, 1.0, 2, "1", None])),
        "rid": draw(st.one_of(st.text(max_size=10), st.integers(-(2**63), 2**63), st.none())),
    }
    for name in draw(st.lists(st.sampled_from(PS_FIELDS), max_size=5, unique=True)):
        msg[name] = draw(
            st.one_of(
                values,
                st.just(["w/0"] * 1000),
                st.just({"kind": "normal", "std": 1e300}),
                st.just({"kind": "sgd", "lr": 1e30}),
                st.just("w"),
                st.just([40, 50]),
            )
        )
    return msg


# -- the parameter server ----------------------------------------------------------------------


class PsUnderTest:
    def __init__(self, root: Path, **cfg: Any) -> None:
        self.lt = LoopThread()
        self.port = free_port()
        self.data_port = free_port()
        fields = {
            "port": self.port,
            "data_port": self.data_port,
            "token": TOKEN,
            "data_dir": str(root / "ps"),
            "owner_threads": 1,
            "flush_interval": 3600,
            "max_shard_elems": 1000,
            "lmdb_sync": False,
            **cfg,
        }
        self.ps = ParameterServer(PsConfig(**fields))

        async def up() -> Any:
            return await aweb.serve(self.ps.make_app(), "127.0.0.1", self.port)

        self.runner = self.lt.run(up())
        self.rpc = SyncRpc(f"http://127.0.0.1:{self.port}", TOKEN)
        self.rpc.call(
            "create", name="w", shape=[40, 50], init={"kind": "uniform", "seed": 3},
            optimizer={"kind": "adagrad", "lr": 0.1},
        )  # fmt: skip

    def state(self) -> Any:
        names = sorted(self.ps.store.tensors)
        r = self.rpc.call("pull", tensors=names)
        return {n: (r["tensors"][n].tobytes(), r["versions"][n]) for n in names}

    def close(self) -> None:
        self.rpc.close()
        self.lt.run(self.runner.cleanup())
        self.lt.stop()


@pytest.fixture(scope="module")
def ps_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PsUnderTest]:
    s = PsUnderTest(tmp_path_factory.mktemp("fuzz-ps"))
    try:
        yield s
    finally:
        s.close()


@FUZZ
@given(msg=rpc_messages())
def test_rpc_bad_messages_get_a_4xx_and_change_nothing(ps_server: PsUnderTest, msg) -> None:
    before = ps_server.state()
    t0 = time.monotonic()
    body = protocol.encode(msg)  # numpy arrays as array maps
    status, reply, ctype = http_call(
        ps_server.port, "POST", "/rpc", body, {"Content-Type": "application/msgpack"}
    )
    assert time.monotonic() - t0 < REQUEST_TIMEOUT
    if type(msg.get("v")) is not int or msg.get("v") != 1:  # strict: not True, not 1.0
        # refused (unsupported_version, or an earlier decoding error such as a bad array)
        assert_client_error(status, reply, ctype)
        assert ps_server.state() == before
        return
    if status == 200 and msg.get("op") in READ_ONLY_OPS:
        assert ps_server.state() == before
        return
    if status == 200:  # a valid mutating request (rare): it may change state, and must be sane
        for name, (raw, _versions) in ps_server.state().items():
            assert np.isfinite(np.frombuffer(raw, np.float32)).all(), name
        return
    assert_client_error(status, reply, ctype)
    assert ps_server.state() == before


@FUZZ
@given(body=st.one_of(st.binary(max_size=512), st.builds(msgpack.packb, values)))
def test_rpc_garbage_bodies_get_a_4xx(ps_server: PsUnderTest, body: bytes) -> None:
    before = ps_server.state()
    status, reply, ctype = http_call(
        ps_server.port, "POST", "/rpc", body, {"Content-Type": "application/msgpack"}
    )
    assert_client_error(status, reply, ctype)
    assert ps_server.state() == before


@settings(FUZZ, max_examples=60)
@given(
    value=st.one_of(
        st.text(max_size=40),
        st.binary(max_size=40).map(lambda b: b.decode("latin-1")),
    ),
    path=st.sampled_from(["/rpc", "/flush"]),
)
def test_any_authorization_header_without_the_token_is_401(
    ps_server: PsUnderTest, value: str, path: str
) -> None:
    raw = value.replace("\r", "").replace("\n", "")
    if raw.strip() == f"Bearer {TOKEN}":
        return

    def send() -> bytes:
        with socket.create_connection(("127.0.0.1", ps_server.port), timeout=5) as s:
            s.sendall(
                f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n"
                f"Authorization: ".encode()
                + raw.encode("utf-8", "surrogateescape")
                + b"\r\n\r\n"
            )
            data = b""
            while chunk := s.recv(4096):
                data += chunk
            return data

    reply = send()
    # 401 from the token check, or 400 from aiohttp's own parser for a header it cannot parse
    # (control characters): refused before any handler, in either case.
    assert reply.startswith((b"HTTP/1.1 401", b"HTTP/1.1 400", b"HTTP/1.0 400")), reply[:200]


@settings(FUZZ, max_examples=60)
@given(
    x=st.sampled_from(["", "short", "long", "nope", "w", "a@b", 3, None]),
    y=st.sampled_from(["", "short", "long", "nope"]),
    shards=st.one_of(
        st.sampled_from([["w/0"], ["w/0", "w/1"], ["w/9"], [], ["w@short/0"], "w/0"]),
        st.lists(st.text(max_size=6), max_size=3),
    ),
)
def test_vec_dot_of_any_vectors_is_a_4xx_or_a_dot(ps_server: PsUnderTest, x, y, shards) -> None:
    """Issue 28 item 6: vec_dot with y of the wrong length was a 500 (np.dot raised)."""
    if "w@short" not in ps_server.ps.store.tensors:  # vectors beside w of other lengths
        ps_server.rpc.call("create", name="w@short", shape=[40, 10])
        ps_server.rpc.call("create", name="w@long", shape=[2000])
    before = ps_server.state()
    body = protocol.encode(protocol.request("vec_dot", x=x, y=y, shards=shards))
    status, reply, ctype = http_call(
        ps_server.port, "POST", "/rpc", body, {"Content-Type": "application/msgpack"}
    )
    if status != 200:
        assert_client_error(status, reply, ctype)
    assert ps_server.state() == before


# -- the PS data port ---------------------------------------------------------------------------


@st.composite
def data_frames(draw: st.DrawFn) -> bytes:
    meta = draw(
        st.one_of(
            st.builds(
                lambda m: msgpack.packb(m, use_bin_type=True),
                st.fixed_dictionaries(
                    {
                        "op": st.sampled_from(["push_dense", "pull", "create", ""]),
                        "v": st.sampled_from([1, True, 1.0, 2]),
                        "tensor": st.sampled_from(["w", "nope", ""]),
                        "token": st.sampled_from([TOKEN, "wrong", ""]),
                    }
                ),
            ),
            st.binary(max_size=64),
        )
    )
    payload = draw(
        st.one_of(
            st.just(np.full(2000, 3e38, np.float32).tobytes()),
            st.just(np.full(2000, np.nan, np.float32).tobytes()),
            st.binary(max_size=64),
        )
    )
    header = dataplane.HEADER.pack(
        draw(st.sampled_from([dataplane.MAGIC, b"XXXX"])),
        draw(st.sampled_from([1, 1, 2])),
        draw(st.sampled_from([dataplane.REQUEST, dataplane.REQUEST, 2, 9])),
        0,
        draw(st.one_of(st.just(len(meta)), st.integers(0, 2**32 - 1))),
        draw(st.one_of(st.just(len(payload)), st.integers(0, 2**64 - 1))),
    )
    return header + meta + payload


def data_port_exchange(port: int, frame: bytes) -> bytes:
    """Sends one frame, half-closes, returns what the server sent before closing."""
    with socket.create_connection(("127.0.0.1", port), timeout=REQUEST_TIMEOUT) as s:
        try:
            s.sendall(frame)
            s.shutdown(socket.SHUT_WR)
        except (BrokenPipeError, ConnectionResetError):
            pass
        data = b""
        try:
            while chunk := s.recv(65536):
                data += chunk
        except ConnectionResetError:
            pass
        return data


@FUZZ
@given(frame=data_frames())
def test_data_port_bad_frames_are_refused_cleanly(ps_server: PsUnderTest, frame: bytes) -> None:
    before = ps_server.state()
    reply = data_port_exchange(ps_server.data_port, frame)
    pos = 0
    while pos + dataplane.HEADER.size <= len(reply):
        magic, _v, kind, _z, mlen, plen = dataplane.HEADER.unpack_from(reply, pos)
        assert magic == dataplane.MAGIC and kind in (dataplane.REPLY, dataplane.ERROR)
        meta = msgpack.unpackb(reply[pos + dataplane.HEADER.size : pos + 20 + mlen])
        if kind == dataplane.ERROR:
            assert meta["error"]["code"] != "internal", meta
        pos += dataplane.HEADER.size + mlen + plen
    after = ps_server.state()
    if after != before:  # only a valid push (finite, small) may change state
        for raw, _versions in after.values():
            assert np.isfinite(np.frombuffer(raw, np.float32)).all()
    healthy(ps_server.port)


# -- the controller -----------------------------------------------------------------------------


class ControllerUnderTest:
    def __init__(self, root: Path) -> None:
        from controller.config import ControllerConfig
        from controller.service import ControllerService

        self.lt = LoopThread()
        self.port, raft = free_port(), free_port()
        cfg = ControllerConfig(
            members=[f"127.0.0.1:{raft}:{self.port}"],
            data_dir=str(root / "c0"),
            token=TOKEN,
            # Nothing happens in the background: no placement, no deaths, no expiry.
            min_servers=1000,
            server_timeout=3600.0,
            dead_server_ttl=3600.0,
        )
        self.service = ControllerService(cfg)

        async def up() -> Any:
            return await aweb.serve(self.service.make_app(), "127.0.0.1", self.port)

        self.runner = self.lt.run(up())
        deadline = time.monotonic() + 10
        while not (self.service.is_leader() and self.service.node.isReady()):
            assert time.monotonic() < deadline
            time.sleep(0.05)

    def applied(self) -> int:
        return self.service.cluster.read(lambda m: m.applied)

    def close(self) -> None:
        self.lt.run(self.runner.cleanup())
        self.lt.stop()


@pytest.fixture(scope="module")
def controller(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControllerUnderTest]:
    c = ControllerUnderTest(tmp_path_factory.mktemp("fuzz-ctl"))
    try:
        yield c
    finally:
        c.close()


CONTROLLER_ROUTES = [
    ("GET", "/routing"), ("GET", "/cluster"), ("GET", "/leases"), ("GET", "/layout"),
    ("GET", "/progress"), ("GET", "/progress?epoch=x"), ("GET", "/servers/ps-1"),
    ("PUT", "/layout"), ("POST", "/layout"), ("POST", "/progress"),
    ("POST", "/servers/ps-1/register"), ("POST", "/servers/%00/register"),
    ("POST", "/servers/ps-1/heartbeat"), ("POST", "/servers/ps-1/drain"),
    ("POST", "/servers/ps-1/undrain"),
    ("POST", "/buckets/0/role-change"), ("POST", "/buckets/1/caught-up"),
    ("POST", "/buckets/2/release"), ("POST", "/buckets/3/drop-secondary"),
    ("POST", "/buckets/999/release"), ("POST", "/buckets/x/release"), ("POST", "/buckets/0/x"),
]  # fmt: skip

json_values = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(min_value=-(2**70), max_value=2**70),
        st.floats(allow_nan=False, allow_infinity=False),
        st.text(max_size=20),
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=10), inner, max_size=4)
    ),
    max_leaves=15,
)
CONTROLLER_FIELDS = [
    "layout", "tensors", "n_buckets", "max_shard_elems", "epoch", "replica", "progress", "done",
    "address", "server", "primary", "prev_epoch", "reports", "known_version",
]  # fmt: skip


@st.composite
def controller_bodies(draw: st.DrawFn) -> bytes:
    kind = draw(st.integers(0, 9))
    if kind == 0:
        return draw(st.binary(max_size=200))
    if kind == 1:
        return draw(
            st.sampled_from(
                [
                    b'{"progress": NaN, "epoch": 1, "replica": "r"}',
                    b'{"progress": 1e999, "epoch": 1, "replica": "r"}',
                    b"[" * 5000 + b"]" * 5000,
                    b'{"n_buckets": 1e999, "tensors": []}',
                    b'{"tensors": [{"name": "w", "shape": [1152921504606846976]}]}',
                    b"\xff\xfe{}",
                ]
            )
        )
    body = {
        name: draw(json_values)
        for name in draw(st.lists(st.sampled_from(CONTROLLER_FIELDS), max_size=5, unique=True))
    }
    return json.dumps(body).encode()


@FUZZ
@given(route=st.sampled_from(CONTROLLER_ROUTES), body=controller_bodies())
def test_controller_bad_requests_get_a_4xx_and_propose_nothing(
    controller: ControllerUnderTest, route: tuple[str, str], body: bytes
) -> None:
    method, path = route
    before = controller.applied()
    status, reply, ctype = http_call(
        controller.port,
        method,
        path,
        body if method != "GET" else None,
        {"Content-Type": "application/json"},
    )
    assert status < 500, (status, reply[:300])
    if status >= 400:
        assert_client_error(status, reply, ctype)
        # A refused request proposed nothing: no Raft entry was applied.
        assert controller.applied() == before
    else:
        json.loads(reply, parse_constant=lambda c: pytest.fail(f"non-standard JSON {c}"))
    healthy(controller.port)


def test_controller_serves_only_standard_json(controller: ControllerUnderTest) -> None:
    for path in ("/routing", "/cluster", "/leases", "/progress", "/status"):
        status, reply, _ = http_call(controller.port, "GET", path, None)
        assert status == 200

        def bad(c: str, path: str = path) -> Any:
            raise AssertionError(f"{path} served non-standard JSON {c}")

        json.loads(
            reply, parse_constant=bad, parse_float=lambda s: math.isfinite(float(s)) or bad(s)
        )


# -- the data server ----------------------------------------------------------------------------


class DataServerUnderTest:
    def __init__(self) -> None:
        from dataserver.config import DataServerConfig
        from dataserver.service import DataServer
        from dataserver.sources import Dataset

        rng = np.random.default_rng(0)
        ds = Dataset(
            rng.integers(0, 255, (64, 8, 8), dtype=np.uint8),
            rng.integers(0, 10, 64),
            rng.integers(0, 255, (16, 8, 8), dtype=np.uint8),
            rng.integers(0, 10, 16),
            classes=[str(i) for i in range(10)],
            description="fuzz",
        )
        self.lt = LoopThread()
        self.port = free_port()
        cfg = DataServerConfig(token=TOKEN, port=self.port, workers=0, ahead=1, augment=False)
        self.server = DataServer(cfg, ds)

        async def up() -> Any:
            await self.server.start()
            return await aweb.serve(self.server.make_app(), "127.0.0.1", self.port)

        self.runner = self.lt.run(up())

    def close(self) -> None:
        async def down() -> None:
            await self.runner.cleanup()
            await self.server.close()

        self.lt.run(down())
        self.lt.stop()


@pytest.fixture(scope="module")
def data_server() -> Iterator[DataServerUnderTest]:
    d = DataServerUnderTest()
    try:
        yield d
    finally:
        d.close()


STREAM_FIELDS = ["replica", "n_replicas", "epoch", "batch_size", "split", "start", "fingerprint"]


@st.composite
def stream_requests(draw: st.DrawFn) -> bytes:
    if draw(st.integers(0, 5)) == 0:
        return draw(st.binary(max_size=200))
    msg: dict[str, Any] = {
        "op": draw(st.sampled_from(["stream", "stream", "x", 1])),
        "v": draw(st.sampled_from([1, 1, True, 1.0])),
    }
    for name in draw(st.lists(st.sampled_from(STREAM_FIELDS), max_size=7, unique=True)):
        msg[name] = draw(
            st.one_of(
                scalars,
                st.integers(-3, 100),
                st.sampled_from(["train", "test"]),
                st.just(2**63 - 1),
            )
        )
    return msgpack.packb(msg, use_bin_type=True)


@settings(FUZZ, max_examples=80)
@given(body=stream_requests())
def test_data_server_bad_stream_requests_get_a_4xx(
    data_server: DataServerUnderTest, body: bytes
) -> None:
    status, reply, ctype = http_call(
        data_server.port, "POST", "/stream", body, {"Content-Type": "application/msgpack"}
    )
    assert status < 500, (status, reply[:300])
    if status >= 400:
        assert_client_error(status, reply, ctype)
    healthy(data_server.port)


def test_fuzz_suite_helpers_see_a_valid_request(data_server: DataServerUnderTest) -> None:
    """The generators can produce valid requests, so a 4xx above is not vacuous."""
    body = msgpack.packb(
        {"op": "stream", "v": 1, "replica": 0, "n_replicas": 1, "epoch": 1, "batch_size": 8}
    )
    status, reply, _ = http_call(data_server.port, "POST", "/stream", body)
    assert status == 200 and len(reply) > 0
