"""The data port receives large payloads on a thread per connection, off the event loop (issue
27, adamps/server/api/dp_reader.py): the payload arrives whole, pipelined frames are applied in the
order sent, a payload that stalls is closed at its body deadline, a client gone mid-payload
ends the thread, and the server keeps serving throughout. An in-process server, so that the
test sees its connections and threads.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from adamps.client.dataplane import REQUEST, DataPlaneClient, DataPlaneError, frame_header
from adamps.client.rpc import AsyncRpc
from adamps.server.api.dp_reader import OFF_LOOP_MIN, RECV_THREAD_ENV, off_loop_min
from adamps.server.updates import bounds
from adamps.wire import protocol
from tests.integration.test_connections import TOKEN, closed_within, start_ps

N = 1 << 18  # 1 MiB of float32: far above OFF_LOOP_MIN
assert 4 * N >= OFF_LOOP_MIN


def readers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "adamps-dp-recv"]


async def create(ps, n: int = N) -> None:
    rpc = AsyncRpc(f"http://127.0.0.1:{ps.cfg.port}", TOKEN)
    await rpc.call("create", name="v", shape=[n], optimizer={"kind": "sgd", "lr": -1.0})
    await rpc.close()


async def test_large_payloads_are_received_on_the_connections_thread_in_order(
    tmp_path: Path,
) -> None:
    ps, runner, dport = await start_ps(tmp_path)
    try:
        await create(ps)
        deltas = [np.full(N, float(i + 1), np.float32) for i in range(12)]

        def push_and_pull() -> tuple[list, np.ndarray, int]:
            with DataPlaneClient("127.0.0.1", dport, TOKEN, timeout=20) as c:
                got = c.push_many([("v", d) for d in deltas], window=8)
                during = len(readers())
                values, _ = c.pull("v")
            return got, values, during

        got, values, during = await asyncio.to_thread(push_and_pull)
        assert all(isinstance(r, dict) for r in got), got
        # lr -1: v = sum of the deltas, every one applied once
        np.testing.assert_array_equal(values, np.full(N, sum(range(1, 13)), np.float32))
        assert during == 1, "the connection's payloads were not received by its reader thread"
        for _ in range(50):  # the connection closed: its thread ends
            if not readers():
                break
            await asyncio.sleep(0.05)
        assert not readers(), "a reader thread outlived its connection"
    finally:
        await runner.cleanup()


def _push_head(n_bytes: int) -> bytes:
    meta = protocol.encode(protocol.request("push_dense", tensor="v", token=TOKEN))
    return frame_header(REQUEST, len(meta), n_bytes) + meta


async def test_a_stalled_payload_is_closed_at_its_deadline_and_nothing_changes(
    tmp_path: Path,
) -> None:
    ps, runner, dport = await start_ps(tmp_path, body_timeout=0.8)
    try:
        await create(ps)

        def stall_then_push() -> tuple[float | None, float | None, np.ndarray]:
            with socket.create_connection(("127.0.0.1", dport)) as stalled:
                stalled.sendall(_push_head(4 * N) + b"\x00" * (2 * N))  # half the payload
                t_stalled = closed_within(stalled, 5.0)
            with socket.create_connection(("127.0.0.1", dport)) as gone:
                gone.sendall(_push_head(4 * N) + b"\x00" * N)
            t0 = time.monotonic()  # the client left mid-payload: its thread ends at once
            while readers() and time.monotonic() - t0 < 3.0:
                time.sleep(0.02)
            t_gone = time.monotonic() - t0 if not readers() else None
            with DataPlaneClient("127.0.0.1", dport, TOKEN, timeout=10) as c:
                values, _ = c.pull("v")
            return t_stalled, t_gone, values

        t_stalled, t_gone, values = await asyncio.to_thread(stall_then_push)
        assert t_stalled is not None and t_stalled < 3.0, t_stalled
        assert t_gone is not None and t_gone < 1.0, t_gone
        np.testing.assert_array_equal(values, np.zeros(N, np.float32))  # nothing applied
        assert ps.data_plane.open_connections() == 0
    finally:
        await runner.cleanup()


async def test_adamps_dp_recv_thread_0_keeps_payloads_on_the_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(RECV_THREAD_ENV, "0")
    ps, runner, dport = await start_ps(tmp_path)
    try:
        await create(ps)

        def push() -> int:
            with DataPlaneClient("127.0.0.1", dport, TOKEN, timeout=20) as c:
                c.push_many([("v", np.ones(N, np.float32))] * 4, window=4)
                return len(readers())

        assert await asyncio.to_thread(push) == 0
    finally:
        await runner.cleanup()
    with pytest.raises(ValueError, match="ADAMPS_DP_RECV_THREAD must be 0 or 1, got 'yes'"):
        off_loop_min({RECV_THREAD_ENV: "yes"})


async def test_bad_values_in_a_payload_read_off_the_loop_get_the_loops_error(
    tmp_path: Path,
) -> None:
    """The reader thread checks a push's values while they are hot (bounds.within); a payload
    that fails is refused with the loop's error naming the shard (NaN, Inf, too large), nothing
    of it is applied, the connection stays usable, and a good push behind it is applied once."""
    ps, runner, dport = await start_ps(tmp_path)
    try:
        await create(ps, 2 * N)  # two shards of 1 MiB
        half = N  # layout: shards of at most 262,144 float32
        assert [s.id for s in ps.store.layout.shards_of["v"]] == ["v/0", "v/1"]

        def pushes() -> tuple[list, np.ndarray, int]:
            got = []
            with DataPlaneClient("127.0.0.1", dport, TOKEN, timeout=20) as c:
                for value, pos in ((np.nan, 3), (np.inf, half + 7), (-2e12, 2 * half - 1)):
                    bad = np.ones(2 * N, np.float32)
                    bad[pos] = value
                    try:
                        c.push_dense("v", bad)
                        got.append("applied")
                    except DataPlaneError as exc:
                        got.append((exc.code, str(exc)))
                c.push_dense("v", np.full(2 * N, 2.0, np.float32))
                values, _ = c.pull("v")
                return got, values, len(readers())

        got, values, during = await asyncio.to_thread(pushes)
        assert during == 1
        assert [g[0] for g in got] == ["non_finite", "non_finite", "bad_request"], got
        assert "v/0" in got[0][1] and "v/1" in got[1][1] and "v/1" in got[2][1], got
        np.testing.assert_array_equal(values, np.full(2 * N, 2.0, np.float32))  # lr -1, once
    finally:
        await runner.cleanup()


async def test_a_good_payload_read_off_the_loop_is_not_checked_again_on_the_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reader thread's check replaces the loop's for a payload it received: check_dense
    runs on the loop only for a payload that failed there (or one the loop received)."""
    calls: list[str] = []
    real = bounds.check_dense
    monkeypatch.setattr(bounds, "check_dense", lambda name, d: (calls.append(name), real(name, d)))
    ps, runner, dport = await start_ps(tmp_path)
    try:
        await create(ps)

        def push(value: float) -> None:
            with DataPlaneClient("127.0.0.1", dport, TOKEN, timeout=20) as c:
                c.push_many([("v", np.full(N, value, np.float32))] * 3, window=3)

        await asyncio.to_thread(push, 1.0)
        assert calls == []
        await asyncio.to_thread(push, np.nan)
        assert calls == ["v/0"] * 3
    finally:
        await runner.cleanup()
