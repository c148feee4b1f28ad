"""This server's peer identity (adamps.security.peer_auth): its own key, the pairwise keys it got from the
controllers, and the checks of a replication message's sender. Event-loop thread only.

A replication op (``PEER_OPS``) is served only when its request proved who sent it: the MAC of
the request's bytes under the pair key of (sender, this server), and the message's own sender
fields naming that same server. So a secondary accepts PREPARE and COMMIT only from the server
the MAC proves, and the replica state machine then checks that this server is the bucket's
current primary at that epoch (adamps.core.replication.bucket). Without a key (``own`` is None: no
server_key and no peer_token configured) peer identity is off and the cluster token is enough,
as before issue 28; the server says so in its log at start.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from adamps.security import peer_auth
from adamps.wire import protocol
from adamps.wire.protocol import ProtocolError

#: the replication ops that need a peer's proof (``digest`` is a read: the cluster token will do)
PEER_OPS = ("repl_prepare", "repl_commit", "repl_ping", "repl_multi", "repl_snapshot")

log = logging.getLogger("adamps.server.replication.shell")


def forbidden(op: str, why: str) -> ProtocolError:
    return ProtocolError(
        "forbidden",
        f"{op} is a replication op between servers and needs a server's peer credential "
        f"({peer_auth.PEER_HEADER} on /rpc, a MAC on the data port): {why}. The cluster token "
        "is a client credential and cannot send it",
    )


def senders(op: str, msg: dict[str, Any]) -> Iterable[Any]:
    """The server ids a replication message claims to come from (all must be the prover)."""
    if op == "repl_snapshot":
        yield msg.get("joiner")
    elif op == "repl_multi":
        items = msg.get("items")
        for item in items if isinstance(items, list) else ():
            if isinstance(item, dict):
                yield item.get("sender")
    else:
        yield msg.get("sender")


class PeerKeys:
    """This server's own key and its pairwise keys (fetched from the controllers once each)."""

    def __init__(
        self,
        server_id: str,
        own: bytes | None,
        controller: Callable[[], Any],
        known: Callable[[str], bool],
    ) -> None:
        self.server_id = server_id
        #: S_X; None = peer identity off
        self.own = own
        #: the controllers' client (opened later, at the replicator's start)
        self._controller = controller
        #: whether a server id is one of the cluster's servers (keys are fetched for those only:
        #: a forged sender id costs the controllers nothing)
        self._known = known
        #: peer id -> K_(this server, peer)
        self.keys: dict[str, bytes] = {}
        self._fetching: dict[str, asyncio.Future] = {}
        if own is None:
            log.warning(
                "peer identity is off (no server_key or peer_token): any holder of the cluster "
                "token, every trainer, can send this server replication messages"
            )

    @property
    def enabled(self) -> bool:
        return self.own is not None

    async def key(self, peer: str) -> bytes:
        """K_(this server, peer), from the controllers the first time (one request at a time
        per peer)."""
        k = self.keys.get(peer)
        if k is not None:
            return k
        fut = self._fetching.get(peer)
        if fut is None:
            fut = self._fetching[peer] = asyncio.ensure_future(self._fetch(peer))
            fut.add_done_callback(lambda _f: self._fetching.pop(peer, None))
        return await asyncio.shield(fut)

    async def _fetch(self, peer: str) -> bytes:
        assert self.own is not None
        when = int(time.time())
        reply = await self._controller().peer_keys(
            self.server_id, [peer], when, peer_auth.proof(self.own, self.server_id, when)
        )
        k = bytes.fromhex(reply["keys"][peer])
        self.keys[peer] = k
        return k

    async def sign(self, peer: str, body: bytes) -> tuple[tuple[str, str], ...]:
        """The header that proves `body` comes from this server (none when identity is off)."""
        if not self.enabled:
            return ()
        key = await self.key(peer)
        if len(body) >= peer_auth.HASH_OFF_LOOP:  # a batch sent over HTTP: off the event loop
            value = await asyncio.to_thread(peer_auth.header, self.server_id, key, body)
        else:
            value = peer_auth.header(self.server_id, key, body)
        return ((peer_auth.PEER_HEADER, value),)

    async def prover(
        self,
        op: str,
        parts: list[Any] | Callable[[bytes], bytes],
        claimed: str | None,
        got: bytes | None,
    ) -> str:
        """The peer whose MAC `got` of `parts` is (it claims to be `claimed`); ProtocolError
        forbidden otherwise. `parts` may instead be the MAC's function of the pair key (the
        data port's segmented frame MAC, `frame`)."""
        if claimed is None or got is None:
            raise forbidden(op, "no peer credential in the request")
        if not self._known(claimed):
            raise forbidden(op, f"{claimed!r} is not a server of this cluster")
        try:
            key = await self.key(claimed)
        except (KeyError, ValueError, TypeError) as exc:  # a controller's odd answer
            raise forbidden(op, f"no pair key for {claimed!r}: {exc!r}") from None
        except (ConnectionError, TimeoutError, OSError, ProtocolError) as exc:
            # The controllers cannot say now (down, no quorum, or they refused this server's
            # own proof): not the sender's fault; it retries like any failed round.
            raise ProtocolError(
                "unavailable",
                f"cannot get the pair key of {claimed!r} from the controllers now: {exc}",
            ) from None
        if callable(parts):
            want = parts(key)
        elif sum(memoryview(p).nbytes for p in parts) >= peer_auth.HASH_OFF_LOOP:
            want = await asyncio.to_thread(peer_auth.mac, key, parts)  # off the event loop
        else:
            want = peer_auth.mac(key, parts)
        if not hmac.compare_digest(want, bytes(got)):
            raise forbidden(op, f"the MAC does not prove server {claimed!r}")
        return claimed

    async def frame(
        self, meta: dict[str, Any], meta_raw: bytes, payload: np.ndarray | None
    ) -> tuple[str | None, dict[str, Any]]:
        """A data-plane repl_multi frame, authenticated, then decoded: (the server whose MAC it
        carries, or None when identity is off or the frame names no sender; the message).

        The MAC is the payload's last MAC_SIZE bytes: ``peer_auth.frame_mac`` of the meta and the
        digests of the payload's segments, cut where the meta's out-of-band arrays start (so the
        message is decoded first: bounded, and only views; a frame that cannot be decoded cannot
        be verified, and is forbidden). The meta names that form (``"mac": FRAME_MAC``); a
        frame that names none or another is forbidden."""
        op = "repl_multi"
        claimed = meta.get("peer")
        if claimed is None:
            return None, protocol.decode(meta_raw, b"" if payload is None else payload)
        if payload is None or payload.size < peer_auth.MAC_SIZE:
            raise forbidden(op, "the frame's MAC is missing")
        got = payload[-peer_auth.MAC_SIZE :].tobytes()
        payload = payload[: -peer_auth.MAC_SIZE]
        if not self.enabled:
            return None, protocol.decode(meta_raw, payload)
        name = claimed if isinstance(claimed, str) else None
        form = meta.get("mac")
        if form != peer_auth.FRAME_MAC:
            raise forbidden(op, f"unknown frame MAC {form!r}")
        offsets: list[int] = []
        try:
            msg = protocol.decode(meta_raw, payload, offsets)
        except ProtocolError as exc:
            raise forbidden(op, f"the frame cannot be verified: {exc.message}") from None
        view = memoryview(payload)
        if len(view) >= peer_auth.HASH_OFF_LOOP:  # every byte hashed: off the event loop
            digests = await asyncio.to_thread(peer_auth.segment_digests, view, offsets)
        else:
            digests = peer_auth.segment_digests(view, offsets)
        peer = await self.prover(
            op, lambda key: peer_auth.frame_mac(key, meta_raw, digests), name, got
        )
        return peer, msg

    def check_senders(self, op: str, msg: dict[str, Any], peer: str) -> None:
        """Every sender the message names is the server that proved it sent it."""
        for s in senders(op, msg):
            if not isinstance(s, str) or s != peer:
                shown = repr(s) if isinstance(s, str | int | None) else type(s).__name__
                raise forbidden(op, f"server {peer!r} may not send as {shown}")

    def admit(self, op: str, msg: dict[str, Any], peer: str | None) -> None:
        """A replication op whose request `peer` proved it sent (None: no proof); with peer
        identity on, refused unless every sender the message names is that server."""
        if self.enabled:
            if peer is None:
                raise forbidden(op, "no peer credential in the request")
            self.check_senders(op, msg, peer)

    async def request_peer(self, op: str, header: str | None, body: Any) -> str | None:
        """The server whose MAC of `body` the PEER_HEADER value `header` carries, or None when
        there is none or identity is off; ProtocolError forbidden for a wrong one."""
        if header is None or not self.enabled:
            return None
        parsed = peer_auth.parse_header(header)
        if parsed is None:
            raise forbidden(op, f"malformed {peer_auth.PEER_HEADER} header")
        return await self.prover(op, [body], *parsed)

    def controller_signer(self) -> Callable[[str, str, bytes], tuple[tuple[str, str], ...]] | None:
        """What signs this server's calls to the controllers, which take them from this server
        only; None when it has no key."""
        own = self.own
        if own is None:
            return None

        def sign(method: str, path: str, body: bytes) -> tuple[tuple[str, str], ...]:
            value = peer_auth.server_call_header(
                own, self.server_id, int(time.time()), method, path, body
            )
            return ((peer_auth.SERVER_HEADER, value),)

        return sign
