"""A parameter server's link to the controllers: registration, heartbeats (whose answers carry
the roles and renewed leases), and the calls the replication core asks for (role changes,
drop-secondary, caught-up reports). IO only: the answers go back into the core
(adamps.core.repl_core), which decides."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import aiohttp

from adamps.client.controller import AsyncControllerClient
from adamps.client.rpc import RpcError
from adamps.core import repl_copies
from adamps.core.lease import LeaseTerms
from adamps.core.repl_ready import ControllerRequest
from adamps.server import repl_transfer

log = logging.getLogger("adamps.server.replicate")


class ControllerLink:
    """The controllers as one server's replication sees them. `r` is its Replicator (typed
    loosely: the layer above, which imports this module)."""

    def __init__(self, r: Any) -> None:
        self.r = r
        self.ctl: Any = None
        self.heartbeat_interval = 1.0
        #: set to send the next heartbeat now (the core asked, or a refusal named a newer epoch)
        self.heartbeat_now = asyncio.Event()

    def open(self, session: aiohttp.ClientSession) -> Any:
        """The controllers' client, signing this server's calls when it has a key."""
        ctl = AsyncControllerClient(
            self.r.cfg.controllers, self.r.cfg.token, session, timeout=5.0, retry_for=5.0
        )
        ctl.signer = self.r.peer_keys.controller_signer()
        self.ctl = ctl
        return ctl

    async def run(self) -> None:
        while not self.r.closing:
            try:
                await self._register()
                while not self.r.closing:
                    if not await self._heartbeat():
                        break  # declared dead: register again as a fresh incarnation
                    try:
                        await asyncio.wait_for(self.heartbeat_now.wait(), self.heartbeat_interval)
                    except TimeoutError:
                        pass
                    self.heartbeat_now.clear()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("controller unreachable: %s; retrying", exc)
                await asyncio.sleep(0.5)

    async def _register(self) -> None:
        # No role is acted on from here: the positions offered are final (ReplCore.unregistered).
        self.r.core.unregistered()
        self.r.drain()
        committed = {b: rep.committed for b, rep in self.r.core.buckets.items()}
        copies = await repl_transfer.offers(
            self.r.store, repl_copies.copies(self.r.core), committed
        )
        reply = await self.ctl.register(self.r.server_id, self.r.address, copies)
        if int(reply.get("n_buckets", self.r.cfg.n_buckets)) != self.r.cfg.n_buckets:
            raise RuntimeError(
                f"the controllers use n_buckets={reply['n_buckets']}, this server {self.r.cfg.n_buckets}"
            )
        terms = reply.get("lease") or {}
        self.heartbeat_interval = float(reply.get("heartbeat_interval", 1.0))
        self.r.core.registered(LeaseTerms(**{k: float(v) for k, v in terms.items()}))
        self.r.drain()
        log.info("registered as %s at %s, offering %d copies (lease %s)",
                 self.r.server_id, self.r.address, len(copies), terms)  # fmt: skip

    async def _heartbeat(self) -> bool:
        try:
            reply, asked_at = await self.ctl.heartbeat(
                self.r.server_id, self.r.core.table_version, self.r.core.heartbeat_reports(),
                self.r.not_durable(),
            )  # fmt: skip
        except RpcError as exc:
            if exc.code == "conflict" or exc.code == "not_found":
                log.warning("controller says %s: registering again", exc.message)
                return False
            raise
        self.r.peers.learn(reply.get("roles", []))
        self.r.on_heartbeat(reply)  # the runs' table version (adamps/server/tenancy.py)
        self.r.core.on_roles(reply, asked_at, time.monotonic())
        self.r.drain()
        self.r.m.observe(self.r.core)
        return True

    async def request(self, req: ControllerRequest) -> None:
        """One call to the controllers the core asked for; its answer goes back in."""
        b, ctl = req.bucket, self.ctl
        if req.kind == "role_change":
            log.warning("bucket %d: primary silent; proposing a role change", b)
            retry = None
            try:
                position = {self.r.server_id: list(req.position)}
                await ctl.role_change(b, self.r.server_id, req.epoch, position)
            except RpcError as exc:
                retry = exc.extra.get("retry_after")
                log.info("bucket %d: role change not accepted: %s", b, exc.message)
            except (ConnectionError, TimeoutError) as exc:
                log.info("bucket %d: role change failed: %s", b, exc)
            self.r.core.on_role_change_answer(b, retry, time.monotonic())
        elif req.kind == "drop_secondary":
            log.warning("bucket %d: %s unresponsive; asking the controllers to drop it",
                        b, req.member)  # fmt: skip
            self.r.m.dropped.inc()
            try:
                await ctl.drop_secondary(b, self.r.server_id, req.epoch, req.member)
            except (RpcError, ConnectionError, TimeoutError) as exc:
                log.warning("bucket %d: drop-secondary %s failed: %s", b, req.member, exc)
            self.heartbeat_now.set()  # learn the new replica set (a committed entry)
        else:  # caught_up: sent again while its outcome is unknown
            while not self.r.closing:
                error: str | None = None
                try:
                    await ctl.caught_up(b, self.r.server_id, req.epoch, req.member, req.join)
                    log.info("bucket %d: %s caught up (epoch %d)", b, req.member, req.epoch)
                except RpcError as exc:
                    log.info("bucket %d: caught-up of %s: %s", b, req.member, exc)
                    error = exc.code
                except (ConnectionError, TimeoutError, OSError):
                    error = "connection"
                again = self.r.core.on_caught_up_answer(req, error, time.monotonic())
                self.r.drain()
                if not again:
                    return
                await asyncio.sleep(0.2)
        self.r.drain()
