"""The data server's side of elastic replicas (issue 25): one SliceTable (dataserver/slices.py)
per run, served over HTTP, with the counters that show every example trained in every epoch.

    POST /lease     (token) msgpack {op: "lease", v, run, replica, epochs, epoch_fraction?, seq?}
                    -> {state: "grant"|"wait"|"done", epoch, slice, start, stop, completed,
                        live, lease}
    POST /complete  (token) msgpack {op: "complete", v, run, replica, epoch, slice}
                    -> {counted, completed, live}
    POST /heartbeat (token) msgpack {op: "heartbeat", v, run, replica} -> {completed, live}
    GET  /runs      JSON: per run, its epochs' counters (served, trained, slices_done,
                    reissued), live replicas, slices each holds, completed epoch

A granted slice is streamed with ``POST /stream`` as replica 0 of 1 from ``start`` to ``stop``.
The tables live in this server's memory: trainers of a run use one data server for their
leases (the first of their list), and a restarted server starts the run's leases afresh
(examples already trained are then trained again: at least once still holds).
"""

from __future__ import annotations

import re
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge

from adamps.wire import protocol
from adamps.wire import web as adamps_web
from adamps.wire.protocol import ProtocolError
from dataserver.slices import Grant, SliceTable

RUN_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
MAX_RUNS = 1024  #: run tables one server keeps (a bound on memory from hostile run names)
MAX_EPOCHS = 1 << 20
#: the fields of each op (beside the envelope's): any other is refused, not ignored
FIELDS: dict[str, frozenset[str]] = {
    "lease": frozenset({"run", "replica", "epochs", "epoch_fraction", "seq"}),
    "complete": frozenset({"run", "replica", "epoch", "slice"}),
    "heartbeat": frozenset({"run", "replica"}),
}


class ElasticMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.served = Counter(
            "adamps_dataserver_run_examples_served",
            "examples handed out in leased slices, per run and epoch (a reissued slice counts again)",
            ["run", "epoch"],
            registry=registry,
        )
        self.trained = Counter(
            "adamps_dataserver_run_examples_trained",
            "examples of slices reported trained, per run and epoch (each example once)",
            ["run", "epoch"],
            registry=registry,
        )
        self.reissued = Counter(
            "adamps_dataserver_run_slices_reissued",
            "slices handed out again because their replica's lease lapsed",
            ["run"],
            registry=registry,
        )
        self.live = Gauge(
            "adamps_dataserver_run_live_replicas",
            "replicas of a run heard from within the lease",
            ["run"],
            registry=registry,
        )


class ElasticRuns:
    """The runs' slice tables; touched only by the event loop."""

    def __init__(
        self,
        n_examples: int,
        slice_size: int,
        lease: float,
        registry: CollectorRegistry,
        clock: Any = time.monotonic,
    ) -> None:
        self.n = n_examples
        self.slice_size = slice_size
        self.lease_seconds = lease
        self.clock = clock
        self.m = ElasticMetrics(registry)
        self.tables: dict[str, SliceTable] = {}
        #: who calls (set by the service): None for the cluster token, else the run whose token
        #: it is (issue 25); raises 401 for neither. A run's token leases only its own run.
        self.caller: Callable[[web.Request], Awaitable[str | None]] = _cluster_token_only

    def _ident(self, msg: dict[str, Any]) -> tuple[str, str]:
        run = protocol.require(msg, "run", str)
        if not RUN_NAME.fullmatch(run):
            raise ProtocolError(
                "bad_request", f"run must be 1-64 letters, digits, '_', '.', '-', got {run!r}"
            )
        replica = protocol.require(msg, "replica", str)
        if not RUN_NAME.fullmatch(replica):
            raise ProtocolError(
                "bad_request",
                f"replica must be 1-64 letters, digits, '_', '.', '-', got {replica!r}",
            )
        return run, replica

    def _table(self, run: str) -> SliceTable:
        t = self.tables.get(run)
        if t is None:
            raise ProtocolError("not_found", f"no run {run!r} on this data server (lease first)")
        return t

    def _declare(self, run: str, msg: dict[str, Any]) -> SliceTable:
        epochs = protocol.require(msg, "epochs", int)
        if not 1 <= epochs <= MAX_EPOCHS:
            raise ProtocolError("bad_request", f"epochs must be in [1, {MAX_EPOCHS}], got {epochs}")
        fraction = protocol.require(msg, "epoch_fraction", float, 0.75)
        if not 0 < fraction <= 1:
            raise ProtocolError("bad_request", f"epoch_fraction must be in (0, 1], got {fraction}")
        t = self.tables.get(run)
        if t is None:
            if len(self.tables) >= MAX_RUNS:
                raise ProtocolError(
                    "too_large", f"this data server keeps {MAX_RUNS} runs; no room for {run!r}"
                )
            t = self.tables[run] = SliceTable(
                self.n, self.slice_size, self.lease_seconds, epochs, fraction
            )
        elif (t.epochs, t.epoch_fraction) != (epochs, fraction):
            raise ProtocolError(
                "conflict",
                f"run {run!r} has epochs={t.epochs}, epoch_fraction={t.epoch_fraction}; "
                f"this replica asks for epochs={epochs}, epoch_fraction={fraction}",
            )
        return t

    def _answer(self, run: str, t: SliceTable, now: float, **extra: Any) -> dict[str, Any]:
        live = t.live(now)
        self.m.live.labels(run).set(len(live))
        return {"completed": t.completed(), "live": len(live), "lease": t.lease, **extra}

    def lease(self, msg: dict[str, Any]) -> dict[str, Any]:
        run, replica = self._ident(msg)
        t = self._declare(run, msg)
        now = self.clock()
        seq = protocol.require(msg, "seq", int, None)
        handed = sum(c["served"] for c in t.counters().values())
        reissued = sum(c["reissued"] for c in t.counters().values())
        g = t.acquire(replica, now, seq)
        if g is None:
            state = "done" if t.finished() else "wait"
            return self._answer(run, t, now, state=state)
        if sum(c["served"] for c in t.counters().values()) > handed:  # not a retry's answer
            self.m.served.labels(run, str(g.epoch)).inc(g.stop - g.start)
            self.m.reissued.labels(run).inc(
                sum(c["reissued"] for c in t.counters().values()) - reissued
            )
        return self._answer(run, t, now, state="grant", **_grant(g))

    def complete(self, msg: dict[str, Any]) -> dict[str, Any]:
        run, replica = self._ident(msg)
        t = self._table(run)
        epoch = protocol.require(msg, "epoch", int)
        slice_ = protocol.require(msg, "slice", int)
        now = self.clock()
        try:
            counted = t.complete(replica, epoch, slice_, now)
        except ValueError as exc:
            raise ProtocolError("bad_request", str(exc)) from None
        if counted:
            g = t.span(epoch, slice_)
            self.m.trained.labels(run, str(epoch)).inc(g.stop - g.start)
        return self._answer(run, t, now, counted=counted)

    def heartbeat(self, msg: dict[str, Any]) -> dict[str, Any]:
        run, replica = self._ident(msg)
        t = self._table(run)
        now = self.clock()
        t.heartbeat(replica, now)
        return self._answer(run, t, now)

    def status(self) -> dict[str, Any]:
        now = self.clock()
        return {
            run: {
                "epochs": t.epochs,
                "completed": t.completed(),
                "open": t.open,
                "n_examples": t.n,
                "slice_size": t.slice_size,
                "n_slices": t.n_slices,
                "live": t.live(now),
                "held": t.held(),
                "counters": {str(e): c for e, c in t.counters().items()},
            }
            for run, t in self.tables.items()
        }

    # -- HTTP

    def _handler(self, op: str, fn: Any) -> Any:
        async def handle(request: web.Request) -> web.Response:
            caller = await self.caller(request)
            msg = await adamps_web.read_message(request, {op})
            protocol.only_fields(msg, f"op {op!r}", FIELDS[op] | protocol.ENVELOPE, op=op)
            if caller is not None and msg.get("run") != caller:
                raise ProtocolError(
                    "forbidden",
                    f"run {caller!r}'s token leases only run {caller!r}'s slices, "
                    f"not run {msg.get('run')!r}'s",
                )
            return adamps_web.message_response(fn(msg))

        return handle

    async def _runs(self, request: web.Request) -> web.Response:
        return adamps_web.json_response(self.status())

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/lease", self._handler("lease", self.lease))
        app.router.add_post("/complete", self._handler("complete", self.complete))
        app.router.add_post("/heartbeat", self._handler("heartbeat", self.heartbeat))
        app.router.add_get("/runs", self._runs)


async def _cluster_token_only(request: web.Request) -> None:
    adamps_web.check_token(request)


def _grant(g: Grant) -> dict[str, int]:
    return {"epoch": g.epoch, "slice": g.slice, "start": g.start, "stop": g.stop}
