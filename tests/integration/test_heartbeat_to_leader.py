"""Issue 36 (idle costs nothing): a server's heartbeats go to the Raft leader, not through a
follower. A follower forwards every write to the leader over HTTP, so a heartbeat through it
cost two controllers' event loops (and a third HTTP exchange) every second; the leader's answer
names its address, and the client asks it first from the next call on.

Three real controllers (pysyncobj, HTTP) in this process on loopback."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from adamps.client.controller import AsyncControllerClient, ControllerRing
from adamps.up.procs import free_port
from adamps.wire import web as aweb
from controller.config import ControllerConfig
from controller.service import ControllerService

TOKEN = "heartbeat-to-leader-token"


def test_an_answer_naming_the_leader_makes_it_the_first_asked() -> None:
    ring = ControllerRing(3)
    r = ring.round()
    with r.asking(1):
        ring.lead_to(2)  # controller 1 answered with the leader's (2) answer
    assert ring.first == 2
    with ring.round().asking(2):
        ring.lead_to(None)  # an answer naming no known leader: the one that answered
    assert ring.first == 2
    with ring.round().asking(0):
        pass
    assert ring.first == 0


@pytest.fixture
async def three(tmp_path: Path) -> AsyncIterator[list[ControllerService]]:
    ports = [(free_port(), free_port()) for _ in range(3)]
    members = [f"127.0.0.1:{raft}:{http}" for raft, http in ports]
    services, runners = [], []
    for i, (_raft, http) in enumerate(ports):
        cfg = ControllerConfig(
            members=members,
            member=i,
            data_dir=str(tmp_path / f"c{i}"),
            token=TOKEN,
            server_timeout=60.0,
            min_servers=1,
            replication=1,
        )
        s = ControllerService(cfg)
        services.append(s)
        runners.append(await aweb.serve(s.make_app(), "127.0.0.1", http))
    try:
        yield services
    finally:
        for r in runners:
            await r.cleanup()
        for s in services:
            s.close()


async def test_heartbeats_through_a_follower_go_to_the_leader_from_the_second_on(
    three: list[ControllerService],
) -> None:
    deadline = time.monotonic() + 30
    while not any(s.is_leader() and s.node.isReady() for s in three):
        assert time.monotonic() < deadline, "no leader elected"
        await asyncio.sleep(0.05)
    leader = next(s for s in three if s.is_leader())
    follower = next(s for s in three if s is not leader)
    http = {s: s.raft.http_of[s.raft.self_raft] for s in three}
    # the follower first in the server's list (as a server that found it answering)
    client = AsyncControllerClient(
        [http[follower], *(http[s] for s in three if s is not follower)], TOKEN
    )
    try:
        await client.register("ps0", "127.0.0.1:7000")
        forwarded = follower.m.forwarded._value.get()
        handled = leader.m.heartbeats._value.get()
        replies = [(await client.heartbeat("ps0", deltas=True))[0] for _ in range(4)]
        assert leader.m.heartbeats._value.get() == handled + 4
        assert follower.m.forwarded._value.get() == forwarded + 1, (
            "every heartbeat after the first still went through the follower"
        )
        assert all(r["leader"] == http[leader] for r in replies), replies
    finally:
        await client.close()
