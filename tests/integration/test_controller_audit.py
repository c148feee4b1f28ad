"""Issue 28, item 7: refused admin operations are logged and counted, by endpoint and reason
(adamps_controller_refused_total), on one in-process controller on loopback."""

from __future__ import annotations

import logging
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_controller_hardening import Ctl, start_controller  # noqa: E402


@pytest.fixture
async def ctl(tmp_path: Path) -> AsyncIterator[Ctl]:
    c, runner = await start_controller(tmp_path)
    try:
        yield c
    finally:
        await c.session.close()
        await runner.cleanup()


def refused(c: Ctl, endpoint: str, reason: str) -> float:
    v = c.service.registry.get_sample_value(
        "adamps_controller_refused_total", {"endpoint": endpoint, "reason": reason}
    )
    return v or 0.0


@pytest.mark.parametrize(
    "path, headers, endpoint, status, reason",
    [
        ("/buckets/0/declare-lost", {"Authorization": ""}, "declare-lost", 401, "unauthorized"),
        ("/buckets/0/declare-lost", {"Authorization": "Bearer guess"}, "declare-lost", 401,
         "unauthorized"),
        ("/buckets/0/declare-lost", {}, "declare-lost", 409, None),  # nothing to declare lost
        ("/buckets/99999/declare-lost", {}, "declare-lost", 404, "unknown_bucket"),
        ("/buckets/0/nope", {}, "unknown", 404, "not_found"),
        ("/servers/s1/drain", {"Authorization": "Bearer guess"}, "drain", 401, "unauthorized"),
        ("/rebalance", {"Authorization": ""}, "rebalance", 401, "unauthorized"),
    ],
)  # fmt: skip
async def test_refused_admin_operations_are_logged_and_counted(
    ctl: Ctl, caplog: pytest.LogCaptureFixture, path, headers, endpoint, status, reason
) -> None:
    caplog.set_level(logging.WARNING, logger="controller.forwarding")
    got, body = await ctl.call("POST", path, {}, headers=headers)
    assert 400 <= got < 500, body
    if status != 409:
        assert got == status, body
    code = body["error"]["code"]
    assert reason is None or code == reason
    assert refused(ctl, endpoint, code) == 1.0
    lines = [r.getMessage() for r in caplog.records if r.name == "controller.forwarding"]
    assert any("refused POST " + path in m and code in m for m in lines), lines


async def test_a_granted_operation_is_not_counted_as_refused(ctl: Ctl) -> None:
    status, body = await ctl.call("POST", "/rebalance", {})
    assert status == 200, body
    samples = [
        s
        for metric in ctl.service.registry.collect()
        if metric.name == "adamps_controller_refused"
        for s in metric.samples
        if s.name.endswith("_total")
    ]
    assert samples == []


async def test_refused_server_calls_are_all_counted_and_logged_once_per_10_s(
    ctl: Ctl, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="controller.forwarding")
    for _ in range(3):  # a server nobody registered keeps heartbeating
        status, body = await ctl.call("POST", "/servers/ghost/heartbeat", {"epochs": {}})
        assert 400 <= status < 500, body
    code = body["error"]["code"]
    assert refused(ctl, "heartbeat", code) == 3.0
    lines = [r.getMessage() for r in caplog.records if "heartbeat" in r.getMessage()]
    assert len(lines) == 1, lines
