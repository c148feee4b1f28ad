"""Raw data-plane frames for the tests that send what no client would (adamps.client.dataplane)."""

from __future__ import annotations

import socket
from typing import Any

from adamps.client.dataplane import HEADER
from adamps.wire import protocol


def recv_exact(s: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("closed")
        buf += chunk
    return bytes(buf)


def read_frame(s: socket.socket) -> tuple[int, dict[str, Any]]:
    """The next frame on `s`: its kind and decoded meta (its payload read and dropped)."""
    _magic, _v, kind, _z, meta_len, payload_len = HEADER.unpack(recv_exact(s, HEADER.size))
    meta = protocol.decode(recv_exact(s, meta_len))
    recv_exact(s, payload_len)
    return kind, meta
