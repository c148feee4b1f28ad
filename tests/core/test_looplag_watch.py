"""The loop-lag probe's debugging aid (``ADAMPS_LOOP_STACKS``, adamps/wire/looplag.py): a hold
of the loop is logged with how long it lasted and every thread's stack, the holder's included."""

from __future__ import annotations

import asyncio
import logging
import re
import time

import pytest
from prometheus_client import CollectorRegistry

from adamps.wire import looplag


def hold_the_loop_here() -> None:
    time.sleep(0.3)


async def _probe(hold, caplog: pytest.LogCaptureFixture) -> list[str]:
    lag = looplag.LoopLag(CollectorRegistry())
    lag.start()
    await asyncio.sleep(0.1)
    hold()
    await asyncio.sleep(0.1)
    await lag.stop()
    return [r.getMessage() for r in caplog.records if "event loop held" in r.getMessage()]


def test_a_hold_is_logged_with_its_length_and_the_holders_stack(monkeypatch, caplog) -> None:
    monkeypatch.setenv("ADAMPS_LOOP_STACKS", "0.1")
    monkeypatch.setattr(looplag, "PERIOD", 0.01)
    caplog.set_level(logging.WARNING, "adamps.wire.looplag")
    got = asyncio.run(_probe(hold_the_loop_here, caplog))
    assert got, "no hold logged"
    held = float(re.search(r"held ([\d.]+) s", got[0]).group(1))
    assert held >= 0.1, got[0][:200]  # the length seen, not re-read after the loop woke
    loop_stack = got[0].split("(the loop):", 1)[1]
    assert "hold_the_loop_here" in loop_stack.split("\nthread ", 1)[0]
