"""A reverse proxy on loopback per parameter server, which the servers advertise (``--advertise``)
so that their peers and clients reach them through it: it forwards every request unchanged and
damages the replies to the first ``repl_snapshot`` requests (one stored 1.0 becomes 1.0000001,
the lowest mantissa bit, as the issue's corruption on disk): a state transfer damaged on the wire
(issue 29). Replication batches travel on the data plane, not through it."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import aiohttp
from aiohttp import web

from adamps.up.cluster import LocalCluster
from adamps.up.procs import free_port
from adamps.wire import protocol
from tests.chaos.nemesis import CONTROLLER_OPTS, N_BUCKETS, PS_OPTS, TOKEN

ONE = b"\x00\x00\x80\x3f"  # float32 1.0, little-endian
ONE_FLIPPED = b"\x01\x00\x80\x3f"  # 1.0000001


class DamagingProxy:
    """HTTP reverse proxies on loopback, one per server, in a thread of their own. The first
    `damage` replies to repl_snapshot (over all proxies) get one 1.0 changed; every other
    request and reply passes unchanged. Counts what it saw."""

    def __init__(self, targets: list[str], damage: int) -> None:
        self.targets = targets
        self.addresses = [f"127.0.0.1:{free_port()}" for _ in targets]
        self.left = damage
        self.damaged = 0
        self.snapshots = 0
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> DamagingProxy:
        self._thread.start()
        assert self._ready.wait(10), "proxies did not start"
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._serve())
        finally:
            self._loop.close()

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        runners = []
        for addr, target in zip(self.addresses, self.targets, strict=True):
            app = web.Application(client_max_size=1 << 30)
            app.router.add_route("*", "/{path:.*}", self._handler(session, target))
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            host, port = addr.rsplit(":", 1)
            await web.TCPSite(runner, host, int(port)).start()
            runners.append(runner)
        self._ready.set()
        await self._stop.wait()
        for r in runners:
            await r.cleanup()
        await session.close()

    def _handler(self, session: aiohttp.ClientSession, target: str):
        async def handle(request: web.Request) -> web.Response:
            body = await request.read()
            headers = {
                k: v
                for k, v in request.headers.items()
                if k.lower() not in ("host", "content-length", "transfer-encoding")
            }
            try:
                async with session.request(
                    request.method,
                    f"http://{target}{request.path_qs}",
                    data=body,
                    headers=headers,
                    timeout=aiohttp.ClientTimeout(total=30),
                ) as r:
                    out = await r.read()
                    status, ctype = r.status, r.headers.get("Content-Type")
            except aiohttp.ClientConnectorError as exc:  # nothing sent: the server is down
                return web.Response(
                    status=503,
                    body=protocol.error_body("unavailable", f"{target} is down: {exc}"),
                    content_type="application/json",
                )
            op = self._op(body)
            if op == "repl_snapshot" and status == 200:
                out = self._damage(out)
            return web.Response(body=out, status=status, headers={"Content-Type": ctype or ""})

        return handle

    @staticmethod
    def _op(body: bytes) -> str | None:
        try:
            msg = protocol.decode(body)
        except Exception:
            return None
        return msg.get("op") if isinstance(msg, dict) else None

    def _damage(self, out: bytes) -> bytes:
        with self._lock:
            self.snapshots += 1
            if self.left <= 0 or ONE not in out:
                return out
            self.left -= 1
            self.damaged += 1
        return out.replace(ONE, ONE_FLIPPED, 1)


@contextmanager
def proxied_cluster(root: Path, damage: int) -> Iterator[tuple[LocalCluster, DamagingProxy]]:
    """A started cluster (3 controllers, 3 servers, the nemesis' options) whose servers
    advertise the proxies; every server restarted later must advertise its proxy too
    (`restart`). Stopped on exit."""
    c = LocalCluster(
        root, token=TOKEN, n_controllers=3, n_servers=3, n_buckets=N_BUCKETS,
        controller_opts=CONTROLLER_OPTS, ps_opts=PS_OPTS,
    )  # fmt: skip
    with DamagingProxy(c.servers, damage) as proxy:
        try:
            for i in range(len(c.controllers)):
                c.start_controller(i)
            for i, addr in enumerate(c.controllers):
                c.procs[f"controller{i}"].wait_http(f"http://{addr}/healthz", 60)
            for i in range(len(c.servers)):
                restart(c, proxy, i)
            for i, addr in enumerate(c.servers):
                c.procs[c.server_ids[i]].wait_http(f"http://{addr}/healthz", 60)
            c.wait_placed(60)
            yield c, proxy
        finally:
            c.stop()


def restart(c: LocalCluster, proxy: DamagingProxy, i: int, wipe: bool = False) -> None:
    """Starts server i advertising its proxy."""
    base = {k: v for k, v in c.ps_opts.items() if k != "advertise"}
    c.ps_opts = {**base, "advertise": proxy.addresses[i]}
    try:
        c.start_server(i, wipe=wipe)
    finally:
        c.ps_opts = base
