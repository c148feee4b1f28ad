"""A parameter server's calls to the controllers, as its replication core asks for them
(``ControllerRequest`` in the ``Ready``): registration, heartbeats (whose answers carry the roles
and renewed leases), role changes, drop-secondary and caught-up reports. Each call is made once
and its answer goes back into the core as it is (``ReplCore.controller_answer``): when to call,
and what an answer or its absence means, are the core's (adamps.core.replication.controllers)."""

from __future__ import annotations

import logging
import time
from typing import Any

import aiohttp

from adamps.client.controller import AsyncControllerClient, LayoutMismatch
from adamps.client.rpc import RpcError
from adamps.core.replication.ready import ControllerAnswer, ControllerRequest
from adamps.server.replication import bucket_copy

log = logging.getLogger("adamps.server.replication.shell")


class ControllerCalls:
    """The controllers as one server's replication calls them. `r` is its Replicator (typed
    loosely: the layer above, which imports this module)."""

    def __init__(self, r: Any) -> None:
        self.r = r
        self.ctl: Any = None
        #: stops the server, with its reason: no retry can cure it (another n_buckets)
        self.on_fatal: Any = lambda why: log.critical("%s", why)

    def open(self, session: aiohttp.ClientSession) -> None:
        """The controllers' client, signing this server's calls when it has a key."""
        cfg = self.r.cfg
        self.ctl = AsyncControllerClient(
            cfg.controllers, cfg.token, session, timeout=5.0, retry_for=5.0
        )
        self.ctl.signer = self.r.peer_keys.controller_signer()

    async def _register(self, body: dict[str, Any]) -> dict[str, Any]:
        r = self.r
        offered = await bucket_copy.offers(r.store, body["copies"], body["committed"])
        reply = await self.ctl.register(r.server_id, r.address, offered, n_buckets=r.cfg.n_buckets)
        log.info("registered as %s at %s, offering %d copies (lease %s)",
                 r.server_id, r.address, len(offered), reply.get("lease"))  # fmt: skip
        return reply

    async def _heartbeat(self, body: dict[str, Any]) -> tuple[dict[str, Any], float]:
        r = self.r
        reply, asked_at = await self.ctl.heartbeat(
            r.server_id, body["known"], body["reports"], r.disk.not_durable(), body.get("deltas")
        )
        r.peers.learn(reply.get("roles", []))  # the address book, before the roles act
        r.on_heartbeat(reply)  # the runs' table version (adamps/server/api/tenancy.py)
        return reply, asked_at

    async def request(self, req: ControllerRequest) -> None:
        """One call the core asked for; its answer, whatever it is, goes back in."""
        b, me, ctl = req.bucket, self.r.server_id, self.ctl
        call = {
            "register": lambda: self._register(dict(req.body)),
            "heartbeat": lambda: self._heartbeat(dict(req.body)),
            "role_change": lambda: ctl.role_change(b, me, req.epoch, {me: list(req.position)}),
            "drop_secondary": lambda: ctl.drop_secondary(b, me, req.epoch, req.member),
            "caught_up": lambda: ctl.caught_up(b, me, req.epoch, req.member, req.join),
            "release": lambda: ctl.release(b, me, req.epoch),
        }[req.kind]
        asked_at = time.monotonic()
        try:
            reply = await call()
            if req.kind == "heartbeat":
                reply, asked_at = reply
            ans = ControllerAnswer(reply or {}, asked_at=asked_at)
        except LayoutMismatch as exc:  # not retried: the server stops, saying why
            return self.on_fatal(str(exc))
        except RpcError as exc:
            ans, why = ControllerAnswer(None, exc.code, exc.extra.get("retry_after")), exc
        except Exception as exc:  # no answer: the outcome is unknown (the core decides)
            ans, why = ControllerAnswer(error="connection"), exc
        else:  # (registrations log themselves; heartbeats and releases are routine)
            why = "accepted" if req.kind in ("role_change", "drop_secondary", "caught_up") else None
        if why is not None:
            about = (
                f" (bucket {b}, epoch {req.epoch}, {req.member or 'this copy'})" if b >= 0 else ""
            )
            log.log(logging.WARNING if ans.error else logging.INFO, "controllers: %s%s: %s",
                    req.kind, about, why)  # fmt: skip
        self.r.step(b, self.r.core.controller_answer, req, ans)
