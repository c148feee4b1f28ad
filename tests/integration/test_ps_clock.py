"""The parameter server's `clock` op in-process on a loopback socket (issue 25): a held step is
released when the slowest replica reports, a hold is bounded (503 naming who it waits for), a
dead replica stops blocking after its lease, and bad requests get a 4xx naming the field."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from adamps.client.rpc import AsyncRpc, RpcError
from adamps.server.api.app import ParameterServer
from adamps.server.config import PsConfig
from adamps.up.procs import free_port
from adamps.wire import web as aweb

TOKEN = "ps-test-token"
pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def rpc(tmp_path: Path) -> AsyncIterator[AsyncRpc]:
    port = free_port()
    cfg = PsConfig(port=port, token=TOKEN, data_dir=str(tmp_path / "ps"), flush_interval=3600,
                   clock_lease=1.5, clock_wait=0.5)  # fmt: skip
    ps = ParameterServer(cfg)
    runner = await aweb.serve(ps.make_app(), "127.0.0.1", port)
    client = AsyncRpc(f"http://127.0.0.1:{port}", TOKEN)
    try:
        yield client
    finally:
        await client.close()
        await runner.cleanup()
        ps.close()


def clock(rpc: AsyncRpc, replica: str, step: int, mode: str = "ssp:1", **kw):
    return rpc.call("clock", run="r", replica=replica, mode=mode, step=step,
                    expect=["a", "b"], **kw)  # fmt: skip


async def test_a_step_is_held_until_the_slowest_reports(rpc) -> None:
    assert (await clock(rpc, "a", 1))["staleness"] == 1
    held = asyncio.ensure_future(clock(rpc, "a", 2, wait=5.0))
    await asyncio.sleep(0.3)
    assert not held.done()  # a is 2 steps ahead of b (still at 0): ssp:1 holds it
    await clock(rpc, "b", 1)
    got = await asyncio.wait_for(held, 5)
    assert got["staleness"] == 1 and got["mode"] == "ssp:1"
    with pytest.raises(RpcError) as err:  # bounded: 503 naming whom it waits for
        await clock(rpc, "a", 3)
    assert err.value.http_status == 503 and "['b']" in err.value.message


async def test_a_dead_replica_stops_blocking_after_its_lease(rpc) -> None:
    t0 = time.monotonic()
    while True:  # b never reports: after clock_lease (1.5 s) a goes on alone
        try:
            await clock(rpc, "a", 1, mode="sync")
            break
        except RpcError as exc:
            assert exc.http_status == 503
    assert 1.0 < time.monotonic() - t0 < 10


@pytest.mark.parametrize(
    ("fields", "names"),
    [
        ({"mode": "ssp"}, "ssp:S"),
        ({"mode": "ssp:-2"}, "ssp:S"),
        ({"step": -1}, "step"),
        ({"run": "a b"}, "run"),
        ({"replica": ""}, "replica"),
        ({"phase": "later"}, "phase"),
        ({"phase": "fetched", "step": 0}, "fetched"),
        ({"wait": -1.0}, "wait"),
        ({"expect": [1, 2]}, "expect"),
    ],
)
async def test_bad_clock_requests_get_400_naming_the_field(rpc, fields, names) -> None:
    base = {"run": "r", "replica": "a", "mode": "sync", "step": 0}
    with pytest.raises(RpcError) as err:
        await rpc.call("clock", **{**base, **fields})
    assert err.value.http_status == 400 and names in err.value.message
    got = await rpc.call("clock", **base, join=True)  # nothing recorded, still serving
    assert got["step"] == 0
