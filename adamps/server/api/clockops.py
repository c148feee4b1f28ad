"""The parameter server's ``clock`` op (issue 25): runs' step clocks (adamps/core/stepclock.py)
and the wait that enforces their consistency mode.

    {op: "clock", v, run, replica, mode, step, phase?, join?, expect?, wait?}
      -> {step, staleness, mode}           (phase "pushed": the fetch for step+1 may go;
                                            phase "fetched": step may be computed)
      -> 503 unavailable {waiting_for: [replicas]}        (not within `wait`: ask again)
      -> 409 conflict naming both modes                   (the live run has another mode)

A replica sends it to every server after each step's push is acknowledged, then fetches. The
server holds the answer until the mode's condition holds, at most ``wait`` seconds (bounded by
the server's ``clock_wait``), re-checking as clocks arrive and as leases lapse. Clocks are
coordination, not model state: they live in memory, are neither replicated nor persisted (a
restarted server learns them again from the next reports; until then it holds nobody back).
"""

from __future__ import annotations

import asyncio
import re
import time
from typing import Any

from prometheus_client import CollectorRegistry, Gauge

from adamps.core.stepclock import ModeConflict, RunClocks, parse_mode
from adamps.wire import protocol
from adamps.wire.protocol import ProtocolError

NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
MAX_RUNS = 1024
MAX_EXPECT = 1024


class ClockOps:
    """Runs' clocks on one server; touched only by the event loop."""

    def __init__(self, lease: float, max_wait: float, registry: CollectorRegistry) -> None:
        self.lease = lease
        self.max_wait = max_wait
        self.runs: dict[str, RunClocks] = {}
        self._changed = asyncio.Event()  #: set (and replaced) whenever a clock moves
        self.staleness = Gauge(
            "adamps_ps_replica_staleness_steps",
            "steps the replica was ahead of the slowest live replica of its run at its last "
            "released fetch (ssp:S keeps it <= S, sync 0)",
            ["run", "replica"],
            registry=registry,
        )
        self.max_staleness = Gauge(
            "adamps_ps_run_max_staleness_steps",
            "the largest staleness of any fetch released in the run so far",
            ["run"],
            registry=registry,
        )

    def _name(self, msg: dict[str, Any], key: str) -> str:
        v = protocol.require(msg, key, str)
        if not NAME.fullmatch(v):
            raise ProtocolError(
                "bad_request", f"{key} must be 1-64 letters, digits, '_', '.', '-', got {v!r}"
            )
        return v

    async def op_clock(self, msg: dict[str, Any]) -> dict[str, Any]:
        run, replica = self._name(msg, "run"), self._name(msg, "replica")
        try:
            mode = parse_mode(protocol.require(msg, "mode", str))
        except ValueError as exc:
            raise ProtocolError("bad_request", str(exc)) from None
        step = protocol.require(msg, "step", int)
        if not 0 <= step < 1 << 62:
            raise ProtocolError("bad_request", f"step must be in [0, 2^62), got {step}")
        phase = protocol.require(msg, "phase", str, "pushed")
        if phase not in ("pushed", "fetched"):
            raise ProtocolError(
                "bad_request", f"phase must be 'pushed' or 'fetched', got {phase!r}"
            )
        ticks = 2 * step - (phase == "fetched")
        if ticks < 0:
            raise ProtocolError("bad_request", "phase 'fetched' needs step >= 1")
        join = protocol.require(msg, "join", bool, False)
        expect = protocol.require(msg, "expect", list, [])
        if len(expect) > MAX_EXPECT or not all(
            isinstance(x, str) and NAME.fullmatch(x) for x in expect
        ):
            raise ProtocolError("bad_request", f"expect must be up to {MAX_EXPECT} replica names")
        wait = protocol.require(msg, "wait", float, self.max_wait)
        if not 0 <= wait <= 3600:
            raise ProtocolError("bad_request", f"wait must be in [0, 3600] seconds, got {wait}")
        now = time.monotonic()
        clocks = self.runs.get(run)
        if clocks is None:
            if len(self.runs) >= MAX_RUNS:
                raise ProtocolError("too_large", f"this server keeps {MAX_RUNS} runs' clocks")
            clocks = self.runs[run] = RunClocks(mode, self.lease)
        try:
            clocks.declare(mode, now, expect)
        except ModeConflict as exc:
            raise ProtocolError("conflict", f"run {run!r}: {exc}", mode=str(clocks.mode)) from None
        if join:
            clocks.join(replica, now)
        else:
            clocks.report(replica, ticks, now)
            self._wake()
        clock = clocks.replicas[replica].ticks // 2
        deadline = now + min(wait, self.max_wait)
        while blocking := clocks.blocking(replica, time.monotonic()):
            left = deadline - time.monotonic()
            if left <= 0:
                raise ProtocolError(
                    "unavailable",
                    f"run {run!r} ({clocks.mode}): step {clock + 1} of {replica} waits for "
                    f"{blocking}; ask again",
                    waiting_for=blocking,
                )
            changed = self._changed
            # re-checked on every report, and at least every 0.1 s for leases that lapse
            try:
                await asyncio.wait_for(changed.wait(), timeout=min(left, 0.1))
            except TimeoutError:
                pass
        staleness = clocks.release(replica, time.monotonic())
        self.staleness.labels(run, replica).set(staleness)
        self.max_staleness.labels(run).set(clocks.max_staleness)
        return {"step": clock, "staleness": staleness, "mode": str(clocks.mode)}

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def status(self) -> dict[str, Any]:
        now = time.monotonic()
        return {
            run: {
                "mode": str(c.mode),
                "max_staleness": c.max_staleness,
                "replicas": {
                    n: {"ticks": r.ticks, "staleness": r.staleness, "live": now - r.seen <= c.lease}
                    for n, r in c.replicas.items()
                },
            }
            for run, c in self.runs.items()
        }
