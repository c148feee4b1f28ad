"""A parameter server's calls to the controllers: registration, heartbeats (whose answers carry
the roles and renewed leases), and the calls the replication core asks for (role changes,
drop-secondary, caught-up reports). IO only: when to register and heartbeat is the pure link's
(adamps.core.controller_link), the answers go back into it and into the core
(adamps.core.repl_core), which decide."""

from __future__ import annotations

import logging
import time
from typing import Any

import aiohttp

from adamps.client.controller import AsyncControllerClient
from adamps.client.rpc import RpcError
from adamps.core.lease import LeaseTerms
from adamps.core.repl_ready import ControllerRequest
from adamps.server import bucket_copy

log = logging.getLogger("adamps.server.replicate")


class ControllerCalls:
    """The controllers as one server's replication calls them. `r` is its Replicator (typed
    loosely: the layer above, which imports this module). When to register and heartbeat is
    the pure link's (adamps.core.controller_link, ``r.link``)."""

    def __init__(self, r: Any) -> None:
        self.r = r
        self.ctl: Any = None

    def open(self, session: aiohttp.ClientSession) -> Any:
        """The controllers' client, signing this server's calls when it has a key."""
        ctl = AsyncControllerClient(
            self.r.cfg.controllers, self.r.cfg.token, session, timeout=5.0, retry_for=5.0
        )
        ctl.signer = self.r.peer_keys.controller_signer()
        self.ctl = ctl
        return ctl

    async def register(self, copies: dict[int, list[int]], committed: dict[int, int]) -> None:
        """Offers `copies` (read in the same loop step as the core stopped acting on its roles:
        the positions offered are final, ReplCore.unregistered)."""
        r = self.r
        try:
            offered = await bucket_copy.offers(r.store, copies, committed)
            reply = await self.ctl.register(r.server_id, r.address, offered)
            if int(reply.get("n_buckets", r.cfg.n_buckets)) != r.cfg.n_buckets:
                raise RuntimeError(
                    f"the controllers use n_buckets={reply['n_buckets']}, this server {r.cfg.n_buckets}"
                )
            terms = reply.get("lease") or {}
            r.link.on_registered(reply.get("heartbeat_interval"), time.monotonic())
            r.core.registered(LeaseTerms(**{k: float(v) for k, v in terms.items()}))
            r.drain()
        except Exception as exc:
            log.warning("controller unreachable: %s; retrying", exc)
            r.link.on_failed(time.monotonic())
            return
        log.info("registered as %s at %s, offering %d copies (lease %s)",
                 r.server_id, r.address, len(offered), terms)  # fmt: skip

    async def heartbeat(self) -> None:
        r = self.r
        try:
            reply, asked_at = await self.ctl.heartbeat(
                r.server_id, r.core.table_version, r.core.heartbeat_reports(), r.disk.not_durable()
            )
            r.link.on_heartbeat(time.monotonic())
            r.peers.learn(reply.get("roles", []))
            r.on_heartbeat(reply)  # the runs' table version (adamps/server/tenancy.py)
            r.core.on_roles(reply, asked_at, time.monotonic())
            r.drain()
            r.m.observe(r.core)
        except Exception as exc:  # declared dead, or unreachable: register again
            dead = isinstance(exc, RpcError) and exc.code in ("conflict", "not_found")
            log.warning("controller %s: registering again", exc if dead else f"unreachable: {exc}")
            r.link.on_failed(time.monotonic(), declared_dead=dead)

    async def request(self, req: ControllerRequest) -> None:
        """One call to the controllers the core asked for. Its answer, whatever it is, goes
        back in (ReplCore.controller_answer), as a peer's answer to a message does."""
        b, me, ctl = req.bucket, self.r.server_id, self.ctl
        call = {
            "role_change": lambda: ctl.role_change(b, me, req.epoch, {me: list(req.position)}),
            "drop_secondary": lambda: ctl.drop_secondary(b, me, req.epoch, req.member),
            "caught_up": lambda: ctl.caught_up(b, me, req.epoch, req.member, req.join),
        }[req.kind]
        error, retry = None, None
        try:
            await call()
        except RpcError as exc:
            error, retry = exc.code, exc.extra.get("retry_after")
        except Exception as exc:  # no answer: the outcome is unknown (the core decides)
            error = "connection"
            log.info("bucket %d: %s: %r", b, req.kind, exc)
        log.log(logging.INFO if req.kind == "caught_up" else logging.WARNING,
                "bucket %d: %s %s (epoch %d): %s", b, req.kind, req.member or "(this copy)",
                req.epoch, error or "accepted")  # fmt: skip
        self.r.step(b, self.r.core.controller_answer, req, error, retry)
