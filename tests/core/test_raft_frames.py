"""A Raft frame is authenticated once (controller/raft_transport.py, issue 36: idle costs
nothing): pysyncobj checked every message's Fernet HMAC twice (``extract_timestamp``, then
``decrypt``), a sixth of an idle controller's Raft thread. The real bounded connection parses
frames built as pysyncobj's sender builds them; replayed, tampered and old frames are still
refused."""

from __future__ import annotations

import struct
import zlib

import pysyncobj.pickle as ps_pickle
from cryptography.fernet import Fernet
from pysyncobj.poller import createPoller

from controller.raft_transport import BoundedTcpConnection, RaftLimits, open_frame


class CountingFernet(Fernet):
    """pysyncobj's encryptor, counting the HMAC checks it makes."""

    checks = 0

    def _verify_signature(self, data: bytes) -> None:
        type(self).checks += 1
        super()._verify_signature(data)


#: a Fernet key as pysyncobj derives one from the password (urlsafe base64 of 32 bytes)
KEY = Fernet.generate_key()


def frame(fernet: Fernet, message: object, stamp: int) -> bytes:
    """A frame as pysyncobj's TcpConnection.send writes it: length, Fernet(zlib(pickle))."""
    token = fernet.encrypt_at_time(zlib.compress(ps_pickle.dumps(message)), stamp)
    return struct.pack("i", len(token)) + token


def connection(fernet: Fernet) -> BoundedTcpConnection:
    conn = BoundedTcpConnection(poller=createPoller("auto"), timeout=1.0, limits=RaftLimits())
    conn.encryptor = fernet
    conn.recvRandKey = None  # past the key exchange: plain messages
    conn.recvLastTimestamp = 0
    return conn


def parse(conn: BoundedTcpConnection, data: bytes) -> object:
    conn._rbuf += data
    return conn._TcpConnection__processParseMessage()  # type: ignore[attr-defined]


def test_a_frame_is_authenticated_by_one_hmac_check() -> None:
    assert hasattr(Fernet, "_verify_signature"), "cryptography renamed Fernet's HMAC check"
    fernet = CountingFernet(KEY)
    conn = connection(fernet)
    msg = {"type": "append_entries", "term": 3, "commit_index": 41, "entries": []}
    CountingFernet.checks = 0
    assert parse(conn, frame(fernet, msg, 1000)) == msg
    assert CountingFernet.checks == 1
    assert conn.recvLastTimestamp == 1000


def test_old_tampered_and_foreign_frames_are_still_refused() -> None:
    fernet = Fernet(KEY)
    conn = connection(fernet)
    assert parse(conn, frame(fernet, {"n": 1}, 1000)) == {"n": 1}
    # a frame older than the last one: refused, the connection dropped
    assert parse(conn, frame(fernet, {"n": 0}, 999)) is None
    conn = connection(fernet)
    good = bytearray(frame(fernet, {"n": 2}, 1000))
    good[30] ^= 0x04  # one bit of the token flipped
    assert parse(conn, bytes(good)) is None
    conn = connection(fernet)
    assert parse(conn, frame(Fernet(Fernet.generate_key()), {"n": 3}, 1000)) is None


def test_open_frame_reads_the_checked_timestamp() -> None:
    fernet = Fernet(KEY)
    for stamp in (0, 1, 1_700_000_000, 2**40 + 5):
        token = fernet.encrypt_at_time(b"x" * 37, stamp)
        assert open_frame(fernet, token) == (stamp, b"x" * 37)
