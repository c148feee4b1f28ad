"""The aiohttp shell every role's HTTP service is built on.

What it gives every process: ``GET /healthz`` and ``GET /metrics`` (open), ``GET /status`` (JSON),
the event-loop probe (``adamps_event_loop_lag_seconds``, adamps/wire/looplag.py),
an error middleware that turns every failure into a JSON body naming the problem (4xx for bad
input, a logged 500 for a bug; the process keeps serving), a bounded request body (also when sent
chunked), and the cluster-token check for mutating calls.

Connections are bounded too (`HttpLimits`, issue 12): a connection must deliver a complete request
head within `header_timeout` of being accepted, an idle keep-alive connection is closed after
`idle_timeout`, a body must arrive within `body_timeout`, and beyond `max_connections` open
connections the oldest idle one is closed to make room (a flood of idle connections cannot lock
out /healthz). JSON is strict both ways: no NaN/Infinity in or out, nesting bounded.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import resource
import signal
import time
import weakref
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestHandler
from prometheus_client import CollectorRegistry

from adamps import metrics
from adamps.security import tls
from adamps.wire import protocol
from adamps.wire.looplag import LoopLag, thread_names
from adamps.wire.protocol import ProtocolError

log = logging.getLogger(__name__)

TOKEN_KEY = web.AppKey("token", str)
REGISTRY_KEY = web.AppKey("registry", CollectorRegistry)
STATUS_KEY = web.AppKey("status", object)
HEALTH_KEY = web.AppKey("health", object)
RID_KEY = web.RequestKey("rid", str | int)
MAX_BODY_KEY = web.AppKey("max_body", int)
#: the event-loop probe of the app's process (adamps/wire/looplag.py)
LOOP_LAG_KEY = web.AppKey("loop_lag", LoopLag)
_probes: weakref.WeakKeyDictionary[CollectorRegistry, LoopLag] = weakref.WeakKeyDictionary()

LIMITS_KEY = web.AppKey("http_limits", object)

MSGPACK = "application/msgpack"
#: most JSON objects + arrays in one body (a 16 MB body of "[]" would otherwise build 8M lists)
MAX_JSON_CONTAINERS = 1 << 16


@dataclass(frozen=True)
class HttpLimits:
    """Per-connection bounds of an HTTP server (each role's config sets them)."""

    #: seconds from accept to a complete first request head; else the connection is closed
    header_timeout: float = 10.0
    #: seconds a keep-alive connection may wait for its next request
    idle_timeout: float = 30.0
    #: seconds a request body may take to arrive once its head is in
    body_timeout: float = 120.0
    #: open connections; beyond it the oldest idle one is closed (capped at half the fd limit)
    max_connections: int = 1024

    def __post_init__(self) -> None:
        for name in ("header_timeout", "idle_timeout", "body_timeout"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {v!r}")
        if self.max_connections < 1:
            raise ValueError("max_connections must be >= 1")

    def effective_max_connections(self) -> int:
        """max_connections, but never above half the soft file-descriptor limit."""
        soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft == resource.RLIM_INFINITY or soft <= 0:
            return self.max_connections
        return max(1, min(self.max_connections, soft // 2))


def _rid_of(request: web.Request) -> str | int | None:
    return request.get(RID_KEY)


@web.middleware
async def error_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    try:
        return await handler(request)
    except ProtocolError as exc:
        return _error(exc.status, exc.code, exc.message, _rid_of(request), **exc.extra)
    except web.HTTPRequestEntityTooLarge:
        limit = request.app[MAX_BODY_KEY]
        return _error(
            413,
            "too_large",
            f"request body exceeds the limit of {limit} bytes",
            _rid_of(request),
            limit=limit,
        )
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        code = {401: "unauthorized", 404: "not_found", 405: "bad_request", 413: "too_large"}.get(
            exc.status, "bad_request" if exc.status < 500 else "internal"
        )
        return _error(exc.status, code, exc.reason or code, _rid_of(request))
    except asyncio.CancelledError:
        raise
    except ConnectionError as exc:
        # The client went away (mid-body, or before its answer): nobody to answer, nothing
        # wrong here. One line, no traceback (issue 39); the 499 below is never delivered.
        log.warning(
            "client %s went away during %s %s: %s",
            request.remote,
            request.method,
            request.path[:200],
            exc or type(exc).__name__,
        )
        return _error(499, "client_closed", "the client closed the connection", _rid_of(request))
    except Exception:
        log.exception("unexpected error in %s %s", request.method, request.path)
        return _error(500, "internal", "unexpected server error (logged)", _rid_of(request))


def _error(
    status: int, code: str, message: str, rid: str | int | None, **extra: Any
) -> web.Response:
    retry = extra.get("retry_after")
    # HTTP's own form of the hint too (whole seconds), for clients that know only headers.
    headers = (
        {"Retry-After": str(max(1, math.ceil(retry)))}
        if isinstance(retry, int | float) and math.isfinite(retry)
        else None
    )
    return web.Response(
        status=status,
        body=protocol.error_body(code, message, rid, **extra),
        content_type="application/json",
        headers=headers,
    )


def check_token(request: web.Request) -> None:
    """Raises unauthorized unless the request carries `Authorization: Bearer <cluster token>`."""
    expected = request.app[TOKEN_KEY]
    header = request.headers.get("Authorization", "")
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer" or not given:
        raise ProtocolError(
            "unauthorized", "missing cluster token: send 'Authorization: Bearer <token>'"
        )
    try:
        # aiohttp decodes headers as UTF-8 with surrogateescape: any byte sequence round-trips.
        given_bytes = given.strip().encode("utf-8", "surrogateescape")
    except UnicodeError:
        raise ProtocolError("unauthorized", "wrong cluster token") from None
    if not hmac.compare_digest(given_bytes, expected.encode()):
        raise ProtocolError("unauthorized", "wrong cluster token")


#: a request's body once read (read_body): the stream is consumed, later readers get this
BODY_KEY = web.RequestKey("body", bytes)


def too_large(limit: int, got: int | None = None) -> ProtocolError:
    """413 too_large of a body beyond `limit` bytes (`got`: its declared length, if known)."""
    said = f" (Content-Length {got})" if got is not None else ""
    return ProtocolError(
        "too_large", f"request body exceeds the limit of {limit} bytes{said}", limit=limit
    )


async def read_body(request: web.Request) -> bytes:
    """The whole body, bounded by the app's max_body and by the body timeout; read once (a
    second call gets the same bytes).

    aiohttp's request.read() reads a body before it compares its size with the limit: one
    declaring a Content-Length past the limit was read up to the limit (or waited for until
    the body timeout) before its 413, and it raises the stream's buffer to twice the limit
    first. Here a declared length past the limit is refused before a byte is read, and a
    chunked body (no length: HTTP/1.1 names each chunk's size only in the chunk's own header,
    which aiohttp's parser keeps to itself) is refused as soon as what arrived passes the
    limit, holding at most the limit plus one read of the stream's default buffer."""
    got = request.get(BODY_KEY)
    if got is not None:
        return got
    limit = request.app.get(MAX_BODY_KEY) or request.client_max_size
    declared = request.content_length
    if declared is not None and declared > limit:
        raise too_large(limit, declared)
    limits = request.app.get(LIMITS_KEY) or HttpLimits()
    parts: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(limits.body_timeout):
            while chunk := await request.content.readany():
                size += len(chunk)
                if size > limit:
                    raise too_large(limit)
                parts.append(chunk)
    except TimeoutError:
        raise ProtocolError(
            "slow_request", f"the body did not arrive within {limits.body_timeout} s"
        ) from None
    body = parts[0] if len(parts) == 1 else b"".join(parts)
    request[BODY_KEY] = body
    return body


async def read_message(request: web.Request, ops: Collection[str]) -> dict[str, Any]:
    """Reads and decodes a msgpack request, checks its envelope; remembers its rid for errors."""
    body = await read_body(request)
    msg = protocol.decode(body)
    if isinstance(msg.get("rid"), str | int):
        request[RID_KEY] = msg["rid"]  # echoed as sent, as a successful reply does
    protocol.check_message(msg, ops)
    return msg


async def read_json(request: web.Request) -> dict[str, Any]:
    body = await read_body(request)
    if not body:
        return {}
    obj = parse_json(body)
    if not isinstance(obj, dict):
        raise ProtocolError("malformed", "body must be a JSON object")
    return obj


def _reject_constant(name: str) -> Any:
    raise ProtocolError("malformed", f"JSON carries only finite numbers, got {name}")


def _finite_float(text: str) -> float:
    v = float(text)
    if not math.isfinite(v):
        raise ProtocolError("malformed", f"JSON number {text[:40]} is out of range")
    return v


def parse_json(body: bytes) -> Any:
    """Strict JSON: finite numbers only (no NaN, Infinity, 1e999), nesting bounded (the C
    decoder's recursion guard raises RecursionError, a malformed body, not a 500), and at most
    MAX_JSON_CONTAINERS objects and arrays, counted at C speed before parsing (brackets inside
    strings count too: a conservative bound no document of this API comes near)."""
    if isinstance(body, str):
        body = body.encode("utf-8", "surrogateescape")
    containers = body.count(b"{") + body.count(b"[")
    if containers > MAX_JSON_CONTAINERS:
        raise ProtocolError(
            "too_large",
            f"JSON body holds {containers} objects or arrays; the limit is {MAX_JSON_CONTAINERS}",
        )
    try:
        return json.loads(body, parse_constant=_reject_constant, parse_float=_finite_float)
    except ProtocolError:
        raise
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise ProtocolError("malformed", f"body is not valid JSON: {exc}") from None


def message_response(msg: dict[str, Any], status: int = 200) -> web.Response:
    return web.Response(status=status, body=protocol.encode(msg), content_type=MSGPACK)


#: a reply of at least this many bytes is written in pieces of this size (send_message)
STREAM_PIECE = 1 << 20


async def send_message(request: web.Request, msg: dict[str, Any]) -> tuple[web.StreamResponse, int]:
    """Answers `msg` (status 200) and returns the response and its size. A large reply (a pull
    of a big tensor) is not encoded into one buffer and copied twice more on the event loop,
    which held it for a fraction of a second (issue 39): its arrays are written from their own
    memory, a piece of STREAM_PIECE bytes at a time, waiting for the socket between pieces."""
    parts, total = protocol.encode_parts(msg)
    if total < STREAM_PIECE:
        body = b"".join(parts)
        return web.Response(body=body, content_type=MSGPACK), len(body)
    resp = web.StreamResponse()
    resp.content_type = MSGPACK
    resp.content_length = total
    await resp.prepare(request)
    try:
        for part in parts:
            view = memoryview(part).cast("B")
            for i in range(0, len(view), STREAM_PIECE):
                await resp.write(view[i : i + STREAM_PIECE])
        await resp.write_eof()
    except ConnectionError as exc:  # the client went away: nobody to answer
        log.warning("client %s went away during its reply: %s", request.remote, exc)
    return resp, total


def json_response(obj: Any, status: int = 200) -> web.Response:
    """A standard-JSON reply: never NaN/Infinity tokens (issue 12). Inputs are validated, so
    stored state holds none; a non-finite reading in a status (a diverged loss) becomes null."""
    return web.json_response(obj, status=status, dumps=dumps_finite)


def dumps_finite(obj: Any) -> str:
    try:
        return json.dumps(obj, default=_json_default, allow_nan=False)
    except ValueError:
        return json.dumps(_finite(obj), default=_json_default, allow_nan=False)


def _finite(o: Any) -> Any:
    if isinstance(o, float):
        return o if math.isfinite(o) else None
    if isinstance(o, dict):
        return {k: _finite(v) for k, v in o.items()}
    if isinstance(o, list | tuple):
        return [_finite(v) for v in o]
    if hasattr(o, "tolist"):
        return _finite(o.tolist())
    return o


def _json_default(o: Any) -> Any:
    if hasattr(o, "tolist"):
        return o.tolist()
    if isinstance(o, set | frozenset):
        return sorted(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


async def _healthz(request: web.Request) -> web.Response:
    health = request.app[HEALTH_KEY]
    reason = health() if health is not None else None
    if reason is not None:  # serving, but not healthy: the reason for an operator
        return json_response({"ok": False, "reason": reason}, status=503)
    return json_response({"ok": True})


async def _metrics(request: web.Request) -> web.Response:
    body, content_type = metrics.exposition(request.app[REGISTRY_KEY])
    return web.Response(body=body, headers={"Content-Type": content_type})


async def _status(request: web.Request) -> web.Response:
    status = request.app[STATUS_KEY]
    if status is None:
        return json_response({"threads": thread_names()})
    result = status()
    if asyncio.iscoroutine(result):
        result = await result
    if isinstance(result, dict):
        result.setdefault("threads", thread_names())
    return json_response(result)


def make_app(
    *,
    registry: CollectorRegistry,
    token: str,
    max_body: int = 64 << 20,
    status: Callable[[], Any] | None = None,
    limits: HttpLimits | None = None,
    health: Callable[[], str | None] | None = None,
) -> web.Application:
    """An aiohttp app with the shared middleware and the open endpoints installed. `health`:
    why the process is unhealthy (``/healthz`` answers 503 with it), or None."""
    if not token:
        raise ValueError("a cluster token is required")
    app = web.Application(middlewares=[error_middleware], client_max_size=max_body)
    app[TOKEN_KEY] = token
    app[LIMITS_KEY] = limits or HttpLimits()
    app[REGISTRY_KEY] = registry
    app[STATUS_KEY] = status
    app[HEALTH_KEY] = health
    app[MAX_BODY_KEY] = max_body
    app.router.add_get("/healthz", _healthz)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/status", _status)
    probe = _probes.get(registry)
    if probe is None:  # one per registry (an app made twice shares it)
        probe = _probes[registry] = LoopLag(registry)
    app[LOOP_LAG_KEY] = probe

    async def start_probe(_app: web.Application) -> None:
        probe.start()

    async def stop_probe(_app: web.Application) -> None:
        await probe.stop()

    app.on_startup.append(start_probe)
    app.on_cleanup.append(stop_probe)
    return app


class _JsonErrors(RequestHandler):
    """aiohttp's connection handler, answering a request it cannot parse (a negative or doubled
    Content-Length, a bad header line, non-HTTP bytes) with the JSON error body every other
    error has (docs/protocol.md, "Errors"), not aiohttp's text/plain. It still closes the
    connection: the rest of the stream cannot be trusted."""

    def handle_error(
        self,
        request: Any,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        super().handle_error(request, status, exc, message)  # logs; raises if a reply began
        code = "internal" if status >= 500 else "too_large" if status == 413 else "malformed"
        text = " ".join((message or "").split())[:300] or f"HTTP {status}"
        resp = web.Response(
            status=status,
            body=protocol.error_body(code, f"the request is not valid HTTP: {text}"),
            content_type="application/json",
        )
        resp.force_close()
        return resp


class _GuardedServer(web.Server):
    """aiohttp's per-app connection manager, plus the head deadline and the connection cap.

    Installed by `serve` on the runner's server (``__class__`` swap: aiohttp builds the server
    itself inside AppRunner.setup). It is aiohttp's manager hook: every connection passes here.
    """

    _limits: HttpLimits
    _deadlines: dict[Any, asyncio.TimerHandle]
    _cap: int
    _warned: float

    def __call__(self) -> RequestHandler:
        return _JsonErrors(self, loop=self._loop, **self._kwargs)

    def connection_made(self, handler: Any, transport: asyncio.Transport) -> None:
        super().connection_made(handler, transport)
        loop = asyncio.get_running_loop()
        self._deadlines[handler] = loop.call_later(
            self._limits.header_timeout, self._check_head, handler, transport
        )
        open_ = [(h, t) for h, t in self._connections.items() if not t.is_closing()]
        if len(open_) > self._cap:
            # Oldest first among those without a complete request head yet (a slowloris holds
            # its slot that way, issue 28), then among the idle keep-alive ones, else this one.
            others = [
                (h, t)
                for h, t in open_
                if h is not handler and not getattr(h, "_request_in_progress", False)
            ]
            victim = next(
                (ht for ht in others if getattr(ht[0], "_request_count", 1) == 0),
                others[0] if others else (handler, transport),
            )
            if loop.time() - self._warned > 10.0:  # a flood would otherwise flood the log
                self._warned = loop.time()
                log.warning(
                    "%d connections open (limit %d): closing the oldest idle ones",
                    len(open_),
                    self._cap,
                )
            victim[1].close()

    def _check_head(self, handler: Any, transport: asyncio.Transport) -> None:
        self._deadlines.pop(handler, None)
        if getattr(handler, "_request_count", 1) == 0 and not transport.is_closing():
            transport.close()  # no complete request head in time (slowloris or idle)

    def connection_lost(self, handler: Any, exc: BaseException | None = None) -> None:
        timer = self._deadlines.pop(handler, None)
        if timer is not None:
            timer.cancel()
        super().connection_lost(handler, exc)


class _ServerLog:
    """The logger aiohttp's connection handler writes to (``aiohttp.server``), quieter: a request
    aiohttp could not parse (a 10 kB request line, a bad header, non-HTTP bytes) or a
    connection lost under it is the client's problem, answered 400 by aiohttp already. It was
    an ERROR with a traceback per request (issue 39); here it is one warning line, at most one
    per `QUIET_INTERVAL` (the others at debug: a flood must not flood the log). Anything else
    keeps its traceback."""

    #: seconds between two warnings about bad requests (the rest go to debug)
    QUIET_INTERVAL = 10.0

    def __init__(self) -> None:
        self._log = logging.getLogger("aiohttp.server")
        self._warned = -1e9

    def exception(self, msg: str, *args: Any, exc_info: Any = True, **kw: Any) -> None:
        exc = exc_info if isinstance(exc_info, BaseException) else None
        if isinstance(exc, HttpProcessingError | ConnectionError):
            text = str(exc).strip().replace("\n", " ")[:200]
            line = (msg % args if args else msg) + f": {type(exc).__name__}: {text}"
            now = time.monotonic()
            if now - self._warned >= self.QUIET_INTERVAL:
                self._warned = now
                self._log.warning("%s", line)
            else:
                self._log.debug("%s", line)
            return
        self._log.exception(msg, *args, exc_info=exc_info, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._log, name)


#: seconds a stopping process lets requests in flight finish
SHUTDOWN_GRACE = 3.0


async def serve(app: web.Application, host: str, port: int) -> web.AppRunner:
    """Starts `app` on host:port and returns its runner (for in-process tests and run_app)."""
    limits = app.get(LIMITS_KEY) or HttpLimits()
    # A stopping process waits this long for requests in flight (aiohttp's default is 60 s): a
    # push still waiting for its replication round then ends without an answer, which a client
    # treats as an unknown outcome and retries with the same (client, seq).
    runner = web.AppRunner(
        app,
        access_log=None,
        handle_signals=False,
        keepalive_timeout=limits.idle_timeout,
        shutdown_timeout=SHUTDOWN_GRACE,
        logger=_ServerLog(),
    )
    await runner.setup()
    server = runner.server
    assert server is not None
    server.__class__ = _GuardedServer
    server._limits = limits  # type: ignore[attr-defined]
    server._deadlines = {}  # type: ignore[attr-defined]
    server._cap = limits.effective_max_connections()  # type: ignore[attr-defined]
    server._warned = -1e9  # type: ignore[attr-defined]
    site = _Site(runner, host, port, reuse_address=True, handshake_timeout=limits.header_timeout)
    await site.start()
    return runner


class _Site(web.TCPSite):
    """aiohttp's TCP site, with TLS when the process has it on (adamps.security.tls), and a handshake
    deadline: a connection is aiohttp's (and under _GuardedServer's deadlines) only once its
    handshake ended, so the handshake is bounded here, by the same header_timeout."""

    def __init__(self, *args: Any, handshake_timeout: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._tls = tls.listen_kwargs(handshake_timeout)

    async def start(self) -> None:
        await web.BaseSite.start(self)
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            self._runner.server,
            self._host,
            self._port,
            backlog=self._backlog,
            reuse_address=self._reuse_address,
            **self._tls,
        )
        sockets = self._server.sockets
        self._bound_port = sockets[0].getsockname()[1] if sockets else self._port


async def run_app(
    app: web.Application,
    host: str,
    port: int,
    *,
    on_ready: Callable[[], Awaitable[None] | None] | None = None,
    stop: asyncio.Event | None = None,
) -> None:
    """Serves `app` until SIGTERM or SIGINT (or `stop` is set), then cleans up (the app's
    on_cleanup hooks run)."""
    runner = await serve(app, host, port)
    log.info("listening on %s://%s:%d", tls.scheme(), host, port)
    stop = stop if stop is not None else asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        if on_ready is not None:
            result = on_ready()
            if asyncio.iscoroutine(result):
                await result
        await stop.wait()
    finally:
        log.info("shutting down")
        await runner.cleanup()
