"""A server's asyncio client receives a large msgpack body (a replica's snapshot, a state
transfer's 64 MiB bucket) without a long step on its event loop (issue 39).

Reference: docs/operations.md, "The event loop"; adamps/client/rpc.py, AsyncRpc.exchange. The
body used to go into ``bytearray(n)``, which zero-fills and page-faults its n bytes in one step of
the loop before the first chunk is copied: a state transfer held a replicated server's loop
0.2-0.3 s on a loaded machine (tests/system/test_loop_lag_peers.py). Measured here is the CPU
time of the loop's thread in each of its steps (a task that yields at every step reads
``time.thread_time``), which a loaded machine does not inflate, while a real aiohttp server in a
thread of its own sends a 256 MiB body.
"""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
from aiohttp import web

from adamps.client.rpc import AsyncRpc, Request
from adamps.up.procs import free_port
from adamps.wire import protocol

#: the body's array: 256 MiB of float32 (zero-filling it took 0.1 s of one step here)
N = 64 << 20
#: the most CPU one step of the client's loop may take (a chunk's copy takes well under 1 ms)
STEP_BOUND = 0.025


def _serve(port: int, ready: threading.Event, stop: threading.Event) -> None:
    body = protocol.encode({"v": 1, "a": np.ones(N, np.float32)})

    async def big(_request: web.Request) -> web.Response:
        return web.Response(body=body, content_type="application/msgpack")

    async def main() -> None:
        app = web.Application()
        app.router.add_get("/big", big)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        ready.set()
        while not stop.is_set():
            await asyncio.sleep(0.05)
        await runner.cleanup()

    asyncio.run(main())


async def test_a_large_msgpack_body_is_received_without_a_long_loop_step() -> None:
    port, ready, stop = free_port(), threading.Event(), threading.Event()
    server = threading.Thread(target=_serve, args=(port, ready, stop), daemon=True)
    server.start()
    try:
        assert ready.wait(60), "the test server did not start"
        worst, done = [0.0], asyncio.Event()

        async def probe() -> None:
            last = time.thread_time()
            while not done.is_set():
                await asyncio.sleep(0)
                now = time.thread_time()
                worst[0] = max(worst[0], now - last)
                last = now

        task = asyncio.create_task(probe())
        rpc = AsyncRpc(f"http://127.0.0.1:{port}", None, timeout=120)
        try:
            status, data = await rpc.exchange(Request("GET", "/big", None))
        finally:
            done.set()
            await task
            await rpc.close()
        assert status == 200
        got = (await asyncio.to_thread(protocol.decode, data))["a"]
        assert got.shape == (N,) and float(got[0]) == 1.0 and float(got[-1]) == 1.0
        assert worst[0] < STEP_BOUND, (
            f"one step of the loop took {worst[0] * 1000:.1f} ms of CPU while a "
            f"{4 * N >> 20} MiB body arrived"
        )
    finally:
        stop.set()
        server.join(30)
