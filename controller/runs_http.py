"""The controllers' run endpoints (issue 25) and who may call what.

- ``POST /runs`` (operator): creates a run; the reply shows its token, once. Only the token's
  hash enters the Raft entry.
- ``GET /runs``, ``GET /runs/{name}``: the runs as shown (no token, no hash), open like
  ``/routing``.
- ``DELETE /runs/{name}`` (operator): deletes the run, its layout tensors, and (through the
  servers, which learn it) its shards in memory and in LMDB.
- ``GET /auth/runs`` (operator: the servers call it with the cluster token): each run's token
  hash and quotas, the recent deletions.
- ``POST /runs/{name}/usage`` (operator: a server, before it creates a tensor or table of a run
  with size quotas): records what it holds per copy; refused past the run's quotas, summed
  across the cluster (issue 39).

Who calls: the cluster token is the operator; a run's token (looked up by its hash in the
applied state) may call only the writes that allow it (`Forwarder.write(runs_allowed=True)`:
``POST /layout`` for its namespace and ``POST /progress`` for its own replicas), and gets 403
naming its run on every other write (declare-lost, drain, run create, ...).
"""

from __future__ import annotations

import hmac
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web

from adamps import runs
from adamps.wire import web as aweb
from adamps.wire.protocol import ProtocolError, only_fields
from controller.raft_node import ok_or_raise

#: who made a request: set by `RunsApi.authenticate` for the handlers
PRINCIPAL_KEY = web.RequestKey("principal", runs.Principal)


class RunsApi:
    """Run handlers and the token check of a controller's writes."""

    def __init__(self, service: Any, applied: Callable[[], None]) -> None:
        #: the ControllerService (its cluster, forwarder, commit and config)
        self.svc = service
        #: raises unavailable until this controller applied the state (reads wait for it)
        self.applied = applied

    # -- who calls ----------------------------------------------------------------------------

    def principal_of(self, request: web.Request) -> runs.Principal:
        """The operator (cluster token) or a run (its token's hash is in the table); else 401."""
        header = request.headers.get("Authorization", "")
        scheme, _, given = header.partition(" ")
        given = given.strip()
        if scheme.lower() == "bearer" and given:
            raw = given.encode("utf-8", "surrogateescape")
            if hmac.compare_digest(raw, self.svc.cfg.token.encode()):
                return runs.Principal()
            digest = runs.token_hash(given)
            name = self.svc.cluster.read(
                lambda m: next(
                    (n for n, r in m.runs_table().items() if r["token_hash"] == digest), None
                )
            )
            if name is not None:
                return runs.Principal(name)
        aweb.check_token(request)  # raises the usual 401 (missing or wrong token)
        return runs.Principal()  # not reached

    def authenticate(self, request: web.Request, runs_allowed: bool) -> None:
        who = self.principal_of(request)
        if who.run is not None and not runs_allowed:
            raise ProtocolError(
                "forbidden",
                f"run {who.run!r}'s token may not call {request.method} {request.path}: it is "
                "an operator's call (the cluster token)",
                run=who.run,
            )
        request[PRINCIPAL_KEY] = who

    # -- handlers -----------------------------------------------------------------------------

    async def h_create(self, request: web.Request) -> web.Response:
        async def run() -> dict[str, Any]:
            body = await aweb.read_json(request)
            only_fields(body, f"POST {request.path}", ("name", "quotas", "consistency"))
            try:
                name = runs.check_name(body.get("name"))
                quotas = runs.check_quotas(body.get("quotas"))
                consistency = runs.check_consistency(body.get("consistency"))
            except runs.RunError as exc:
                raise ProtocolError("bad_request", str(exc)) from None
            token = runs.new_token(name)
            fields = {
                "token_hash": runs.token_hash(token),
                "quotas": quotas,
                "consistency": consistency,
            }
            res = ok_or_raise(
                await self.svc.commit("write_tenancy", "create", name, fields, time.time())
            )
            # The one time the token is shown: nobody, the controllers included, can show it later.
            return {**res, "token": token}

        return await self.svc.forwarder.write(request, run)

    async def h_delete(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]

        async def run() -> dict[str, Any]:
            return ok_or_raise(
                await self.svc.commit("write_tenancy", "delete", name, {}, time.time())
            )

        return await self.svc.forwarder.write(request, run)

    async def h_usage(self, request: web.Request) -> web.Response:
        """A server asks to create `name` at `cost` for run `{name}` (issue 39): refused when
        the run's total across the cluster would pass a size quota. A name already recorded
        at that cost answers at once, without a Raft entry (the client creates on every
        server: only the first asks for one)."""
        run = request.match_info["name"]

        async def go() -> dict[str, Any]:
            body = await aweb.read_json(request)
            only_fields(body, f"POST {request.path}", ("name", "cost"))
            name, cost = body.get("name"), body.get("cost")
            same = self.svc.cluster.read(
                lambda m: (m.runs_table().get(run) or {}).get("usage", {}).get(name) == cost
            )
            if same and cost is not None:
                return {"ok": True, "run": run, "name": name, "recorded": False}
            fields = {"name": name, "cost": cost}
            return ok_or_raise(
                await self.svc.commit("write_tenancy", "usage", run, fields, time.time())
            )

        return await self.svc.forwarder.write(request, go)

    async def h_list(self, request: web.Request) -> web.Response:
        self.applied()
        listed = self.svc.cluster.read(
            lambda m: {
                "runs": m.run_views(),
                "runs_version": m.runs_version,
            }
        )
        return aweb.json_response(listed)

    async def h_show(self, request: web.Request) -> web.Response:
        self.applied()
        name = request.match_info["name"]
        view = self.svc.cluster.read(lambda m: m.run_view(name))
        if view is None:
            raise ProtocolError("not_found", f"no run {name!r}")
        return aweb.json_response(view)

    async def h_auth(self, request: web.Request) -> web.Response:
        self.authenticate(request, runs_allowed=False)  # a run's token: 403; unknown: 401
        self.applied()
        return aweb.json_response(self.svc.cluster.read(lambda m: m.runs_auth()))

    async def set_run_layout(
        self, run: str, layout: dict[str, Any], operator: bool = False
    ) -> dict[str, Any]:
        """A run's replica 0 sets its part of the layout (POST /layout with a run's token, or
        with the cluster token and ``"run"``: then also a run without a record, whose names
        carry its namespace all the same)."""
        fields = {"layout": layout, "operator": operator}
        return ok_or_raise(
            await self.svc.commit("write_tenancy", "layout", run, fields, time.time())
        )

    def check_progress(self, request: web.Request, replica: str) -> None:
        """A run's token reports progress only for its own replicas ("<run>/<replica>")."""
        who = request.get(PRINCIPAL_KEY)
        if who is not None and who.run is not None and not replica.startswith(f"{who.run}/"):
            raise ProtocolError(
                "forbidden",
                f"run {who.run!r}'s token reports progress only as '{who.run}/<replica>', "
                f"not {replica!r}",
                namespace=f"{who.run}/",
            )

    def routes(self, r: web.UrlDispatcher) -> None:
        r.add_post("/runs", self.h_create)
        r.add_get("/runs", self.h_list)
        r.add_get("/runs/{name}", self.h_show)
        r.add_delete("/runs/{name}", self.h_delete)
        r.add_post("/runs/{name}/usage", self.h_usage)
        r.add_get("/auth/runs", self.h_auth)
