"""Issue 12 item 6: partial-head and idle connections are closed and their number is capped, on
the data server's HTTP port and the PS's binary data port (the controller's HTTP port:
test_controller_hardening.py). Also item 8's non-ASCII Authorization header on the data server.
"""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path

import numpy as np

from adamps.client.dataplane import HEADER, MAGIC, REQUEST, DataPlaneClient
from adamps.server.api.app import ParameterServer
from adamps.server.config import PsConfig
from adamps.up.procs import free_port
from adamps.wire import web as aweb
from dataserver.config import DataServerConfig
from dataserver.service import DataServer
from dataserver.sources import Dataset

TOKEN = "connections-token"


def closed_within(sock: socket.socket, timeout: float) -> float | None:
    """Seconds until the peer closed `sock`, or None if it stayed open for `timeout`."""
    t0 = time.monotonic()
    sock.settimeout(0.1)
    while time.monotonic() - t0 < timeout:
        try:
            if sock.recv(65536) == b"":
                return time.monotonic() - t0
        except TimeoutError:
            continue
        except ConnectionResetError:
            return time.monotonic() - t0
    return None


def tiny_dataset() -> Dataset:
    rng = np.random.default_rng(0)
    return Dataset(
        rng.integers(0, 255, (32, 8, 8), dtype=np.uint8),
        rng.integers(0, 10, 32),
        rng.integers(0, 255, (8, 8, 8), dtype=np.uint8),
        rng.integers(0, 10, 8),
        classes=[str(i) for i in range(10)],
    )


async def test_data_server_closes_partial_head_and_idle_connections() -> None:
    port = free_port()
    cfg = DataServerConfig(
        token=TOKEN, port=port, workers=0, augment=False, header_timeout=0.5, idle_timeout=0.5
    )
    server = DataServer(cfg, tiny_dataset())
    await server.start()
    runner = await aweb.serve(server.make_app(), "127.0.0.1", port)
    try:

        def probe() -> tuple[float | None, float | None, bytes]:
            with (
                socket.create_connection(("127.0.0.1", port)) as partial,
                socket.create_connection(("127.0.0.1", port)) as idle,
                socket.create_connection(("127.0.0.1", port)) as auth,
            ):
                partial.sendall(b"POST /stream HTTP/1.1\r\nHost: x\r\nContent-")
                auth.sendall(
                    b"POST /stream HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n"
                    b"Authorization: Bearer \xff\xfe\xc3\xa9\r\nConnection: close\r\n\r\n"
                )
                auth.settimeout(5)
                reply = auth.recv(4096)
                return closed_within(partial, 4.0), closed_within(idle, 4.0), reply

        t_partial, t_idle, reply = await asyncio.to_thread(probe)
        assert t_partial is not None and t_partial < 3.0
        assert t_idle is not None and t_idle < 3.0
        assert reply.startswith(b"HTTP/1.1 401"), reply[:200]
    finally:
        await runner.cleanup()
        await server.close()


async def start_ps(tmp_path: Path, **cfg) -> tuple[ParameterServer, object, int]:
    port, dport = free_port(), free_port()
    ps = ParameterServer(
        PsConfig(
            port=port, data_port=dport, token=TOKEN, data_dir=str(tmp_path / "ps"),
            owner_threads=1, flush_interval=3600, lmdb_sync=False, **cfg,
        )
    )  # fmt: skip
    runner = await aweb.serve(ps.make_app(), "127.0.0.1", port)
    return ps, runner, dport


async def test_data_port_closes_idle_and_stalled_connections(tmp_path: Path) -> None:
    ps, runner, dport = await start_ps(
        tmp_path, idle_timeout=0.5, header_timeout=0.5, body_timeout=0.5
    )
    try:

        def probe() -> tuple[float | None, float | None, float | None]:
            with (
                socket.create_connection(("127.0.0.1", dport)) as idle,
                socket.create_connection(("127.0.0.1", dport)) as partial,
                socket.create_connection(("127.0.0.1", dport)) as stalled,
            ):
                partial.sendall(HEADER.pack(MAGIC, 1, REQUEST, 0, 10, 0)[:7])
                stalled.sendall(HEADER.pack(MAGIC, 1, REQUEST, 0, 100, 0) + b"\x80" * 10)
                return (
                    closed_within(idle, 4.0),
                    closed_within(partial, 4.0),
                    closed_within(stalled, 4.0),
                )

        times = await asyncio.to_thread(probe)
        assert all(t is not None and t < 3.0 for t in times), times
    finally:
        await runner.cleanup()


async def test_data_port_caps_connections_and_keeps_serving(tmp_path: Path) -> None:
    ps, runner, dport = await start_ps(tmp_path, max_connections=20)
    try:
        rpc_port = ps.cfg.port
        from adamps.client.rpc import AsyncRpc

        rpc = AsyncRpc(f"http://127.0.0.1:{rpc_port}", TOKEN)
        await rpc.call("create", name="v", shape=[16], optimizer={"kind": "sgd", "lr": -1})
        await rpc.close()

        def flood_then_pull() -> np.ndarray:
            socks = [socket.create_connection(("127.0.0.1", dport)) for _ in range(60)]
            try:
                time.sleep(0.2)
                with DataPlaneClient("127.0.0.1", dport, TOKEN, timeout=5) as c:
                    values, _versions = c.pull("v")
                    return values
            finally:
                for s in socks:
                    s.close()

        values = await asyncio.to_thread(flood_then_pull)
        assert values.shape == (16,)
        assert ps.data_plane.open_connections() <= 20
    finally:
        await runner.cleanup()
