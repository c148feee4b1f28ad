"""The coordinator's HTTP face: the trainers' two calls, and the shared /healthz, /status,
/metrics (docs/protocol-coordinator.md).

    GET  /sandblaster/config   what a trainer needs: model, data source, tensors, layout
    POST /sandblaster/work     {"trainer", "done": [[k, j, pid], ...]} -> a portion, wait or stop

Both require the cluster token. Bodies are small JSON (a portion is a few numbers): what the
coordinator exchanges with a trainer does not grow with the model.
"""

from __future__ import annotations

import re
from typing import Any

from aiohttp import web

from adamps.wire import web as aweb
from adamps.wire.protocol import ProtocolError
from coordinator.engine import Engine

#: portions a trainer may report in one call at most
MAX_DONE = 4096
_TRAINER_RE = re.compile(r"[A-Za-z0-9_.:\-]{1,128}")  # fullmatch: "$" lets a final "\n" in


def make_app(engine: Engine, registry: Any) -> web.Application:
    cfg = engine.cfg
    app = aweb.make_app(
        registry=registry,
        token=cfg.token,
        max_body=cfg.max_body,
        status=lambda: {"role": "coordinator", **engine.status()},
        limits=cfg.http_limits,
    )

    async def config(request: web.Request) -> web.Response:
        aweb.check_token(request)
        resp = aweb.json_response(engine.config())
        engine.api_bytes += len(resp.body)  # type: ignore[arg-type]
        return resp

    async def work(request: web.Request) -> web.Response:
        aweb.check_token(request)
        body = await aweb.read_json(request)
        trainer = body.get("trainer")
        if not isinstance(trainer, str) or not _TRAINER_RE.fullmatch(trainer):
            raise ProtocolError(
                "bad_request",
                f"field 'trainer' must be 1-128 letters, digits, '_.:-', got {trainer!r}",
            )
        done = body.get("done", [])
        if not isinstance(done, list) or len(done) > MAX_DONE:
            raise ProtocolError("bad_request", f"field 'done' must be a list of at most {MAX_DONE}")
        for item in done:
            if not (
                isinstance(item, list)
                and len(item) == 3
                and all(isinstance(v, int) and not isinstance(v, bool) for v in item)
            ):
                raise ProtocolError(
                    "bad_request",
                    f"each 'done' item must be [iteration, trial, portion], got {item!r}",
                )
        resp = aweb.json_response(engine.work(trainer, done))
        engine.api_bytes += (request.content_length or 0) + len(resp.body)  # type: ignore[arg-type]
        return resp

    app.router.add_get("/sandblaster/config", config)
    app.router.add_post("/sandblaster/work", work)
    return app
