"""The controller's HTTP service: its admin API, served by every controller.

Every controller answers reads (routing table, cluster view, layout, progress, lease record) from
its own applied state. Writes are carried out by the Raft leader (``raft_node.py``); a follower
forwards them (``forwarding.py``). The leader's soft state (heartbeat silences, reported
positions) is ``leader.py``; the fields of requests are checked by ``fields.py``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry

from adamps import metrics
from adamps.config import to_dict as config_to_dict
from adamps.core.lease import LeaseTerms
from adamps.security import peer_auth
from adamps.wire import limits
from adamps.wire import web as aweb
from adamps.wire.protocol import ProtocolError
from controller import fields
from controller.ckpt_schedule import CheckpointSchedule
from controller.config import ControllerConfig
from controller.ctl_metrics import ControllerMetrics
from controller.forwarding import BUCKET_OPS, Forwarder
from controller.leader import LeaderDuties
from controller.raft_node import RaftNode, ok_or_raise
from controller.renewals import RenewalRounds
from controller.runs_http import PRINCIPAL_KEY, RunsApi
from controller.server_calls import ServerCalls
from controller.state import ClusterModel, ReplicatedCluster, state_digest

log = logging.getLogger(__name__)

#: most pairwise keys one /servers/{id}/peer-keys request may ask for
MAX_PEER_KEYS = 4096
#: largest training epoch number accepted by /progress
MAX_EPOCH = 1_000_000


class ControllerService:
    """One controller node: the Raft node, the leader loop and the HTTP handlers."""

    def __init__(self, cfg: ControllerConfig, registry: CollectorRegistry | None = None) -> None:
        self.cfg = cfg
        self.registry = registry or metrics.new_registry()
        self.terms = LeaseTerms(cfg.lease_duration, cfg.lease_skew, cfg.lease_margin)
        model = ClusterModel(cfg.n_buckets, self.terms, cfg.replication, cfg.min_servers)
        self.cluster = ReplicatedCluster(model)
        os.makedirs(cfg.data_dir, exist_ok=True)
        self.m = ControllerMetrics(self.registry, self.cluster)
        self.raft = RaftNode(cfg, self.cluster, self.m)
        #: the pysyncobj node (tests and tools wait on its readiness)
        self.node = self.raft.node
        self.leader = LeaderDuties(cfg, self.cluster, self.raft, self.m)
        self.renewals = RenewalRounds(self.raft)
        self.forwarder = Forwarder(cfg, self.raft, self.m)
        #: what the leader does with the servers' calls (the handlers below only read JSON)
        self.calls = ServerCalls(
            cfg, self.terms, self.cluster, self.leader, self.commit, self.renewals.renew, self.m,
            leader_http=self.raft.http_of[self.raft.self_raft],
        )  # fmt: skip
        #: runs (issue 25): their endpoints, and the token check of every write
        self.runs = RunsApi(self, self._applied)
        self.forwarder.auth = self.runs.authenticate
        self.checkpoints = CheckpointSchedule(cfg, self.cluster, self.raft, self.m)
        self._loop_task: asyncio.Task | None = None
        self._ckpt_task: asyncio.Task | None = None
        #: "METHOD /path" of every HTTP route (set by make_app; tests/system/test_loop_lag_roles.py
        #: probes each, so a route added without a probe fails that test)
        self._routes: set[str] = set()

    def is_leader(self) -> bool:
        return self.raft.is_leader()

    async def commit(self, op: str, *args: Any) -> dict[str, Any]:
        """Proposes `op(*args)` on this node (the leader); see RaftNode.commit."""
        return await self.raft.commit(op, *args)

    # -- handlers --------------------------------------------------------------------------

    async def status(self) -> dict[str, Any]:
        info = self.cluster.read(
            lambda m: {"version": m.version, "applied": m.applied, "servers": len(m.servers)}
        )
        return {
            "role": "controller",
            "raft": self.raft.raft_status(),
            "table": info,
            "checkpoints": self.checkpoints.status(),
            "served": {"routes": sorted(self._routes)},
            "config": {
                **config_to_dict(self.cfg),
                "raft_password": "***",
                "peer_token": "***" if self.cfg.peer_token else "",
            },
        }

    def _applied(self) -> None:
        """Reads of the replicated state wait until this node applied the log up to the commit
        index the leader told it: a restarted controller otherwise answered `/routing` with
        version 0 and no primaries (which means "never placed") for ~0.6 s (issue 26). A node
        that cannot write its journal applies nothing new: it answers 503 too (issue 39)."""
        self.raft.check_journal()
        if not self.raft.is_ready():
            raise ProtocolError(
                "unavailable",
                "this controller has not yet applied the cluster state (starting, or no leader "
                "known yet); ask another controller or retry",
                retry_after=0.2,
            )

    async def h_routing(self, request: web.Request) -> web.Response:
        self._applied()
        table = self.cluster.read(lambda m: m.routing())
        table["answered_by"] = self.raft.self_raft
        table["leader"] = self.raft.leader_raft()
        return aweb.json_response(table)

    async def h_cluster(self, request: web.Request) -> web.Response:
        self._applied()
        view = self.cluster.read(lambda m: m.cluster_view())
        view["raft"] = self.raft.raft_status()
        return aweb.json_response(view)

    async def h_digest(self, request: web.Request) -> web.Response:
        """A digest of this controller's applied state, to compare across members (every
        controller that applied the same entries answers the same digest). Computed in a
        thread: it reads the whole state."""
        self._applied()
        digest, applied = await asyncio.to_thread(
            self.cluster.read, lambda m: (state_digest(m), m.applied)
        )
        return aweb.json_response(
            {"digest": digest, "applied": applied, "last_applied": self.raft.last_applied}
        )

    async def h_leases(self, request: web.Request) -> web.Response:
        self._applied()
        records = self.cluster.read(lambda m: m.lease_records())
        return aweb.json_response({"terms": self.terms.to_dict(), "records": records})

    async def h_server(self, request: web.Request) -> web.Response:
        self._applied()
        sid = fields.server_id(request)
        rec = self.cluster.read(lambda m: (m.servers.get(sid), m.roles_of(sid), m.version))
        if rec[0] is None:
            raise ProtocolError("not_found", f"no server {sid!r}")
        return aweb.json_response({"server": sid, **rec[0], "roles": rec[1], "version": rec[2]})

    async def h_register(self, request: web.Request) -> web.Response:
        sid = fields.server_id(request)

        async def run() -> dict[str, Any]:
            return await self.calls.register(sid, await aweb.read_json(request))

        return await self._server_write(request, sid, run)

    async def h_heartbeat(self, request: web.Request) -> web.Response:
        sid = fields.server_id(request)

        async def run() -> dict[str, Any]:
            return await self.calls.heartbeat(sid, await aweb.read_json(request))

        return await self._server_write(request, sid, run)

    async def _check_server(self, request: web.Request, server: str) -> None:
        """With a peer token: refused (403) unless the call carries server `server`'s proof of
        its own key over this very request (adamps.security.peer_auth.SERVER_HEADER): the calls only a
        server makes (register, heartbeat, role changes, caught-up, release, drop-secondary)
        cannot be made by a holder of the cluster token alone (issue 28)."""
        if not self.cfg.peer_token:
            return
        value = request.headers.get(peer_auth.SERVER_HEADER)
        body = await aweb.read_body(request)
        prover = (
            None
            if value is None
            else peer_auth.server_call_ok(
                self.cfg.peer_token, value, request.method, request.path, body, time.time()
            )
        )
        if prover is None or prover != server:
            raise ProtocolError(
                "forbidden",
                f"{request.path} is a server's call: it needs server {server!r}'s proof of its "
                f"own key ({peer_auth.SERVER_HEADER}); the cluster token is a client credential",
            )

    async def _server_write(self, request: web.Request, server: str, run: Any) -> web.Response:
        try:
            await self._check_server(request, server)
        except ProtocolError as exc:
            self.forwarder.refused(request, exc)
            raise
        return await self.forwarder.write(request, run)

    async def h_peer_keys(self, request: web.Request) -> web.Response:
        """A server's pairwise keys (adamps.security.peer_auth), for the servers it names, once it proved
        it holds its own key. Any controller answers (a derivation from the peer token: no Raft
        entry); nobody else can, and a trainer (the cluster token only) gets 403."""
        try:
            self.runs.authenticate(request, runs_allowed=False)  # a run's token: 403
            sid = fields.server_id(request)
            if not self.cfg.peer_token:
                raise ProtocolError("not_found", "peer identity is off (no peer_token set)")
            body = await aweb.read_json(request)
            fields.call_fields(body, "peer-keys", request.path)
            when = fields.int_field(body, "time")
            got = fields.str_field(body, "proof")
            if not peer_auth.proof_ok(self.cfg.peer_token, sid, when, got, time.time()):
                raise ProtocolError(
                    "forbidden",
                    f"no proof of server {sid!r}'s own key (server_key) within "
                    f"{peer_auth.PROOF_WINDOW:.0f} s: the cluster token is a client credential",
                )
            peers = body.get("peers")
            if (
                not isinstance(peers, list)
                or len(peers) > MAX_PEER_KEYS
                or not all(isinstance(p, str) and 0 < len(p) <= 128 for p in peers)
            ):
                raise ProtocolError(
                    "bad_request", f"field 'peers' must list at most {MAX_PEER_KEYS} server ids"
                )
        except ProtocolError as exc:
            self.forwarder.refused(request, exc)
            raise
        keys = {p: peer_auth.pair_key(self.cfg.peer_token, sid, p).hex() for p in peers}
        return aweb.json_response({"keys": keys})

    async def h_drain(self, request: web.Request) -> web.Response:
        sid = fields.server_id(request)
        # Copies stay until a server that failed with the drain is surely declared dead.
        cfg = self.cfg
        hold = cfg.server_timeout + cfg.heartbeat_interval + cfg.reconcile_interval
        return await self.forwarder.write(
            request, lambda: self._bodiless(request, "drain", sid, time.time(), hold)
        )

    async def h_undrain(self, request: web.Request) -> web.Response:
        sid = fields.server_id(request)
        # One replicated method for both directions (a new name would renumber the journal's).
        return await self.forwarder.write(
            request, lambda: self._bodiless(request, "drain", sid, time.time(), 0.0, True)
        )

    async def h_rebalance(self, request: web.Request) -> web.Response:
        return await self.forwarder.write(
            request, lambda: self._bodiless(request, "rebalance", time.time())
        )

    async def _commit_ok(self, op: str, *args: Any) -> dict[str, Any]:
        return ok_or_raise(await self.commit(op, *args))

    async def _bodiless(self, request: web.Request, op: str, *args: Any) -> dict[str, Any]:
        """A write whose body is `{}` or empty: anything else is 400 malformed and proposes
        nothing (a garbage body used to drain a server, docs/protocol.md "Errors")."""
        fields.only(await aweb.read_json(request), request, ())
        return await self._commit_ok(op, *args)

    async def h_bucket_op(self, request: web.Request) -> web.Response:
        try:
            b = fields.bucket(request, self.cfg.n_buckets)
            op = request.match_info["op"]
            if op not in BUCKET_OPS:
                raise ProtocolError("not_found", f"no bucket operation {op!r}")
        except ProtocolError as exc:
            self.forwarder.refused(request, exc)  # audited like every refused write
            raise

        async def run() -> dict[str, Any]:
            return await self.calls.bucket_op(b, op, await aweb.read_json(request))

        if op == "declare-lost" or not self.cfg.peer_token:  # an operator's call
            return await self.forwarder.write(request, run)
        # The server whose call this is: the one it names (role-change, release) or the
        # primary that reports (caught-up, drop-secondary).
        try:
            named = (await aweb.read_json(request)).get(
                "server" if op in ("role-change", "release") else "primary"
            )
        except ProtocolError as exc:
            self.forwarder.refused(request, exc)
            raise
        return await self._server_write(request, named if isinstance(named, str) else "", run)

    async def h_get_layout(self, request: web.Request) -> web.Response:
        self._applied()
        version, layout = self.cluster.read(lambda m: (m.layout_version, m.layout))
        if layout is None:
            raise ProtocolError("not_found", "no layout has been set")
        return aweb.json_response({"layout_version": version, "layout": layout})

    async def h_set_layout(self, request: web.Request) -> web.Response:
        async def run() -> dict[str, Any]:
            body = await aweb.read_json(request)
            if "layout" in body:  # the wrapped form; a bare layout's fields are check_layout's
                fields.only(body, request, ("layout", "run"))
            # In a thread: checking the largest layout accepted (4096 tensors) takes tens of ms.
            layout = await asyncio.to_thread(self._checked_layout, body.get("layout", body))
            who = request[PRINCIPAL_KEY]
            part = body.get("run") if isinstance(body, dict) and "layout" in body else None
            if part is not None and (not isinstance(part, str) or not 0 < len(part) <= 64):
                raise ProtocolError("bad_request", f"run must be a run's name, got {part!r}")
            if who.run is not None:  # a run sets its namespace's part of the layout only
                if part not in (None, who.run):
                    raise ProtocolError(
                        "forbidden", f"run {who.run!r}'s token sets only its own part, not {part!r}"
                    )
                return await self.runs.set_run_layout(who.run, layout)
            if part is not None:  # the operator on behalf of a run: that run's part only
                return await self.runs.set_run_layout(part, layout, operator=True)
            return ok_or_raise(await self.commit("set_layout", layout, time.time()))

        return await self.forwarder.write(request, run, runs_allowed=True)

    def _checked_layout(self, raw: Any) -> dict[str, Any]:
        # Sizes first, by arithmetic: nothing is cut into shards before it is known to fit.
        checked = limits.check_layout(
            raw,
            n_buckets=self.cfg.n_buckets,
            max_tensors=self.cfg.max_layout_tensors,
            max_tensor_elems=self.cfg.max_tensor_elems,
            max_total_elems=self.cfg.max_layout_elems,
            max_shards=self.cfg.max_layout_shards,
        )
        # What Layout.from_dict adds to these checks is unique names. It is not called: it cuts
        # every tensor into shards, 5.5 s for the 2^20 shards allowed, holding the event loop
        # (issue 39), and, in a thread, longer than a follower waits for a forwarded write.
        seen: set[str] = set()
        for t in checked["tensors"]:
            if t["name"] in seen:
                raise ProtocolError(
                    "bad_request", f"invalid layout: duplicate tensor name {t['name']!r}"
                )
            seen.add(t["name"])
        return checked

    async def h_get_progress(self, request: web.Request) -> web.Response:
        self._applied()
        epoch = request.query.get("epoch")
        progress = self.cluster.read(lambda m: {k: dict(v) for k, v in m.progress.items()})
        if epoch is not None:
            if not (
                epoch.isascii() and epoch.isdigit() and len(epoch) <= 10 and int(epoch) <= MAX_EPOCH
            ):
                raise ProtocolError("bad_request", f"epoch must be an integer in 0..{MAX_EPOCH}")
            return aweb.json_response(
                {"epoch": int(epoch), "replicas": progress.get(str(int(epoch)), {})}
            )
        return aweb.json_response({"epochs": progress})

    async def h_report_progress(self, request: web.Request) -> web.Response:
        async def run() -> dict[str, Any]:
            body = await aweb.read_json(request)
            fields.only(body, request, ("epoch", "replica", "progress", "done"))
            epoch = fields.int_field(body, "epoch")
            if not 0 <= epoch <= MAX_EPOCH:
                raise ProtocolError("bad_request", f"epoch must be in 0..{MAX_EPOCH}")
            replica = fields.str_field(body, "replica")
            self.runs.check_progress(request, replica)
            progress = body.get("progress", 0.0)
            if (
                isinstance(progress, bool)
                or not isinstance(progress, int | float)
                or not 0.0 <= progress <= 1.0
            ):
                raise ProtocolError("bad_request", "progress must be a number in [0, 1]")
            done = body.get("done", False)
            if not isinstance(done, bool):
                raise ProtocolError("bad_request", "done must be true or false")
            return ok_or_raise(
                await self.commit(
                    "report_progress", epoch, replica, float(progress), done, time.time()
                )
            )

        return await self.forwarder.write(request, run, runs_allowed=True)

    # -- app -------------------------------------------------------------------------------

    def make_app(self) -> web.Application:
        app = aweb.make_app(
            registry=self.registry,
            token=self.cfg.token,
            max_body=self.cfg.max_body,
            status=self.status,
            limits=self.cfg.http_limits,
        )
        # after the shared error middleware, so that its refusals are JSON errors too
        app.middlewares.append(self.forwarder.read_middleware())
        r = app.router
        r.add_get("/routing", self.h_routing)
        r.add_get("/cluster", self.h_cluster)
        r.add_get("/leases", self.h_leases)
        r.add_get("/state/digest", self.h_digest)
        r.add_get("/layout", self.h_get_layout)
        r.add_put("/layout", self.h_set_layout)
        r.add_post("/layout", self.h_set_layout)
        r.add_get("/progress", self.h_get_progress)
        r.add_post("/progress", self.h_report_progress)
        r.add_get("/servers/{id}", self.h_server)
        r.add_post("/servers/{id}/register", self.h_register)
        r.add_post("/servers/{id}/heartbeat", self.h_heartbeat)
        r.add_post("/servers/{id}/drain", self.h_drain)
        r.add_post("/servers/{id}/undrain", self.h_undrain)
        r.add_post("/servers/{id}/peer-keys", self.h_peer_keys)
        r.add_post("/rebalance", self.h_rebalance)
        r.add_post("/buckets/{bucket}/{op}", self.h_bucket_op)
        self.runs.routes(r)
        self._routes = {
            f"{x.method} {x.resource.canonical}" for x in r.routes() if x.method != "HEAD"
        }
        app.on_startup.append(self._on_startup)
        app.on_cleanup.append(self._on_cleanup)
        return app

    async def _on_startup(self, app: web.Application) -> None:
        self._loop_task = asyncio.create_task(self.leader.run())
        self._ckpt_task = asyncio.create_task(self.checkpoints.run())

    async def _on_cleanup(self, app: web.Application) -> None:
        for task in (self._loop_task, self._ckpt_task):
            if task is not None:
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    pass
        await self.forwarder.close()
        self.close()

    def close(self) -> None:
        self.raft.close()
