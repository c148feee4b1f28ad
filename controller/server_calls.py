"""What the controllers' leader does with a parameter server's calls, apart from HTTP:
registration, heartbeats, and the bucket operations (role change, caught-up, release,
drop-secondary; and the operator's declare-lost). Each checks the request's fields, feeds the
leader's soft state (``leader.py``), proposes its Raft entries and builds the answer.

The IO is injected: `commit` proposes an entry and waits until it applied (``RaftNode.commit``),
`renew` waits for a place in the next renewal round (``renewals.RenewalRounds.renew``) and
`wall` is the clock whose readings go into the entries. So the service's HTTP handlers
(``service.py``: a request's JSON in, this answer out) and the randomized replication
simulation (tests/core/test_replication_sim.py, over a simulated Raft) run the same code.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from adamps.core.lease import LeaseTerms
from adamps.wire.protocol import ProtocolError
from controller import fields
from controller.config import ControllerConfig
from controller.ctl_metrics import ControllerMetrics
from controller.leader import LeaderDuties
from controller.raft_node import ok_or_raise
from controller.state import DEAD, ReplicatedCluster

log = logging.getLogger("controller.service")

Commit = Callable[..., Awaitable[dict[str, Any]]]


class ServerCalls:
    """A leader's handling of the servers' calls. Event-loop thread only (or the simulation's)."""

    def __init__(
        self,
        cfg: ControllerConfig,
        terms: LeaseTerms,
        cluster: ReplicatedCluster,
        leader: LeaderDuties,
        commit: Commit,
        renew: Callable[[str], Awaitable[dict[str, Any]]],
        m: ControllerMetrics,
        wall: Callable[[], float] = time.time,
        leader_http: str | None = None,
    ) -> None:
        self.cfg = cfg
        self.terms = terms
        self.cluster = cluster
        self.leader = leader
        self.commit = commit
        self.renew = renew
        self.m = m
        self.wall = wall
        #: this node's HTTP address, named in a heartbeat's answer (a follower forwards to the
        #: leader, whose answer this is): the server sends its next heartbeat here directly
        #: (issue 36: one controller's work, not two)
        self.leader_http = leader_http

    # -- registration ----------------------------------------------------------------------

    async def register(self, sid: str, body: dict[str, Any]) -> dict[str, Any]:
        fields.call_fields(body, "register", f"/servers/{sid}/register")
        address = fields.address(body)
        self.check_layout(body)
        self.check_register(sid, address)
        copies = fields.positions(body.get("copies") or {}, self.cfg.n_buckets, "copies")
        rack = fields.rack(body)
        res = ok_or_raise(await self.commit("register", sid, address, self.wall(), copies, rack))
        self.leader.heard_from(sid)
        return {
            **res,
            "heartbeat_interval": self.cfg.heartbeat_interval,
            "server_timeout": self.cfg.server_timeout,
            "lease": self.terms.to_dict(),
            "n_buckets": self.cfg.n_buckets,
        }

    def check_layout(self, body: dict[str, Any]) -> None:
        """Refuses a server whose number of buckets is not the cluster's (issue 39, finding 18):
        it could serve none of them. `n_buckets` is optional (servers of an earlier release
        check the reply's instead); the refusal names both values and registers nothing."""
        n = body.get("n_buckets")
        if n is None:
            return
        if isinstance(n, bool) or not isinstance(n, int):
            raise ProtocolError("bad_request", "n_buckets must be an integer")
        if n != self.cfg.n_buckets:
            raise ProtocolError(
                "conflict",
                f"this server uses n_buckets={n}, the controllers n_buckets="
                f"{self.cfg.n_buckets}: start it with --n-buckets {self.cfg.n_buckets}",
                reason="n_buckets",
                n_buckets=self.cfg.n_buckets,
            )

    def check_register(self, sid: str, address: str) -> None:
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

    # -- heartbeats ------------------------------------------------------------------------

    async def heartbeat(self, sid: str, body: dict[str, Any]) -> dict[str, Any]:
        # Every field checked before anything is recorded: a bad heartbeat changes nothing (it
        # counted as heard from and recorded the reports before a bad one, and not_durable was
        # checked after the renewal round).
        fields.call_fields(body, "heartbeat", f"/servers/{sid}/heartbeat")
        known = body.get("known_version")
        if known is not None and (type(known) is not int or not 0 <= known < 1 << 63):
            raise ProtocolError("bad_request", "known_version must be an integer >= 0 or null")
        reports = fields.positions(body.get("reports") or {}, self.cfg.n_buckets, "reports")
        not_durable = body.get("not_durable")
        if not_durable is not None and not isinstance(not_durable, str):
            raise ProtocolError("bad_request", "not_durable must be a string or null")
        deltas = body.get("deltas", False)
        if not isinstance(deltas, bool):
            raise ProtocolError("bad_request", "deltas must be true or false")
        rec = self.cluster.read(lambda m: m.servers.get(sid))
        if rec is None:
            raise ProtocolError("not_found", f"no server {sid!r}: register first")
        if rec["state"] == DEAD:
            raise ProtocolError(
                "conflict", f"server {sid!r} was declared dead: register again", state=DEAD
            )
        self.leader.heard_from(sid)
        self.m.heartbeats.inc()
        for bi, position in reports.items():
            self.leader.record_report(bi, sid, position[:2])
        holds = self.cluster.read(lambda m: m.holds_lease(sid))
        renewed: dict[str, Any] = {"renewed": [], "at": None}
        if holds:  # in the next renewal round, one entry for every server in it
            renewed = ok_or_raise(await self.renew(sid))
        # Committed when durability flips, not when the reason's figures change.
        if bool(rec.get("not_durable")) != bool(not_durable):
            # Its copies stay until a server that failed with it is surely declared dead.
            cfg = self.cfg
            hold = cfg.server_timeout + cfg.heartbeat_interval + cfg.reconcile_interval
            await self.commit("write_storage", sid, not_durable, self.wall(), hold)
        # A server that applies deltas says so (issue 40); one that does not gets full lists.
        view = self.cluster.read(lambda m: m.heartbeat_view(sid, known, deltas))
        reply: dict[str, Any] = {
            "server": sid,
            "state": view["state"],
            "version": view["version"],
            "renewed": renewed["renewed"],
            "renewed_at": renewed["at"],
            "lease": self.terms.to_dict(),
            "unavailable": view["unavailable"],
            # runs (issue 25): a server whose table is older fetches GET /auth/runs
            "runs_version": self.cluster.read(lambda m: getattr(m, "runs_version", 0)),
        }
        if self.leader_http is not None:
            reply["leader"] = self.leader_http
        if view["roles"] is not None:
            reply["roles"] = view["roles"]
        if "roles_since" in view:  # a delta: the roles changed since, and buckets to drop
            reply["roles_since"] = view["roles_since"]
            reply["removed"] = view["removed"]
        return reply

    # -- bucket operations -----------------------------------------------------------------

    async def bucket_op(self, b: int, op: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST /buckets/{b}/{op}: `b` is checked, `body` is the request's JSON."""
        now = self.wall()
        fields.call_fields(body, op, f"/buckets/{b}/{op}")
        if op == "role-change":
            reports = body.get("reports") or {}
            if not isinstance(reports, dict):
                raise ProtocolError("bad_request", "reports must be a map server -> [epoch, seq]")
            clean = {str(s): fields.epoch_seq(r, f"reports[{s!r}]") for s, r in reports.items()}
            for s, r in self.leader.reports_of(b).items():
                clean.setdefault(s, r)
            # Only servers the cluster knows go into the Raft entry (bounded, meaningful).
            known = self.cluster.read(lambda m: set(m.servers))
            clean = {s: r for s, r in clean.items() if s in known}
            args = (
                b,
                fields.str_field(body, "server"),
                fields.int_field(body, "prev_epoch"),
                clean,
                now,
            )
            return ok_or_raise(await self.commit("role_change", *args))
        if op == "caught-up":
            args = (
                b,
                fields.str_field(body, "primary"),
                fields.int_field(body, "epoch"),
                fields.str_field(body, "server"),
                now,
            )
            join = fields.int_field(body, "join") if "join" in body else None
            return ok_or_raise(await self.commit("verified_caught_up", *args, join))
        if op == "declare-lost":
            log.warning("operator: declare-lost of bucket %d requested", b)
            return ok_or_raise(await self.commit("write_off", b, now))
        if op == "release":
            return ok_or_raise(
                await self.commit(
                    "release",
                    b,
                    fields.str_field(body, "server"),
                    fields.int_field(body, "epoch"),
                    now,
                )
            )
        if op == "drop-secondary":
            args = (
                b,
                fields.str_field(body, "primary"),
                fields.int_field(body, "epoch"),
                fields.str_field(body, "server"),
                now,
            )
            return ok_or_raise(await self.commit("drop_secondary", *args))
        raise ProtocolError("not_found", f"no bucket operation {op!r}")
