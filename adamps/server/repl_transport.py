"""The transport of the replication core's messages: ``Send`` values (adamps.core.repl_ready)
over the peers' aggregating channels (repl_peers: the data plane, else HTTP), each answered
exactly once. The simulation has an in-memory one with the same interface
(tests/core/test_replication_sim.py)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from adamps.client.rpc import RpcError
from adamps.core.repl_ready import Send
from adamps.server.repl_peers import Peers
from adamps.server.repl_wire import batch_to_wire

log = logging.getLogger(__name__)


class PeerTransport:
    """The replication core's messages (``adamps.core.repl_ready.Send``) over the peers'
    aggregating channels. Every message gets exactly one answer through `done`: the reply, or
    an error code ("connection" when no reply came within the channel's timeout)."""

    def __init__(self, peers: Peers) -> None:
        self.peers = peers

    def send(self, msg: Send, done: Callable[[dict[str, Any] | None, str | None], None]) -> None:
        asyncio.create_task(self._call(msg, done), name=f"{msg.op}-{msg.peer}")

    async def _call(
        self, msg: Send, done: Callable[[dict[str, Any] | None, str | None], None]
    ) -> None:
        fields = dict(msg.fields)
        if "entries" in fields:
            fields["entries"] = [batch_to_wire(e) for e in fields["entries"]]
        try:
            reply = await self.peers.channel(msg.peer).call(msg.op, **fields)
        except RpcError as exc:
            done(None, exc.code)
        except (ConnectionError, TimeoutError, OSError):
            done(None, "connection")
        except Exception:  # noqa: BLE001  (a bug here must not leave the message in flight)
            log.exception("sending %s to %s failed", msg.op, msg.peer)
            done(None, "internal")
        else:
            done(reply, None)
