"""The client layer's pure parts: the one retry policy (adamps/client/retry.py), the request builder
(adamps/client/rpc.py) and the controller client's core (which controller to ask, what ends a round)."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from adamps.client import retry
from adamps.client.controller import Call, ControllerOps, ControllerRing, retryable
from adamps.client.retry import RetryPolicy
from adamps.client.rpc import RpcError, json_request, read_reply, rpc_request
from adamps.wire import protocol

pytestmark = pytest.mark.timeout(30)


def flaky(fail: int, exc: type[BaseException] = ConnectionError):
    """attempt(n) failing with `exc` for the first `fail` attempts; records the attempt numbers."""
    seen: list[int] = []

    def attempt(n: int) -> int:
        seen.append(n)
        if n <= fail:
            raise exc(f"attempt {n}")
        return n

    return attempt, seen


def test_retries_until_success_and_counts_attempts() -> None:
    attempt, seen = flaky(3)
    retried: list[int] = []
    result = retry.call(
        RetryPolicy(5.0), attempt, retryable, on_retry=lambda _e, n: retried.append(n)
    )
    assert result == 4 and seen == [1, 2, 3, 4] and retried == [1, 2, 3]


def test_an_error_that_is_an_answer_is_raised_at_once() -> None:
    attempt, seen = flaky(3, exc=ValueError)
    with pytest.raises(ValueError, match="attempt 1"):
        retry.call(RetryPolicy(5.0), attempt, retryable)
    assert seen == [1]


def test_the_last_error_is_raised_at_the_deadline_and_waits_stay_within_the_cap() -> None:
    attempt, seen = flaky(10_000)
    t0 = time.monotonic()
    with pytest.raises(ConnectionError):
        retry.call(RetryPolicy(0.6, first=0.05, cap=0.1), attempt, retryable)
    took = time.monotonic() - t0
    # No attempt starts after the deadline; with waits of at most 0.1 s, many attempts fit.
    assert took < 0.6 + 0.2 and len(seen) >= 6


def test_give_up_ends_the_retries() -> None:
    attempt, seen = flaky(10_000)
    with pytest.raises(ConnectionError):
        retry.call(RetryPolicy(30.0), attempt, retryable, give_up=lambda: len(seen) >= 2)
    assert seen == [1, 2]


def test_a_first_attempt_that_succeeds_costs_no_retry_state(monkeypatch) -> None:
    """The common case runs without tenacity (issue 27: its state cost 0.1 ms a push); a
    failure hands the rest of the same schedule to it."""
    import tenacity

    def no(*_a: object, **_k: object) -> None:
        raise AssertionError("tenacity was used for a first attempt that succeeded")

    monkeypatch.setattr(tenacity, "Retrying", no)
    assert retry.call(RetryPolicy(5.0), lambda n: n * 10, retryable) == 10
    attempt, seen = flaky(10_000)
    with pytest.raises(ConnectionError, match="attempt 1"):  # give_up before any retry
        retry.call(RetryPolicy(30.0), attempt, retryable, give_up=lambda: True)
    assert seen == [1]


def test_async_retries_share_the_policy() -> None:
    attempt, seen = flaky(2, exc=TimeoutError)

    async def aattempt(n: int) -> int:
        return attempt(n)

    assert asyncio.run(retry.acall(RetryPolicy(5.0), aattempt, retryable)) == 3
    assert seen == [1, 2, 3]


def test_an_async_first_attempt_that_succeeds_costs_no_retry_state(monkeypatch) -> None:
    """The same on the event loop (issue 36: a server's heartbeat every second built tenacity's
    machinery for nothing); a failure hands the rest of the same schedule to it, and a refused
    error or give_up ends at the first attempt."""
    import tenacity

    def no(*_a: object, **_k: object) -> None:
        raise AssertionError("tenacity was used for a first attempt that succeeded")

    async def ten(n: int) -> int:
        return n * 10

    monkeypatch.setattr(tenacity, "AsyncRetrying", no)
    assert asyncio.run(retry.acall(RetryPolicy(5.0), ten, retryable)) == 10
    attempt, seen = flaky(10_000)

    async def aattempt(n: int) -> int:
        return attempt(n)

    with pytest.raises(ConnectionError, match="attempt 1"):
        asyncio.run(retry.acall(RetryPolicy(30.0), aattempt, retryable, give_up=lambda: True))
    assert seen == [1]
    monkeypatch.undo()
    attempt, seen = flaky(2, exc=TimeoutError)
    retried: list[int] = []
    got = asyncio.run(
        retry.acall(RetryPolicy(5.0), aattempt, retryable, on_retry=lambda e, n: retried.append(n))
    )
    assert got == 3 and seen == [1, 2, 3] and retried == [1, 2]


def test_requests_are_built_once_for_both_transports() -> None:
    req = rpc_request("pull", shards=["a/0"])
    assert req.method == "POST" and req.path == "/rpc"
    assert protocol.decode(req.body)["shards"] == ["a/0"]
    post = json_request("POST", "/layout", {"layout": 1})
    assert json.loads(post.body) == {"layout": 1} and read_reply(post, 200, b"") is None
    assert json_request("GET", "/routing").body is None
    error = b'{"error": {"code": "no_quorum", "message": "election"}}'
    with pytest.raises(RpcError) as info:
        read_reply(post, 503, error)
    assert info.value.code == "no_quorum" and info.value.http_status == 503


class Recorder(ControllerOps):
    """Runs nothing: shows the call each operation makes."""

    def _run(self, call: Call) -> Call:
        return call


def test_operations_build_the_documented_requests() -> None:
    ops = Recorder()
    hb = ops.heartbeat("ps0", 7, {3: [2, 10]})
    assert (hb.request.method, hb.request.path) == ("POST", "/servers/ps0/heartbeat")
    assert json.loads(hb.request.body) == {"known_version": 7, "reports": {"3": [2, 10]}}
    reply, asked_at = hb.then({"ok": True})
    assert reply == {"ok": True} and asked_at <= time.monotonic()
    assert ops.progress(2).request.path == "/progress?epoch=2"
    layout = ops.layout()
    assert layout.settle(RpcError("not_found", "no layout")) is None
    with pytest.raises(RpcError):
        ops.routing().settle(RpcError("not_found", "x"))


def test_a_round_asks_the_last_controller_that_answered_first() -> None:
    ring = ControllerRing(3)
    r = ring.round()
    asked = []
    for i in r:
        asked.append(i)
        with r.asking(i):
            if i < 2:
                raise RpcError("no_quorum", "election")
            break
    assert asked == [0, 1, 2] and ring.first == 2
    assert list(ring.round()) == [2, 0, 1]


def test_reads_ask_for_the_log_index_of_the_clients_own_writes() -> None:
    """A write's answer names the Raft log index it was applied at; every later read asks for a
    state at least that far (docs/protocol-controller.md, "Transport"), so the client reads its
    own writes through any controller, whichever its calls moved to."""
    ops = Recorder()
    ops.ring = ControllerRing(3)
    assert ops.progress(1).request.extra_headers == ()  # nothing written yet: any state will do
    ops.report_progress(1, "r0", 0.5).then({"ok": True, "applied_index": 41})
    ops.delete_run("old").then({"deleted": "old", "applied_index": 40})  # an older answer
    ops.drain("ps1").then({"ok": True})  # an answer without one (an older controller)
    for read in (ops.progress(1), ops.routing(), ops.layout(), ops.runs()):
        assert read.request.extra_headers == ((protocol.MIN_APPLIED_HEADER, "41"),)
    for bad in (True, -1, "42", None):
        ops.ring.wrote({"applied_index": bad})
    assert ops.ring.applied == 41
    assert ops.heartbeat("ps0", 7).request.extra_headers == ()  # writes carry none


def test_a_round_without_an_answer_raises_the_last_failure_and_an_answer_is_not_retried() -> None:
    ring = ControllerRing(2)
    r = ring.round()
    for i in r:
        with r.asking(i):
            raise ConnectionError(f"controller {i} down")
    assert str(r.failed()) == "controller 1 down" and ring.first == 0
    r = ring.round()
    with pytest.raises(RpcError), r.asking(1):
        raise RpcError("stale_epoch", "old")
    assert ring.first == 1  # it answered: ask it first next time
