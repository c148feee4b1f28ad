"""The binary data plane of a real PS process: push/pull of raw float32 frames, and bad frames.

Bad input gets an error frame naming the problem, nothing changes (pulled over HTTP and
compared), and the server keeps serving (a new connection works, healthz answers).
"""

from __future__ import annotations

import asyncio
import socket
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest

from adamps.client.dataplane import (
    ERROR,
    HEADER,
    MAX_META,
    REQUEST,
    DataPlaneClient,
    DataPlaneError,
    frame_header,
)
from adamps.client.rpc import RpcError, SyncRpc
from adamps.server.replication.peer_keys import PeerKeys
from adamps.server.replication.peers import PeerChannel, Peers
from adamps.up.procs import Proc, adamps_argv, free_port
from adamps.wire import protocol

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from frames import read_frame  # noqa: E402

pytestmark = pytest.mark.slow

TOKEN = "dp-token"
MAX_BODY = 1 << 20
N = 30_000  # a 120 KB tensor: one shard


class Server:
    def __init__(self, proc: Proc, port: int, data_port: int) -> None:
        self.proc, self.port, self.data_port = proc, port, data_port
        self.http = SyncRpc(f"http://127.0.0.1:{port}", TOKEN)

    def client(self, token: str = TOKEN) -> DataPlaneClient:
        return DataPlaneClient("127.0.0.1", self.data_port, token, timeout=10)

    def state(self) -> tuple[bytes, Any]:
        pulled = self.http.call("pull", tensors=["v"])
        return pulled["tensors"]["v"].tobytes(), pulled["versions"]

    def raw(self, frame: bytes, expect_close: bool) -> tuple[int, dict[str, Any], bool]:
        """Sends raw bytes; returns (kind, meta, whether the server closed the connection).

        A close is waited for up to 10 s when expected; otherwise 0.5 s of silence counts as open."""
        with socket.create_connection(("127.0.0.1", self.data_port), timeout=10) as s:
            try:
                s.sendall(frame)
            except (BrokenPipeError, ConnectionResetError):
                pass
            kind, meta = read_frame(s)
            s.settimeout(10.0 if expect_close else 0.5)
            try:
                closed = s.recv(1) == b""
            except ConnectionResetError:
                closed = True
            except TimeoutError:
                closed = False
        return kind, meta, closed


def start_ps(root: Path, *args: str, data_port: bool = False) -> tuple[Proc, int, int]:
    """A real PS on fresh ports; retried, since a port that was free can be taken by a concurrent
    process before the PS binds it (the PS then exits at once; its log says so)."""
    for attempt in range(3):
        port, dport = free_port(), (free_port() if data_port else 0)
        argv = adamps_argv("ps", "--port", str(port), "--data-port", str(dport), *args)
        env = {"ADAMPS_TOKEN": TOKEN, "OPENBLAS_NUM_THREADS": "1"}
        proc = Proc(argv, root / f"ps-{attempt}.log", env=env, name="ps")
        try:
            proc.wait_http(f"http://127.0.0.1:{port}/healthz", timeout=30)
            return proc, port, dport
        except RuntimeError:
            proc.stop()
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root: Path = tmp_path_factory.mktemp("ps-dataplane")
    proc, port, data_port = start_ps(
        root, "--data-dir", str(root / "lmdb"), "--max-body", str(MAX_BODY), data_port=True
    )
    try:
        s = Server(proc, port, data_port)
        s.http.call("create", name="v", shape=[N], optimizer={"kind": "sgd", "lr": -1})
        s.http.call("create", name="m", shape=[2, 3], optimizer={"kind": "sgd", "lr": -1})
        yield s
        s.http.close()
    finally:
        proc.stop()


def request_frame(
    meta: dict[str, Any], payload: bytes = b"", payload_len: int | None = None
) -> bytes:
    m = protocol.encode(meta)
    n = len(payload) if payload_len is None else payload_len
    return frame_header(REQUEST, len(m), n) + m + payload


def meta(op: str = "push_dense", token: str = TOKEN, **fields: Any) -> dict[str, Any]:
    return protocol.request(op, token=token, **{"tensor": "v", **fields})


def test_push_and_pull_agree_with_http_and_sum_exactly(server: Server) -> None:
    before = np.frombuffer(server.state()[0], np.float32)
    delta = (np.arange(N, dtype=np.float32) % 3) - 1
    n_threads, n_pushes = 3, 10

    def pusher(i: int) -> None:
        with server.client() as c:
            for s in range(n_pushes):
                c.push_dense("v", delta, client=f"dp{i}", seq=s)

    threads = [threading.Thread(target=pusher, args=(i,)) for i in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    with server.client() as c:
        values, versions = c.pull("v")
        out = np.empty(N, np.float32)
        again, _ = c.pull("v", out=out)
    assert np.array_equal(values, before + delta * n_threads * n_pushes)
    assert np.shares_memory(again, out) and np.array_equal(again, values)
    http_values, http_versions = server.state()
    assert http_values == values.tobytes() and http_versions == {"v": versions}
    with server.client() as c:
        m, _ = c.pull("m")
    assert m.shape == (2, 3)


CASES: dict[str, tuple[Any, str, bool]] = {
    # name: (frame bytes, error code, whether the server closes the connection)
    "bad magic": (lambda: b"XXXX" + bytes(HEADER.size - 4), "malformed", True),
    "wrong frame version": (lambda: HEADER.pack(b"ADPS", 9, REQUEST, 0, 10, 0), "unsupported_version", True),
    "meta too large": (lambda: frame_header(REQUEST, MAX_META + 1, 0), "too_large", True),
    "payload over the limit": (lambda: frame_header(REQUEST, 10, MAX_BODY + 1), "too_large", True),
    "meta not msgpack": (lambda: frame_header(REQUEST, 4, 0) + b"\xc1\xc1\xc1\xc1", "malformed", True),
    "missing token": (lambda: request_frame({k: v for k, v in meta().items() if k != "token"}), "unauthorized", True),
    "wrong token": (lambda: request_frame(meta(token="guess"), bytes(4 * N)), "unauthorized", True),
    "unknown op": (lambda: request_frame(meta(op="create")), "unknown_op", True),
    "repl_multi on a standalone server": (lambda: request_frame(meta(op="repl_multi", items=[])), "unknown_op", True),
    "unknown tensor": (lambda: request_frame(meta(tensor="nope"), bytes(4 * N)), "unknown_tensor", True),
    "wrong length": (lambda: request_frame(meta(), bytes(4 * N - 4)), "bad_length", True),
    "NaN": (lambda: request_frame(meta(), np.full(N, np.nan, np.float32).tobytes()), "non_finite", False),
    "Inf": (lambda: request_frame(meta(), np.full(N, -np.inf, np.float32).tobytes()), "non_finite", False),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_bad_frames_are_refused_and_change_nothing(server: Server, case: str) -> None:
    make, code, closes = CASES[case]
    before = server.state()
    kind, reply, closed = server.raw(make(), expect_close=closes)
    assert kind == ERROR and reply["error"]["code"] == code, reply
    assert reply["error"]["message"]
    assert closed == closes
    assert server.state() == before
    assert server.http.get_json("/healthz") == {"ok": True}
    with server.client() as c:  # the data plane still serves
        assert c.pull("m")[0].shape == (2, 3)


def test_the_client_raises_the_servers_error_and_the_connection_stays_usable(
    server: Server,
) -> None:
    with server.client() as c:
        with pytest.raises(DataPlaneError) as err:
            c.push_dense("v", np.full(N, np.nan, np.float32))
        assert err.value.code == "non_finite"
        assert c.pull("v")[0].shape == (N,)
    with server.client(token="guess") as bad, pytest.raises(DataPlaneError) as err:
        bad.push_dense("v", np.zeros(N, np.float32))
    assert err.value.code == "unauthorized"


def test_pipelined_pushes_are_applied_in_order_with_errors_in_place(server: Server) -> None:
    before_values, before_versions = server.state()
    base = np.frombuffer(before_values, np.float32)
    one = np.ones(N, np.float32)
    nan = np.full(N, np.nan, np.float32)
    with server.client() as c:
        results = c.push_many(
            [("v", one), ("v", nan), ("v", 2 * one), ("nope", one), ("v", one)], window=4
        )
        assert isinstance(results[1], DataPlaneError) and results[1].code == "non_finite"
        v0 = before_versions["v"][0]
        assert [r["v/0"] for r in (results[0], results[2])] == [v0 + 1, v0 + 2]
        # an unknown tensor breaks the stream: the server answers it, then closes the connection
        assert isinstance(results[3], DataPlaneError) and results[3].code == "unknown_tensor"
        assert isinstance(results[4], DataPlaneError) and results[4].code == "unavailable"
    values, versions = server.state()
    assert versions["v"][0] == before_versions["v"][0] + 2
    assert np.array_equal(np.frombuffer(values, np.float32), base + 3)


def test_message_ops_carry_the_rpc_message_with_its_arrays_out_of_band(server: Server) -> None:
    """push_fc as a message frame: the same handler, checks and result as on /rpc; a bad
    message is answered after its payload and the connection stays usable. (Exactly once by
    (client, seq) on a replicated cluster: tests/integration/test_downpour_cluster.py trains
    through PSClient, whose push_fc and push_compressed go over the data plane.)"""
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    e = np.array([[1, -1], [2, 0.5]], np.float32)
    with server.client() as c:
        before, _ = c.pull("m")
        assert c.send_message("push_fc", tensor="m", a=a, e=e, client="fc", seq=1)
        c.read_push_reply()
        after, _ = c.pull("m")
        np.testing.assert_allclose(after, before + e.T @ a, rtol=1e-6)  # lr -1: W += e.T a
        state = server.state()
        for fields, code in (
            ({"tensor": "nope", "a": a, "e": e}, "unknown_tensor"),
            ({"tensor": "m", "a": a, "e": e[:1]}, "bad_shape"),
            ({"tensor": "m", "a": np.full_like(a, np.nan), "e": e}, "non_finite"),
        ):
            assert c.send_message("push_fc", **fields)
            with pytest.raises(DataPlaneError) as err:
                c.read_push_reply()
            assert err.value.code == code, (fields, err.value)
        assert server.state() == state
        assert c.pull("m")[0].shape == (2, 3)  # the connection still serves
    overrun = protocol.request("push_fc", token=TOKEN, tensor="m", e=e,
                               a={"dtype": "float32", "shape": [2, 3], "at": 0})  # fmt: skip
    m = protocol.encode(overrun)
    kind, reply, closed = server.raw(
        frame_header(REQUEST, len(m), 8) + m + bytes(8), expect_close=False
    )
    assert kind == ERROR and reply["error"]["code"] == "bad_length" and not closed, reply
    assert server.state() == state


def test_a_peer_whose_data_plane_refuses_repl_multi_is_an_error_not_a_fallback(
    server: Server,
) -> None:
    """A replicated server's rounds go to a peer's data port. A peer that refuses the op there
    (`unknown_op`: nothing handled) answers an error, which the round sees; the message is not
    sent again over HTTP, as it once was for peers of a version never released (one meaning
    per operation, one transport per peer)."""

    async def call() -> tuple[RpcError, PeerChannel]:
        async with aiohttp.ClientSession() as session:
            peers = Peers(TOKEN, 5.0, PeerKeys("new", None, lambda: None, lambda _s: True))
            peers.session = session
            peers.addresses["old"] = f"127.0.0.1:{server.port}"
            channel = peers.channel("old")
            with pytest.raises(RpcError) as err:
                await channel.call("repl_ping", sender="new", buckets={})
            peers.close()
            return err.value, channel

    err, channel = asyncio.run(call())
    assert err.code == "unknown_op", err
    assert channel.stream is not None  # the data port answered, and stays the transport
