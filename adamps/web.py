"""The aiohttp shell every role's HTTP service is built on.

What it gives every process: ``GET /healthz`` and ``GET /metrics`` (open), ``GET /status`` (JSON),
an error middleware that turns every failure into a JSON body naming the problem (4xx for bad
input, a logged 500 for a bug; the process keeps serving), a bounded request body (also when sent
chunked), and the cluster-token check for mutating calls.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import signal
from collections.abc import Awaitable, Callable, Collection
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry

from adamps import metrics, protocol
from adamps.protocol import ProtocolError

log = logging.getLogger(__name__)

TOKEN_KEY = web.AppKey("token", str)
REGISTRY_KEY = web.AppKey("registry", CollectorRegistry)
STATUS_KEY = web.AppKey("status", object)
RID_KEY = web.RequestKey("rid", str)
MAX_BODY_KEY = web.AppKey("max_body", int)

MSGPACK = "application/msgpack"


def _rid_of(request: web.Request) -> str | None:
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
    except Exception:
        log.exception("unexpected error in %s %s", request.method, request.path)
        return _error(500, "internal", "unexpected server error (logged)", _rid_of(request))


def _error(status: int, code: str, message: str, rid: str | None, **extra: Any) -> web.Response:
    return web.Response(
        status=status,
        body=protocol.error_body(code, message, rid, **extra),
        content_type="application/json",
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
    if not hmac.compare_digest(given.strip().encode(), expected.encode()):
        raise ProtocolError("unauthorized", "wrong cluster token")


async def read_body(request: web.Request) -> bytes:
    """The whole body, bounded by the app's client_max_size (enforced also for chunked bodies)."""
    return await request.read()


async def read_message(request: web.Request, ops: Collection[str]) -> dict[str, Any]:
    """Reads and decodes a msgpack request, checks its envelope; remembers its rid for errors."""
    body = await read_body(request)
    msg = protocol.decode(body)
    if isinstance(msg.get("rid"), str | int):
        request[RID_KEY] = str(msg["rid"])
    protocol.check_message(msg, ops)
    return msg


async def read_json(request: web.Request) -> dict[str, Any]:
    body = await read_body(request)
    if not body:
        return {}
    try:
        obj = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ProtocolError("malformed", f"body is not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise ProtocolError("malformed", "body must be a JSON object")
    return obj


def message_response(msg: dict[str, Any], status: int = 200) -> web.Response:
    return web.Response(status=status, body=protocol.encode(msg), content_type=MSGPACK)


def json_response(obj: Any, status: int = 200) -> web.Response:
    return web.json_response(
        obj, status=status, dumps=lambda o: json.dumps(o, default=_json_default)
    )


def _json_default(o: Any) -> Any:
    if hasattr(o, "tolist"):
        return o.tolist()
    if isinstance(o, set | frozenset):
        return sorted(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


async def _healthz(request: web.Request) -> web.Response:
    return json_response({"ok": True})


async def _metrics(request: web.Request) -> web.Response:
    body, content_type = metrics.exposition(request.app[REGISTRY_KEY])
    return web.Response(body=body, headers={"Content-Type": content_type})


async def _status(request: web.Request) -> web.Response:
    status = request.app[STATUS_KEY]
    if status is None:
        return json_response({})
    result = status()
    if asyncio.iscoroutine(result):
        result = await result
    return json_response(result)


def make_app(
    *,
    registry: CollectorRegistry,
    token: str,
    max_body: int = 64 << 20,
    status: Callable[[], Any] | None = None,
) -> web.Application:
    """An aiohttp app with the shared middleware and the open endpoints installed."""
    if not token:
        raise ValueError("a cluster token is required")
    app = web.Application(middlewares=[error_middleware], client_max_size=max_body)
    app[TOKEN_KEY] = token
    app[REGISTRY_KEY] = registry
    app[STATUS_KEY] = status
    app[MAX_BODY_KEY] = max_body
    app.router.add_get("/healthz", _healthz)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/status", _status)
    return app


async def serve(app: web.Application, host: str, port: int) -> web.AppRunner:
    """Starts `app` on host:port and returns its runner (for in-process tests and run_app)."""
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_address=True)
    await site.start()
    return runner


async def run_app(
    app: web.Application,
    host: str,
    port: int,
    *,
    on_ready: Callable[[], Awaitable[None] | None] | None = None,
) -> None:
    """Serves `app` until SIGTERM or SIGINT, then cleans up (the app's on_cleanup hooks run)."""
    runner = await serve(app, host, port)
    log.info("listening on http://%s:%d", host, port)
    stop = asyncio.Event()
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


def setup_logging(level: str = "INFO", role: str = "adamps") -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format=f"%(asctime)s {role} %(levelname)s %(name)s: %(message)s",
    )
