"""Peer identity: which server sent a replication message (issue 28). Pure functions, no IO.

The cluster token authenticates clients, and every trainer holds it; it cannot tell one server
from another or from a trainer. A second secret, the **peer token**, is known to the controllers
only. From it:

- each server's own key ``S_X = HMAC(peer_token, "server" | X)``, given to server X alone (its
  ``server_key``; ``adamps up`` hands each server its own). With S_X a server proves to any
  controller that it is X (``proof``), and gets from the controllers
- the pairwise keys ``K_XY = HMAC(peer_token, "pair" | min(X, Y) | max(X, Y))`` of the peers it
  talks to. Every replication message from X to Y carries X's id and an HMAC-SHA256 under
  ``K_XY`` of its exact bytes (``mac``); Y checks it with the same key, and then that the
  message's ``sender`` is X.

A server knows only its own S_X and the K_XY with itself in them: it cannot derive another
server's key or the key of a pair it is not in, so it can speak only as itself, and a trainer
(no key at all) cannot speak to a server as a peer. The controllers hold the peer token.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable

#: the HTTP header of a peer's request on /rpc: "<sender id> <hex HMAC of the body>"
PEER_HEADER = "X-Adamps-Peer"
#: the HTTP header of a server's call to the controllers: "<server id> <unix time> <hex HMAC>"
SERVER_HEADER = "X-Adamps-Server"
#: bytes of a MAC (appended to a data-plane frame's payload)
MAC_SIZE = 32
#: seconds a server's proof of its key stays valid (clocks of servers and controllers may differ)
PROOF_WINDOW = 300.0


def _h(key: bytes, *parts: str) -> bytes:
    return hmac.new(key, "\0".join(parts).encode(), hashlib.sha256).digest()


def server_key(peer_token: str, server: str) -> bytes:
    """S_X: server X's own key."""
    return _h(peer_token.encode(), "server", server)


def pair_key(peer_token: str, a: str, b: str) -> bytes:
    """K_XY: the key of the pair of servers a and b (the same both ways)."""
    lo, hi = sorted((a, b))
    return _h(peer_token.encode(), "pair", lo, hi)


def proof(key: bytes, server: str, when: int) -> str:
    """What server X sends the controllers to show it holds S_X (at unix time `when`)."""
    return _h(key, "peer-keys", server, str(when)).hex()


def proof_ok(peer_token: str, server: str, when: int, got: str, now: float) -> bool:
    """Whether `got` is server's proof at `when`, and `when` is within PROOF_WINDOW of now."""
    if abs(now - when) > PROOF_WINDOW:
        return False
    want = proof(server_key(peer_token, server), server, when)
    return hmac.compare_digest(want.encode(), got.encode("ascii", "replace"))


def mac(key: bytes, parts: Iterable[bytes | bytearray | memoryview]) -> bytes:
    """HMAC-SHA256 of the concatenated parts (the message's bytes as sent)."""
    h = hmac.new(key, digestmod=hashlib.sha256)
    for p in parts:
        h.update(p)
    return h.digest()


def mac_ok(key: bytes, parts: Iterable[bytes | bytearray | memoryview], got: bytes) -> bool:
    return hmac.compare_digest(mac(key, parts), bytes(got))


# -- the data port's frame MAC (issue 27) -----------------------------------------------------------
#
# A primary sends each batch to two secondaries, under two pair keys: an HMAC of the whole frame
# hashed every batch's arrays once per secondary. The frame MAC hashes the payload in segments
# (each out-of-band array with its padding) and MACs the meta and those digests, so a primary
# hashes each array once whatever the number of its peers (the digest is the same for both), and
# a secondary still hashes every payload byte it receives once. Forging a frame then needs an
# HMAC-SHA256 forgery or a SHA-256 second preimage: the same guarantee as the MAC of the bytes.

#: bytes from which a server hashes a frame (its segments' digests, a MAC of its bytes) on a
#: worker thread: SHA-256 runs at 0.5-2 GB/s, so a 64 MiB replication frame held the event loop
#: 30-140 ms on each side (issue 39); below, the hop to a thread costs more than the hashing
HASH_OFF_LOOP = 1 << 20

#: what a data-plane frame's meta names in "mac" when its MAC is the segmented one (`frame_mac`);
#: also the MAC's domain separator, so no MAC of one form can pass for the other
FRAME_MAC = "sha256-segments"


def segment_digest(parts: Iterable[bytes | bytearray | memoryview]) -> bytes:
    """SHA-256 of one payload segment (given as the concatenation of `parts`)."""
    h = hashlib.sha256()
    for p in parts:
        h.update(p)
    return h.digest()


def frame_mac(key: bytes, meta: bytes | memoryview, digests: Iterable[bytes]) -> bytes:
    """HMAC-SHA256 under `key` of the frame's meta and the SHA-256 of each payload segment."""
    h = hmac.new(key, FRAME_MAC.encode() + b"\0", hashlib.sha256)
    h.update(meta)
    for d in digests:
        h.update(d)
    return h.digest()


def segment_digests(payload: memoryview, cuts: Iterable[int]) -> list[bytes]:
    """The digests of `payload` cut at the offsets `cuts` (those outside it are ignored; a cut
    at 0 is implied): the segments cover every byte of the payload exactly once."""
    n = len(payload)
    if not n:
        return []
    points = sorted({0, *(c for c in cuts if 0 < c < n)})
    ends = [*points[1:], n]
    return [hashlib.sha256(payload[a:b]).digest() for a, b in zip(points, ends, strict=True)]


def header(sender: str, key: bytes, body: bytes) -> str:
    return f"{sender} {mac(key, [body]).hex()}"


def parse_header(value: str) -> tuple[str, bytes] | None:
    """(sender, MAC) of a PEER_HEADER value, or None if malformed."""
    sender, _, hexmac = value.strip().partition(" ")
    if not sender or len(hexmac) != 2 * MAC_SIZE:
        return None
    try:
        return sender, bytes.fromhex(hexmac)
    except ValueError:
        return None


def _call_parts(server: str, when: int, method: str, path: str, body: bytes) -> list[bytes]:
    return ["\0".join(("call", server, str(when), method, path, "")).encode(), body]


def server_call_header(
    key: bytes, server: str, when: int, method: str, path: str, body: bytes
) -> str:
    """SERVER_HEADER of server X's call to the controllers, under its own key S_X."""
    return f"{server} {when} {mac(key, _call_parts(server, when, method, path, body)).hex()}"


def server_call_ok(
    peer_token: str, value: str, method: str, path: str, body: bytes, now: float
) -> str | None:
    """The server whose own key made SERVER_HEADER `value` for this call within PROOF_WINDOW of
    now, or None."""
    server, _, rest = value.strip().partition(" ")
    when_s, _, hexmac = rest.partition(" ")
    if not server or not when_s.isdigit() or len(hexmac) != 2 * MAC_SIZE:
        return None
    when = int(when_s)
    if abs(now - when) > PROOF_WINDOW:
        return None
    try:
        got = bytes.fromhex(hexmac)
    except ValueError:
        return None
    key = server_key(peer_token, server)
    return server if mac_ok(key, _call_parts(server, when, method, path, body), got) else None
