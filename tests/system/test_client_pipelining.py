"""`PSClient` pipelines its data-plane frames (issue 27): a push to one server goes out as frames
(of at most `frame_bytes`, here 1 MiB) on bucket boundaries, up to MAX_INFLIGHT (8) in flight on the connection, and each
reply read lets the next frame out at once (a sliding window, not rounds with a barrier).

A real `adamps ps` process; between it and the client a frame-aware TCP proxy that forwards the
requests at once and holds the replies until the test releases them: the client must have sent
frames it has no acknowledgement for yet. Before, `PSClient` sent one frame per server and push
and waited for its reply, so the proxy never saw a second frame while holding the first reply.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from adamps.client import PSClient, StaticRouting
from adamps.client.dataplane import HEADER, MAX_INFLIGHT
from adamps.client.pool import DataPlanePool
from adamps.client.ps import FRAME_BYTES
from adamps.client.rpc import SyncRpc
from adamps.layout import Layout, TensorSpec
from adamps.up.procs import Proc, adamps_argv, free_port

pytestmark = pytest.mark.slow

TOKEN = "pipe-token"
SHARD = 1 << 18  # elements: 1 MiB shards, the default
N_BUCKETS = 64


def _recv_exact(s: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        try:
            got = s.recv(min(n - len(buf), 1 << 20))
        except OSError:  # the other direction's thread closed this socket: the connection ended
            return None
        if not got:
            return None
        buf += got
    return bytes(buf)


class GateProxy:
    """Forwards one data-plane connection's requests to the server at once, counting frames as
    their headers pass, and holds each reply frame until `allowed` replies may pass."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.lsock = socket.create_server(("127.0.0.1", 0))
        self.port = self.lsock.getsockname()[1]
        self.cond = threading.Condition()
        #: request frames whose header passed, replies forwarded, replies the test lets pass
        self.frames = 0
        self.replies = 0
        self.allowed = 0
        #: the most requests ever in flight (headers passed, replies not forwarded)
        self.max_inflight = 0
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                down, _ = self.lsock.accept()
            except OSError:
                return
            up = socket.create_connection(("127.0.0.1", self.target))
            threading.Thread(target=self._requests, args=(down, up), daemon=True).start()
            threading.Thread(target=self._replies, args=(up, down), daemon=True).start()

    def _requests(self, src: socket.socket, dst: socket.socket) -> None:
        while (head := _recv_exact(src, HEADER.size)) is not None:
            _m, _v, _k, _z, meta_len, payload_len = HEADER.unpack(head)
            with self.cond:
                self.frames += 1
                self.max_inflight = max(self.max_inflight, self.frames - self.replies)
                self.cond.notify_all()
            rest = _recv_exact(src, meta_len + payload_len)
            if rest is None:
                break
            try:
                dst.sendall(head + rest)
            except OSError:
                break
        dst.close()

    def _replies(self, src: socket.socket, dst: socket.socket) -> None:
        while (head := _recv_exact(src, HEADER.size)) is not None:
            _m, _v, _k, _z, meta_len, payload_len = HEADER.unpack(head)
            rest = _recv_exact(src, meta_len + payload_len)
            if rest is None:
                break
            with self.cond:
                self.cond.wait_for(lambda: self.replies < self.allowed or self.closed, 30)
                self.replies += 1
                self.cond.notify_all()
            try:
                dst.sendall(head + rest)
            except OSError:
                break
        dst.close()

    def wait_frames(self, n: int, timeout: float = 10.0) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: self.frames >= n, timeout)

    def allow(self, n: float) -> None:
        with self.cond:
            self.allowed = n
            self.cond.notify_all()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        self.lsock.close()


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[str, int]]:
    port, data_port = free_port(), free_port()
    proc = Proc(
        adamps_argv("ps", "--port", str(port), "--data-port", str(data_port), "--data-dir", str(tmp_path / "lmdb"), "--log-level", "WARNING"),
        tmp_path / "ps.log",
        env={"ADAMPS_TOKEN": TOKEN},
        name="ps",
    )  # fmt: skip
    try:
        proc.wait_http(f"http://127.0.0.1:{port}/healthz", 30)
        yield f"http://127.0.0.1:{port}", data_port
    finally:
        proc.stop()


def _client(base: str, layout: Layout, proxy: GateProxy) -> PSClient:
    # Frames of one shard each (1 MiB): enough frames to fill the window.
    client = PSClient(
        StaticRouting([base], N_BUCKETS), layout, TOKEN, timeout=20, retry_for=0,
        frame_bytes=SHARD * 4,
    )  # fmt: skip
    # The server's data port as the client finds it, but through the proxy.
    client._dp = DataPlanePool(TOKEN, 20, lambda url: {"data_port": proxy.port})
    return client


def test_a_push_goes_out_as_frames_in_flight_and_the_window_slides(
    server: tuple[str, int],
) -> None:
    base, data_port = server
    n_shards = MAX_INFLIGHT + 4
    spec = TensorSpec("w", (n_shards * SHARD,))
    layout = Layout([spec], n_buckets=N_BUCKETS)
    with SyncRpc(base, TOKEN) as rpc:
        rpc.call("create", name="w", shape=[n_shards * SHARD], optimizer={"kind": "sgd", "lr": 1.0})
    buckets = {layout.bucket_of[s.id] for s in layout.shards_of["w"]}
    assert len(buckets) > MAX_INFLIGHT, "the test needs more buckets than the window"
    proxy = GateProxy(data_port)
    client = _client(base, layout, proxy)
    delta = np.arange(n_shards * SHARD, dtype=np.float32) % 5
    errors: list[BaseException] = []

    def push() -> None:
        try:
            client.push_dense("w", delta)
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=push)
    try:
        t.start()
        # Every reply held: the client still sends a whole window of frames.
        window_out = proxy.wait_frames(MAX_INFLIGHT)
        frames_held = proxy.frames
        # One reply released: the next frame goes out while the other 7 replies are held.
        proxy.allow(1)
        slid = proxy.wait_frames(MAX_INFLIGHT + 1)
        proxy.allow(float("inf"))
        t.join(30)
    finally:
        proxy.allow(float("inf"))
        proxy.close()
    assert not t.is_alive() and not errors, errors
    assert window_out, f"only {frames_held} frame(s) sent while no reply was released"
    assert slid, "no frame sent after one reply while the others were held (a barrier)"
    assert proxy.max_inflight <= MAX_INFLIGHT, proxy.max_inflight
    assert proxy.frames == len(buckets) == client.dp_requests
    # Applied once, every frame: w = 0 - 1.0 * delta.
    with SyncRpc(base, TOKEN) as rpc:
        got = rpc.call("pull", tensors=["w"])["tensors"]["w"]
    assert np.array_equal(got, -delta)
    client.close()


def test_a_pull_comes_back_in_frames_in_flight(server: tuple[str, int]) -> None:
    base, data_port = server
    n_shards = 4
    spec = TensorSpec("v", (n_shards * SHARD,))
    layout = Layout([spec], n_buckets=N_BUCKETS)
    want = np.arange(n_shards * SHARD, dtype=np.float32) % 7
    with SyncRpc(base, TOKEN) as rpc:
        rpc.call("create", name="v", shape=[n_shards * SHARD], optimizer={"kind": "sgd", "lr": 1.0})
        rpc.call("push_dense", tensor="v", delta=-want)
    proxy = GateProxy(data_port)
    client = _client(base, layout, proxy)
    got: list[np.ndarray] = []
    t = threading.Thread(target=lambda: got.append(client.pull(["v"])[0]["v"]))
    try:
        t.start()
        frames_out = proxy.wait_frames(n_shards)
        frames = proxy.frames
        proxy.allow(float("inf"))
        t.join(30)
    finally:
        proxy.allow(float("inf"))
        proxy.close()
    assert frames_out, f"only {frames} pull frame(s) sent while no reply was released"
    assert got and np.array_equal(got[0], want)
    client.close()


def test_push_frames_are_of_4_mib_by_default(server: tuple[str, int]) -> None:
    """A push of 4 MiB to one server is one frame (a frame's fixed cost, not its bytes, was
    most of a push's CPU with 1 MiB frames); 12 MiB are 3 frames in flight. Pulls keep frames
    of 1 MiB (PULL_FRAME_BYTES)."""
    base, data_port = server
    n_shards = 12
    layout = Layout([TensorSpec("u", (n_shards * SHARD,))], n_buckets=N_BUCKETS)
    with SyncRpc(base, TOKEN) as rpc:
        rpc.call("create", name="u", shape=[n_shards * SHARD], optimizer={"kind": "sgd", "lr": 1.0})
    proxy = GateProxy(data_port)
    proxy.allow(float("inf"))
    client = PSClient(StaticRouting([base], N_BUCKETS), layout, TOKEN, timeout=20, retry_for=0)
    client._dp = DataPlanePool(TOKEN, 20, lambda url: {"data_port": proxy.port})
    try:
        delta = np.ones(n_shards * SHARD, np.float32)
        client.push_shards({s.id: delta[s.start : s.stop] for s in layout.shards_of["u"][:4]})
        one = proxy.frames
        client.push_dense("u", delta)
        pushed = proxy.frames - one
        got, _ = client.pull(["u"])
        pulled = proxy.frames - one - pushed
    finally:
        client.close()
        proxy.close()
    assert FRAME_BYTES == 4 * SHARD * 4
    # (a push's frames are cut on bucket boundaries: 3, or 4 where two shards share a bucket)
    assert (one, pulled) == (1, 12) and pushed in (3, 4), (one, pushed, pulled)
    want = -np.ones(n_shards * SHARD, np.float32)
    want[: 4 * SHARD] -= 1.0
    assert np.array_equal(got["u"], want)
