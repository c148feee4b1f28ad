"""The replication core's transport (adamps.server.replication.peers.Peers.send), on a real event loop
against a peer whose port refuses connections: every message gets exactly one answer, from a
later loop step, and the messages of one drain travel without a task each (issue 36, helper
perf36's profile: ~46 messages per server per click-through step at RF 3, each its own task)."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import aiohttp

from adamps.core.replication.ready import Send
from adamps.server.replication.peer_keys import PeerKeys
from adamps.server.replication.peers import Peers


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_each_message_is_answered_once_later_and_a_drain_starts_no_task_per_message() -> None:
    keys = PeerKeys("a", None, lambda: None, lambda _s: True)
    peers = Peers("token", 2.0, keys)
    async with aiohttp.ClientSession() as session:
        peers.session = session
        peers.addresses["b"] = f"127.0.0.1:{_closed_port()}"
        answers: list[tuple[int, object, object]] = []
        before = len(asyncio.all_tasks())
        for rid in range(21):  # one drain: 21 buckets' COMMITs to one peer, one to an unknown one
            fields = {"bucket": rid, "epoch": 1, "sender": "a", "seq": 3}
            peers.send(
                Send(rid, "b", "repl_commit", fields),
                lambda r, e, rid=rid: answers.append((rid, r, e)),
            )
        peers.send(Send(99, "nobody", "repl_commit", {}), lambda r, e: answers.append((99, r, e)))
        assert answers == [], "no answer inside the caller's loop step"
        assert len(asyncio.all_tasks()) - before <= 1, "one task: the peer channel's"
        for _ in range(200):
            if len(answers) == 22:
                break
            await asyncio.sleep(0.05)
        peers.close()
    assert sorted(rid for rid, _r, _e in answers) == [*range(21), 99], "each answered once"
    assert {(r, e) for _rid, r, e in answers} == {(None, "connection")}


def test_the_transport_times_out_only_long_after_the_cores_deadline() -> None:
    """Issue 40: whether a peer answered in time is the core's to decide, at each message's
    deadline (member_timeout plus its bytes at the floor rate, adamps/core/replication/
    deadlines.py). The transport's timeouts (the channel's data plane and its HTTP client) are
    a safety net of SAFETY member timeouts, so its "connection" never comes first."""
    from adamps.server.replication.peers import SAFETY

    assert SAFETY >= 2
    keys = PeerKeys("a", None, lambda: None, lambda _s: True)
    peers = Peers("token", 2.0, keys)
    peers.addresses["b"] = "127.0.0.1:1"
    ch = peers.channel("b")
    assert ch.timeout == SAFETY * 2.0
    assert peers.rpc("b").timeout.total == SAFETY * 2.0


async def test_a_replys_answers_are_handed_out_inside_one_batch() -> None:
    """Issue 36: the answers to one reply of a peer (a frame of many buckets' messages) reach
    the core as one event (Peers.batch: the shell's Carrier.batch), each once, in order; a
    whole request that failed fails each of its messages the same way."""
    import contextlib

    keys = PeerKeys("a", None, lambda: None, lambda _s: True)
    peers = Peers("token", 2.0, keys)
    events: list[Any] = []

    @contextlib.contextmanager
    def batch() -> Any:
        events.append("enter")
        yield
        events.append("exit")

    peers.batch = batch
    peers.addresses["b"] = "127.0.0.1:1"
    ch = peers.channel("b")
    replies: list[Any] = [
        {"results": [{"ok": {"seq": 1}}, {"error": {"code": "stale_epoch", "message": "old"}}]},
        ConnectionError("gone"),
    ]

    async def send(msg: dict[str, Any]) -> dict[str, Any]:
        await asyncio.sleep(0)
        r = replies.pop(0)
        if isinstance(r, BaseException):
            raise r
        assert len(msg["items"]) == len(r["results"])
        return r

    ch._send = send  # type: ignore[method-assign]
    for rid in (1, 2):
        peers.send(
            Send(rid, "b", "repl_commit", {"bucket": rid}),
            lambda r, e, rid=rid: events.append((rid, r, e)),
        )
    for _ in range(20):
        await asyncio.sleep(0)
    peers.send(Send(3, "b", "repl_commit", {"bucket": 3}), lambda r, e: events.append((3, r, e)))
    for _ in range(20):
        await asyncio.sleep(0)
    assert events == [
        "enter", (1, {"seq": 1}, None), (2, None, "stale_epoch"), "exit",
        "enter", (3, None, "connection"), "exit",
    ]  # fmt: skip
