"""A state-transfer snapshot damaged on the wire is refused where it enters, counted, and the
transfer retried (issue 29: "State transfer and replication carry checksums too, so corruption
in memory or on the wire is caught where it enters").

Real processes (3 controllers, 3 parameter servers) under the exactness load; every server
advertises a proxy (``--advertise``) that its peers and clients reach it through. The proxy
forwards every request unchanged and, in the replies to the first ``repl_snapshot`` requests,
changes one stored 1.0 into 1.0000001 (the lowest mantissa bit, as the issue's corruption on
disk). A restarted server joins every bucket by state transfer through the proxies: it must
refuse each damaged snapshot (logged ``CORRUPT snapshot``, counted in
``adamps_ps_corrupt_records_total{where="transfer"}``), fetch it again, and end bit-identical to
the other copies with every acknowledged push present exactly once. (Replication batches travel
on the data plane, not through these proxies; their checksums are tested in
tests/integration/test_ps_storage.py.)
"""

from __future__ import annotations

import asyncio
import re
import threading
import time
import urllib.request
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from adamps import protocol
from adamps.localcluster import LocalCluster
from adamps.procs import free_port
from tests.chaos.nemesis import (
    CONTROLLER_OPTS,
    N_BUCKETS,
    PS_OPTS,
    TOKEN,
    read_and_check,
    settle,
    start_load,
    wait_digests_agree,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]

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
            async with session.request(
                request.method,
                f"http://{target}{request.path_qs}",
                data=body,
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=30),
            ) as r:
                out = await r.read()
                status, ctype = r.status, r.headers.get("Content-Type")
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


def metric(address: str, name: str) -> float:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as r:
        text = r.read().decode()
    return sum(
        float(m[1]) for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    )


def test_a_snapshot_damaged_on_the_wire_is_refused_counted_and_fetched_again(
    tmp_path: Path,
) -> None:
    c = LocalCluster(
        tmp_path, token=TOKEN, n_controllers=3, n_servers=3, n_buckets=N_BUCKETS,
        controller_opts=CONTROLLER_OPTS, ps_opts=PS_OPTS,
    )  # fmt: skip
    with DamagingProxy(c.servers, damage=3) as proxy:
        try:
            for i in range(len(c.controllers)):
                c.start_controller(i)
            for i, addr in enumerate(c.controllers):
                c.procs[f"controller{i}"].wait_http(f"http://{addr}/healthz", 60)
            base = dict(c.ps_opts)
            for i in range(len(c.servers)):
                c.ps_opts = {**base, "advertise": proxy.addresses[i]}
                c.start_server(i)
            for i, addr in enumerate(c.servers):
                c.procs[c.server_ids[i]].wait_http(f"http://{addr}/healthz", 60)
            c.wait_placed(60)
            client, load = start_load(c)
            try:
                time.sleep(3.0)  # stored 1.0 values in every bucket
                victim, addr = c.server_ids[0], c.servers[0]
                c.kill(victim)
                c.ps_opts = {**base, "advertise": proxy.addresses[0]}
                c.start_server(0, wipe=True)  # no copy: every bucket by state transfer
                c.procs[victim].wait_http(f"http://{addr}/healthz", 30)
                why = settle(c, 40.0)
                assert why is None, why
                load.stop()
                counts = read_and_check(c, client, load, [], timeout=40.0)
                print(f"outcomes: {counts}; proxy: {proxy.damaged} of {proxy.snapshots} "
                      "snapshots damaged")  # fmt: skip
                assert proxy.damaged == 3, "the load stored 1.0 values to damage"
                assert proxy.snapshots >= N_BUCKETS + proxy.damaged
                log = c.procs[victim].log_path.read_text(errors="replace")
                assert log.count("CORRUPT snapshot") == proxy.damaged, log[-3000:]
                assert metric(addr, "adamps_ps_corrupt_records_total") == proxy.damaged
                wait_digests_agree(c, timeout=30.0)
            finally:
                load.stop()
                client.close()
        finally:
            c.stop()
