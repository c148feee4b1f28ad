"""The controller's HTTP service: one Raft node, its admin API, and the leader's duties.

Every controller answers reads (routing table, cluster view, layout, progress, lease record) from
its own applied state. Writes are carried out by the Raft leader: a follower forwards them to the
leader's HTTP address (one hop; the reply is the leader's). A write that cannot commit within
`commit_timeout`, or that arrives while there is no leader or no majority, fails fast with a JSON
503 ``no_quorum``; the caller may retry (every operation is safe to retry: the replicated methods
check epochs and states).

The leader's duties (soft state, never replicated): it remembers when each parameter server last
sent a heartbeat, turns a silence longer than `server_timeout` into a committed `declare_dead`,
and proposes a `reconcile` whenever some lease may be granted (a dead primary's lease has
certainly expired, or a hand-off target has caught up). A new leader starts every server's
silence clock afresh, so a leader change never declares anybody dead by itself.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from pysyncobj import FAIL_REASON

from adamps import limits, metrics
from adamps import web as aweb
from adamps.config import to_dict as config_to_dict
from adamps.core.lease import LeaseTerms
from adamps.layout import Layout, LayoutError
from adamps.protocol import ProtocolError
from controller.config import ControllerConfig
from controller.state import DEAD, ClusterModel, ReplicatedCluster, make_node, raft_conf

log = logging.getLogger(__name__)

FORWARDED = "X-Adamps-Forwarded"
APPLIED = "X-Adamps-Applied"
ERROR_CODES = {"stale_epoch", "conflict", "not_found", "unknown_bucket", "bad_request", "internal"}


#: operations asked for by clients: dry-run on a copy of the state before they are proposed
#: (those whose apply can refuse; register, rebalance and report_progress always succeed once
#: their arguments passed the handlers' checks, so they skip the copy)
#: pysyncobj's getStatus()["state"] of a leader (0 follower, 1 candidate, 2 leader): its public API
RAFT_LEADER = 2
DRY_RUN_OPS = frozenset(
    {
        "drain",
        "role_change",
        "verified_caught_up",
        "write_off",
        "release",
        "drop_secondary",
        "set_layout",
    }
)
#: largest training epoch number accepted by /progress
MAX_EPOCH = 1_000_000


class NotLeader(Exception):
    pass


class ControllerService:
    """One controller node: the Raft node, the leader loop and the HTTP handlers."""

    def __init__(self, cfg: ControllerConfig, registry: CollectorRegistry | None = None) -> None:
        self.cfg = cfg
        self.registry = registry or metrics.new_registry()
        self.terms = LeaseTerms(cfg.lease_duration, cfg.lease_skew, cfg.lease_margin)
        model = ClusterModel(cfg.n_buckets, self.terms, cfg.replication, cfg.min_servers)
        self.cluster = ReplicatedCluster(model)
        os.makedirs(cfg.data_dir, exist_ok=True)
        conf = raft_conf(
            password=cfg.password,
            journal_file=os.path.join(cfg.data_dir, "raft.journal"),
            dump_file=os.path.join(cfg.data_dir, "raft.dump"),
            raftMinTimeout=cfg.election_min,
            raftMaxTimeout=cfg.election_max,
            leaderFallbackTimeout=cfg.leader_fallback,
            logCompactionMinEntries=cfg.compaction_entries,
            logCompactionMinTime=cfg.compaction_seconds,
            bindAddress=f"{cfg.bind_host}:{cfg.raft_addresses[cfg.member].rsplit(':', 1)[1]}"
            if cfg.bind_host
            else None,
        )
        raft = cfg.raft_addresses
        self.self_raft = raft[cfg.member]
        self.http_of = dict(zip(raft, cfg.http_addresses, strict=True))
        self.node = make_node(
            self.self_raft,
            [a for a in raft if a != self.self_raft],
            self.cluster,
            conf,
            cfg.raft_limits,
        )
        #: leader soft state: server id -> monotonic time of its last heartbeat
        self.last_seen: dict[str, float] = {}
        #: leader soft state: bucket -> server -> [epoch, seq] last reported
        self.reports: dict[int, dict[str, list[int]]] = {}
        self._was_leader = False
        #: monotonic time the leader loop's last step ended (a long gap: this node was stalled)
        self._last_step = time.monotonic()
        self._session: aiohttp.ClientSession | None = None
        self._loop_task: asyncio.Task | None = None
        self._init_metrics()

    # -- metrics ---------------------------------------------------------------------------

    def _init_metrics(self) -> None:
        r = self.registry
        self.m_leader = Gauge(
            "adamps_controller_is_leader", "1 if this node is the Raft leader", registry=r
        )
        self.m_term = Gauge("adamps_controller_raft_term", "current Raft term", registry=r)
        self.m_commit = Gauge("adamps_controller_commit_index", "Raft commit index", registry=r)
        self.m_servers = Gauge(
            "adamps_controller_servers", "parameter servers by state", ["state"], registry=r
        )
        self.m_under = Gauge(
            "adamps_controller_under_replicated_buckets",
            "buckets with fewer copies than the replication",
            registry=r,
        )
        self.m_unassigned = Gauge(
            "adamps_controller_unassigned_buckets",
            "buckets without a live lease holder",
            registry=r,
        )
        self.m_unavailable = Gauge(
            "adamps_controller_unavailable_buckets",
            "buckets that held data and have no live copy to serve them (pushes and pulls get "
            "503 bucket_unavailable until a candidate copy is back or an operator declares them "
            "lost)",
            registry=r,
        )
        self.m_lost = Gauge(
            "adamps_controller_buckets_declared_lost",
            "buckets an operator declared lost (POST /buckets/{b}/declare-lost), in the "
            "replicated record (survives controller restarts)",
            registry=r,
        )
        self.m_version = Gauge(
            "adamps_controller_table_version", "routing table version", registry=r
        )
        self.m_writes = Counter(
            "adamps_controller_writes_total",
            "writes proposed by this node, by operation and result",
            ["op", "result"],
            registry=r,
        )
        self.m_write_s = Histogram(
            "adamps_controller_commit_seconds",
            "time from proposal to commit",
            buckets=metrics.LATENCY_BUCKETS,
            registry=r,
        )
        self.m_forwarded = Counter(
            "adamps_controller_forwarded_total", "writes forwarded to the leader", registry=r
        )
        self.m_heartbeats = Counter(
            "adamps_controller_heartbeats_total", "server heartbeats handled as leader", registry=r
        )
        self.m_dead = Counter(
            "adamps_controller_servers_declared_dead_total",
            "servers declared dead by this leader",
            registry=r,
        )

    def _update_gauges(self) -> None:
        self.m_leader.set(1 if self.is_leader() else 0)
        self.m_term.set(self.node.raftCurrentTerm)
        self.m_commit.set(self.node.raftCommitIndex)

        def snap(m: ClusterModel) -> tuple[dict[str, int], int, int, int, int, int]:
            states: dict[str, int] = {"live": 0, "dead": 0, "draining": 0}
            for rec in m.servers.values():
                states[rec["state"]] = states.get(rec["state"], 0) + 1
            unassigned = sum(1 for b in range(m.n_buckets) if not m._holder_live(b))
            unavailable = sum(1 for b in range(m.n_buckets) if m.unavailable(b))
            lost = getattr(m, "declared_lost", 0)
            return states, m.under_replicated(), unassigned, unavailable, lost, m.version

        states, under, unassigned, unavailable, lost, version = self.cluster.read(snap)
        for k, v in states.items():
            self.m_servers.labels(k).set(v)
        self.m_under.set(under)
        self.m_unassigned.set(unassigned)
        self.m_unavailable.set(unavailable)
        self.m_lost.set(lost)
        self.m_version.set(version)

    # -- raft helpers ----------------------------------------------------------------------

    def is_leader(self) -> bool:
        return self.node.getStatus()["state"] == RAFT_LEADER

    def leader_raft(self) -> str | None:
        leader = self.node.getStatus()["leader"]
        return None if leader is None else leader.address

    def has_quorum(self) -> bool:
        try:
            return bool(self.node.hasQuorum)
        except RuntimeError:  # a set changed size under us (the Raft thread): ask again
            return bool(self.node.hasQuorum)

    def raft_status(self) -> dict[str, Any]:
        leader = self.leader_raft()
        return {
            "self": self.self_raft,
            "role": "leader" if self.is_leader() else ("follower" if leader else "candidate"),
            "leader": leader,
            "leader_http": self.http_of.get(leader) if leader else None,
            "term": self.node.raftCurrentTerm,
            "commit_index": self.node.raftCommitIndex,
            "last_applied": self.node.raftLastApplied,
            "has_quorum": self.has_quorum(),
            "ready": self.node.isReady(),
            "members": self.cfg.members,
        }

    async def commit(self, op: str, *args: Any) -> dict[str, Any]:
        """Proposes `op(*args)` on this node (the leader) and waits for it to commit and apply."""
        if not self.is_leader():
            raise NotLeader()
        if not self.has_quorum():
            self.m_writes.labels(op, "no_quorum").inc()
            raise ProtocolError(
                "no_quorum", "the leader is not connected to a majority of controllers"
            )
        if op in DRY_RUN_OPS:
            # A Raft entry whose apply would refuse is not proposed (issue 12): the operation is
            # first run on a copy of this leader's applied state. Only an entry committed in
            # between can still make the real apply refuse (then a no-op on every replica).
            dry = self.cluster.read(lambda m: getattr(copy.deepcopy(m), op)(*copy.deepcopy(args)))
            if not dry.get("ok"):
                self.m_writes.labels(op, "refused").inc()
                return dry
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()

        def done(result: Any, err: int) -> None:
            def settle() -> None:
                if not fut.done():
                    fut.set_result((result, err))

            loop.call_soon_threadsafe(settle)

        t0 = time.perf_counter()
        getattr(self.cluster, op)(*args, callback=done)
        try:
            result, err = await asyncio.wait_for(fut, self.cfg.commit_timeout)
        except TimeoutError:
            self.m_writes.labels(op, "no_quorum").inc()
            raise ProtocolError(
                "no_quorum",
                f"{op} did not commit within {self.cfg.commit_timeout}s (no majority?); outcome unknown",
            ) from None
        if err != FAIL_REASON.SUCCESS:
            self.m_writes.labels(op, "failed").inc()
            raise ProtocolError(
                "no_quorum", f"{op} was not committed (raft reason {err}); retry", raft_error=err
            )
        self.m_write_s.observe(time.perf_counter() - t0)
        self.m_writes.labels(op, "ok" if result.get("ok") else "refused").inc()
        return result

    # -- the leader's loop -----------------------------------------------------------------

    async def leader_loop(self) -> None:
        while True:
            try:
                await self._leader_step()
                self._update_gauges()
            except asyncio.CancelledError:
                raise
            except ProtocolError as exc:
                log.info("leader step: %s", exc)
            except NotLeader:
                pass
            except Exception:
                log.exception("leader step failed")
            # Measured from the end of a step: the step's own waits (commits) are no stall.
            self._last_step = time.monotonic()
            await asyncio.sleep(self.cfg.reconcile_interval)

    async def _leader_step(self) -> None:
        leader = self.is_leader() and self.node.isReady()
        if not leader:
            self._was_leader = False
            return
        mono = time.monotonic()
        gap = mono - self._last_step - self.cfg.reconcile_interval
        stalled = gap > self.cfg.server_timeout / 2
        if not self._was_leader:
            # A new leader knows no heartbeat yet: everybody's silence clock starts now.
            self._was_leader = True
            self.last_seen = {}
            log.info("this node leads (term %d)", self.node.raftCurrentTerm)
        elif stalled:
            # This node itself was stopped or starved (a pause, a flooded port): the heartbeats
            # of that time were never read, so their absence says nothing about the servers.
            log.warning("leader loop stalled %.1fs: every server's silence clock restarts", gap)
            self.last_seen = {}
        servers = self.cluster.read(lambda m: {s: r["state"] for s, r in m.servers.items()})
        for sid, state in servers.items():
            if state == DEAD:
                self.last_seen.pop(sid, None)
                continue
            seen = self.last_seen.setdefault(sid, mono)
            if mono - seen > self.cfg.server_timeout:
                log.warning("server %s silent for %.1fs: declaring it dead", sid, mono - seen)
                await self.commit("declare_dead", sid, time.time(), self._reports())
                self.m_dead.inc()
                self.last_seen.pop(sid, None)
        now = time.time()
        if self.cluster.read(lambda m: m.grants_due(now)):
            await self.commit("reconcile", now, self._reports())
        dead_before = now - self.cfg.dead_server_ttl
        for sid in self.cluster.read(lambda m: _expired_dead(m, dead_before)):
            await self.commit("sweep_dead", sid, dead_before, now)

    def _reports(self) -> dict[int, dict[str, list[int]]]:
        return {b: dict(r) for b, r in self.reports.items()}

    # -- HTTP plumbing ---------------------------------------------------------------------

    async def write(
        self, request: web.Request, run: Callable[[], Awaitable[dict[str, Any]]]
    ) -> web.Response:
        """Token check, then run on the leader or forward to it."""
        aweb.check_token(request)
        if self.is_leader():
            try:
                resp = aweb.json_response(await run())
                # Lets a forwarding follower wait until it has applied this write itself, so that
                # a client reading from the controller it wrote through sees its own write.
                resp.headers[APPLIED] = str(self.node.raftLastApplied)
                return resp
            except NotLeader:
                pass
        return await self.forward(request)

    async def forward(self, request: web.Request) -> web.Response:
        if request.headers.get(FORWARDED):
            raise ProtocolError(
                "no_quorum", "forwarded to a controller that is not the leader; retry"
            )
        if not self.has_quorum():
            raise ProtocolError(
                "no_quorum", "this controller is not connected to a majority of controllers"
            )
        leader = self.leader_raft()
        if leader is None or leader == self.self_raft:
            raise ProtocolError("no_quorum", "no leader elected yet; retry")
        target = self.http_of[leader]
        body = await request.read()
        headers = {
            "Authorization": request.headers.get("Authorization", ""),
            "Content-Type": request.headers.get("Content-Type", "application/json"),
            FORWARDED: self.self_raft,
        }
        if self._session is None:
            self._session = aiohttp.ClientSession()
        self.m_forwarded.inc()
        try:
            async with self._session.request(
                request.method,
                f"http://{target}{request.path_qs}",
                data=body,
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=self.cfg.commit_timeout + 1.0),
            ) as resp:
                payload = await resp.read()
                status = resp.status
                applied = resp.headers.get(APPLIED)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise ProtocolError(
                "no_quorum",
                f"the leader {target} did not answer ({type(exc).__name__}); retry",
                leader=target,
            ) from None
        if applied is not None and applied.isdigit():
            # Read-your-writes through this controller: wait until it applied the write too.
            deadline = time.monotonic() + self.cfg.commit_timeout
            while self.node.raftLastApplied < int(applied) and time.monotonic() < deadline:
                await asyncio.sleep(0.005)
        return web.Response(status=status, body=payload, content_type="application/json")

    @staticmethod
    def result(res: dict[str, Any]) -> dict[str, Any]:
        """A replicated method's refusal becomes the matching 4xx error."""
        if res.get("ok"):
            return res
        code = res.get("error", "conflict")
        extra = {k: v for k, v in res.items() if k not in ("ok", "error", "message")}
        raise ProtocolError(
            code if code in ERROR_CODES else "conflict", res.get("message", code), **extra
        )

    # -- handlers --------------------------------------------------------------------------

    async def status(self) -> dict[str, Any]:
        info = self.cluster.read(
            lambda m: {"version": m.version, "applied": m.applied, "servers": len(m.servers)}
        )
        return {
            "role": "controller",
            "raft": self.raft_status(),
            "table": info,
            "config": {**config_to_dict(self.cfg), "raft_password": "***"},
        }

    async def h_routing(self, request: web.Request) -> web.Response:
        table = self.cluster.read(lambda m: m.routing())
        table["answered_by"] = self.self_raft
        table["leader"] = self.leader_raft()
        return aweb.json_response(table)

    async def h_cluster(self, request: web.Request) -> web.Response:
        view = self.cluster.read(lambda m: m.cluster_view())
        view["raft"] = self.raft_status()
        return aweb.json_response(view)

    async def h_leases(self, request: web.Request) -> web.Response:
        records = self.cluster.read(lambda m: m.lease_records())
        return aweb.json_response({"terms": self.terms.to_dict(), "records": records})

    async def h_server(self, request: web.Request) -> web.Response:
        sid = _server_id(request)
        rec = self.cluster.read(lambda m: (m.servers.get(sid), m.roles_of(sid), m.version))
        if rec[0] is None:
            raise ProtocolError("not_found", f"no server {sid!r}")
        return aweb.json_response({"server": sid, **rec[0], "roles": rec[1], "version": rec[2]})

    async def h_register(self, request: web.Request) -> web.Response:
        sid = _server_id(request)

        async def run() -> dict[str, Any]:
            body = await aweb.read_json(request)
            address = _address(body)
            self._check_register(sid, address)
            copies = _positions(body.get("copies") or {}, self.cfg.n_buckets, "copies")
            res = self.result(await self.commit("register", sid, address, time.time(), copies))
            self.last_seen[sid] = time.monotonic()
            return {
                **res,
                "heartbeat_interval": self.cfg.heartbeat_interval,
                "server_timeout": self.cfg.server_timeout,
                "lease": self.terms.to_dict(),
                "n_buckets": self.cfg.n_buckets,
            }

        return await self.write(request, run)

    def _check_register(self, sid: str, address: str) -> None:
        """Refuses, before proposing, a registration that would hijack a live server's routes
        (issue 12: re-registering a live id from another address moved its buckets there) or
        that would grow the server table past its bound."""
        rec, n = self.cluster.read(lambda m: (m.servers.get(sid), len(m.servers)))
        if rec is not None and rec["state"] != DEAD and rec["address"] != address:
            raise ProtocolError(
                "conflict",
                f"server {sid!r} is live at {rec['address']}; it may register again from there, "
                f"or from {address} once it has been declared dead "
                f"(after {self.cfg.server_timeout} s of silence)",
                state=rec["state"],
                address=rec["address"],
            )
        if rec is None and n >= self.cfg.max_servers:
            raise ProtocolError(
                "too_large",
                f"the cluster keeps at most {self.cfg.max_servers} server records",
                limit=self.cfg.max_servers,
            )

    async def h_heartbeat(self, request: web.Request) -> web.Response:
        sid = _server_id(request)

        async def run() -> dict[str, Any]:
            body = await aweb.read_json(request)
            known = body.get("known_version")
            reports = body.get("reports") or {}
            if not isinstance(reports, dict):
                raise ProtocolError("bad_request", "reports must be a map bucket -> [epoch, seq]")
            rec = self.cluster.read(lambda m: m.servers.get(sid))
            if rec is None:
                raise ProtocolError("not_found", f"no server {sid!r}: register first")
            if rec["state"] == DEAD:
                raise ProtocolError(
                    "conflict", f"server {sid!r} was declared dead: register again", state=DEAD
                )
            self.last_seen[sid] = time.monotonic()
            self.m_heartbeats.inc()
            for b, r in reports.items():
                try:
                    bi, epoch, seq = int(b), int(r[0]), int(r[1])
                except (TypeError, ValueError, IndexError, KeyError):
                    raise ProtocolError(
                        "bad_request", f"reports[{b!r}] must be [epoch, seq]"
                    ) from None
                if 0 <= bi < self.cfg.n_buckets:
                    self.reports.setdefault(bi, {})[sid] = [epoch, seq]
            holds = self.cluster.read(
                lambda m: any(
                    m.primary_of(b) == sid and m._holder_live(b) for b in range(m.n_buckets)
                )
            )
            renewed: dict[str, Any] = {"renewed": [], "at": None}
            if holds:
                renewed = self.result(await self.commit("renew", sid, time.time()))
            version, roles, state, unavailable = self.cluster.read(
                lambda m: (
                    m.version,
                    m.roles_of(sid),
                    m.servers[sid]["state"],
                    [b for b in range(m.n_buckets) if m.unavailable(b)],
                )
            )
            reply: dict[str, Any] = {
                "server": sid,
                "state": state,
                "version": version,
                "renewed": renewed["renewed"],
                "renewed_at": renewed["at"],
                "lease": self.terms.to_dict(),
                "unavailable": unavailable,
            }
            if known != version:
                reply["roles"] = roles
            return reply

        return await self.write(request, run)

    async def h_drain(self, request: web.Request) -> web.Response:
        sid = _server_id(request)
        return await self.write(request, lambda: self._commit_ok("drain", sid, time.time()))

    async def h_rebalance(self, request: web.Request) -> web.Response:
        return await self.write(request, lambda: self._commit_ok("rebalance", time.time()))

    async def _commit_ok(self, op: str, *args: Any) -> dict[str, Any]:
        return self.result(await self.commit(op, *args))

    async def h_bucket_op(self, request: web.Request) -> web.Response:
        b = _bucket(request, self.cfg.n_buckets)
        op = request.match_info["op"]

        async def run() -> dict[str, Any]:
            body = await aweb.read_json(request)
            now = time.time()
            if op == "role-change":
                reports = body.get("reports") or {}
                if not isinstance(reports, dict):
                    raise ProtocolError(
                        "bad_request", "reports must be a map server -> [epoch, seq]"
                    )
                clean = {}
                for s, r in reports.items():
                    try:
                        clean[str(s)] = [int(r[0]), int(r[1])]
                    except (TypeError, ValueError, IndexError, KeyError):
                        raise ProtocolError(
                            "bad_request", f"reports[{s!r}] must be [epoch, seq]"
                        ) from None
                for s, r in self.reports.get(b, {}).items():
                    clean.setdefault(s, r)
                # Only servers the cluster knows go into the Raft entry (bounded, meaningful).
                known = self.cluster.read(lambda m: set(m.servers))
                clean = {s: r for s, r in clean.items() if s in known}
                args = (b, _str(body, "server"), _int(body, "prev_epoch"), clean, now)
                return self.result(await self.commit("role_change", *args))
            if op == "caught-up":
                args = (b, _str(body, "primary"), _int(body, "epoch"), _str(body, "server"), now)
                join = _int(body, "join") if "join" in body else None
                return self.result(await self.commit("verified_caught_up", *args, join))
            if op == "declare-lost":
                log.warning("operator: declare-lost of bucket %d requested", b)
                return self.result(await self.commit("write_off", b, now))
            if op == "release":
                return self.result(
                    await self.commit("release", b, _str(body, "server"), _int(body, "epoch"), now)
                )
            if op == "drop-secondary":
                args = (b, _str(body, "primary"), _int(body, "epoch"), _str(body, "server"), now)
                return self.result(await self.commit("drop_secondary", *args))
            raise ProtocolError("not_found", f"no bucket operation {op!r}")

        if op not in ("role-change", "caught-up", "release", "drop-secondary", "declare-lost"):
            raise ProtocolError("not_found", f"no bucket operation {op!r}")
        return await self.write(request, run)

    async def h_get_layout(self, request: web.Request) -> web.Response:
        version, layout = self.cluster.read(lambda m: (m.layout_version, m.layout))
        if layout is None:
            raise ProtocolError("not_found", "no layout has been set")
        return aweb.json_response({"layout_version": version, "layout": layout})

    async def h_set_layout(self, request: web.Request) -> web.Response:
        async def run() -> dict[str, Any]:
            body = await aweb.read_json(request)
            raw = body.get("layout", body)
            # Sizes first, by arithmetic: nothing is cut into shards before it is known to fit.
            checked = limits.check_layout(
                raw,
                n_buckets=self.cfg.n_buckets,
                max_tensors=self.cfg.max_layout_tensors,
                max_tensor_elems=self.cfg.max_tensor_elems,
                max_total_elems=self.cfg.max_layout_elems,
                max_shards=self.cfg.max_layout_shards,
            )
            try:
                layout = Layout.from_dict(checked).to_dict()
            except (LayoutError, KeyError, TypeError, ValueError) as exc:
                raise ProtocolError("bad_request", f"invalid layout: {exc}") from None
            return self.result(await self.commit("set_layout", layout, time.time()))

        return await self.write(request, run)

    async def h_get_progress(self, request: web.Request) -> web.Response:
        epoch = request.query.get("epoch")
        progress = self.cluster.read(lambda m: {k: dict(v) for k, v in m.progress.items()})
        if epoch is not None:
            if not (epoch.isdigit() and len(epoch) <= 10 and int(epoch) <= MAX_EPOCH):
                raise ProtocolError("bad_request", f"epoch must be an integer in 0..{MAX_EPOCH}")
            return aweb.json_response(
                {"epoch": int(epoch), "replicas": progress.get(str(int(epoch)), {})}
            )
        return aweb.json_response({"epochs": progress})

    async def h_report_progress(self, request: web.Request) -> web.Response:
        async def run() -> dict[str, Any]:
            body = await aweb.read_json(request)
            epoch = _int(body, "epoch")
            if not 0 <= epoch <= MAX_EPOCH:
                raise ProtocolError("bad_request", f"epoch must be in 0..{MAX_EPOCH}")
            replica = _str(body, "replica")
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
            return self.result(
                await self.commit(
                    "report_progress", epoch, replica, float(progress), done, time.time()
                )
            )

        return await self.write(request, run)

    # -- app -------------------------------------------------------------------------------

    def make_app(self) -> web.Application:
        app = aweb.make_app(
            registry=self.registry,
            token=self.cfg.token,
            max_body=self.cfg.max_body,
            status=self.status,
            limits=self.cfg.http_limits,
        )
        r = app.router
        r.add_get("/routing", self.h_routing)
        r.add_get("/cluster", self.h_cluster)
        r.add_get("/leases", self.h_leases)
        r.add_get("/layout", self.h_get_layout)
        r.add_put("/layout", self.h_set_layout)
        r.add_post("/layout", self.h_set_layout)
        r.add_get("/progress", self.h_get_progress)
        r.add_post("/progress", self.h_report_progress)
        r.add_get("/servers/{id}", self.h_server)
        r.add_post("/servers/{id}/register", self.h_register)
        r.add_post("/servers/{id}/heartbeat", self.h_heartbeat)
        r.add_post("/servers/{id}/drain", self.h_drain)
        r.add_post("/rebalance", self.h_rebalance)
        r.add_post("/buckets/{bucket}/{op}", self.h_bucket_op)
        app.on_startup.append(self._on_startup)
        app.on_cleanup.append(self._on_cleanup)
        return app

    async def _on_startup(self, app: web.Application) -> None:
        self._loop_task = asyncio.create_task(self.leader_loop())

    async def _on_cleanup(self, app: web.Application) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            try:
                await self._loop_task
            except asyncio.CancelledError:
                pass
        if self._session is not None:
            await self._session.close()
        self.close()

    def close(self) -> None:
        self.node.destroy()


def _positions(raw: Any, n_buckets: int, name: str) -> dict[int, list[int]]:
    """A map bucket -> [epoch, seq] from JSON (keys are strings there), checked."""
    if not isinstance(raw, dict):
        raise ProtocolError("bad_request", f"{name} must be a map bucket -> [epoch, seq]")
    out = {}
    for b, r in raw.items():
        try:
            bi, epoch, seq = int(b), int(r[0]), int(r[1])
        except (TypeError, ValueError, IndexError, KeyError):
            raise ProtocolError("bad_request", f"{name}[{b!r}] must be [epoch, seq]") from None
        if not 0 <= bi < n_buckets or epoch < 0 or seq < 0:
            raise ProtocolError(
                "bad_request", f"{name}[{b!r}]: bucket in [0, {n_buckets}), epoch and seq >= 0"
            )
        out[bi] = [epoch, seq]
    return out


def _server_id(request: web.Request) -> str:
    sid = request.match_info["id"]
    if not sid or len(sid) > 128 or not all(c.isalnum() or c in "-_." for c in sid):
        raise ProtocolError("bad_request", "server id must be 1-128 characters of [A-Za-z0-9._-]")
    return sid


def _bucket(request: web.Request, n: int) -> int:
    try:
        b = int(request.match_info["bucket"])
    except ValueError:
        raise ProtocolError("bad_request", "bucket must be an integer") from None
    if not 0 <= b < n:
        raise ProtocolError("unknown_bucket", f"no bucket {b} (the cluster has {n})")
    return b


def _str(body: dict[str, Any], name: str) -> str:
    v = body.get(name)
    if not isinstance(v, str) or not v or len(v) > 256:
        raise ProtocolError("bad_request", f"field {name!r} must be a non-empty string")
    return v


def _expired_dead(m: ClusterModel, dead_before: float) -> list[str]:
    return [
        s
        for s, r in m.servers.items()
        if r["state"] == DEAD and r["since"] <= dead_before and not m.refers_to(s)
    ]


def _address(body: dict[str, Any]) -> str:
    """Field address as host:port (a name or an IP literal, a port 1..65535)."""
    v = _str(body, "address")
    host, sep, port = v.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    ok_host = bool(host) and len(host) <= 253 and all(c.isalnum() or c in "-._:" for c in host)
    if not sep or not ok_host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ProtocolError("bad_request", f"field 'address' must be host:port, got {v[:100]!r}")
    return v


def _int(body: dict[str, Any], name: str) -> int:
    v = body.get(name)
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 1 << 63:
        raise ProtocolError("bad_request", f"field {name!r} must be an integer in 0..2^63-1")
    return v
