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
from adamps.core.replication.ready import ControllerRequest
from adamps.server.replication import bucket_copy
from adamps.server.replication.carry import controller_call

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

    def _call(self, req: ControllerRequest, copies: Any = None) -> Any:
        r = self.r
        return controller_call(self.ctl, req, r.server_id, r.address, r.cfg.n_buckets,
                               r.disk.not_durable, copies)  # fmt: skip

    async def _register(self, req: ControllerRequest) -> dict[str, Any]:
        r, body = self.r, req.body
        offered = await bucket_copy.offers(r.store, body["copies"], body["committed"])
        reply = await self._call(req, offered)
        log.info("registered as %s at %s, offering %d copies (lease %s)",
                 r.server_id, r.address, len(offered), reply.get("lease"))  # fmt: skip
        return reply

    async def request(self, req: ControllerRequest) -> None:
        """One call the core asked for; its answer, whatever it is, goes back in."""
        asked_at, reply, exc = time.monotonic(), None, None
        try:
            if req.kind == "register":
                reply = await self._register(req)
            else:
                reply = await self._call(req)
            if req.kind == "heartbeat":
                reply, asked_at = reply
                self.r.peers.learn(reply.get("roles", []))  # the address book, before the roles act
                self.r.on_heartbeat(reply)  # the runs' table version (adamps/server/api/tenancy.py)
        except LayoutMismatch as e:  # not retried: the server stops, saying why
            return self.on_fatal(str(e))
        except Exception as e:  # a refusal, or no answer: the outcome is unknown (the core decides)
            exc = e
        ans = self.r.carrier.controller_answer(req, reply, asked_at, exc)
        # (registrations log themselves; heartbeats and releases are routine)
        if exc is not None or req.kind in ("role_change", "drop_secondary", "caught_up"):
            b = req.bucket
            about = (
                f" (bucket {b}, epoch {req.epoch}, {req.member or 'this copy'})" if b >= 0 else ""
            )
            log.log(logging.WARNING if ans.error else logging.INFO, "controllers: %s%s: %s",
                    req.kind, about, exc or "accepted")  # fmt: skip
