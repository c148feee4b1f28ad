"""Stream framing: a stream is a sequence of frames, each a 4-byte big-endian length and a msgpack
map encoded by adamps.wire.protocol (see docs/protocol-dataserver.md)."""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from adamps.wire import protocol
from adamps.wire.protocol import ProtocolError

LENGTH = struct.Struct(">I")
MAX_FRAME = 256 << 20  #: a client refuses longer frames (a corrupt length would ask for gigabytes)
CONTENT_TYPE = "application/x-adamps-frames"


@dataclass
class Batch:
    position: int  #: stream position of the first image
    x: np.ndarray  #: uint8 [b, H, W] (or [b, H, W, C]); click logs: float32 [b, dense]
    y: np.ndarray  #: int64 [b]
    index: np.ndarray  #: int64 [b] global dataset indices (for exactly-once checks)
    #: click logs (dataserver/ctr.py): int64 [b, fields] categorical ids; x is then float32
    #: [b, dense] features
    ids: np.ndarray | None = None


def frame(msg: dict[str, Any]) -> bytes:
    body = protocol.encode(msg)
    return LENGTH.pack(len(body)) + body


def read_frame(read: Callable[[int], bytes], max_frame: int = MAX_FRAME) -> dict[str, Any]:
    """Reads one frame with `read(n)` (which may return fewer bytes only at the end of the stream).

    Raises EOFError when the stream ends before a complete frame (the server died or cut it), and
    ProtocolError for a frame that is not a valid message.
    """
    head = _read_exact(read, LENGTH.size)
    (n,) = LENGTH.unpack(head)
    if n > max_frame:
        raise ProtocolError("too_large", f"frame of {n} bytes exceeds the limit of {max_frame}")
    msg = protocol.decode(_read_exact(read, n))
    if not isinstance(msg.get("type"), str):
        raise ProtocolError("malformed", "frame has no string field 'type'")
    return msg


def _read_exact(read: Callable[[int], bytes], n: int) -> bytes:
    parts = []
    while n > 0:
        chunk = read(n)
        if not chunk:
            raise EOFError("stream ended inside a frame" if parts else "stream ended")
        parts.append(chunk)
        n -= len(chunk)
    return b"".join(parts)
