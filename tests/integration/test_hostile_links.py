"""Issue 28, item 5: every accept loop survives any input. The model-parallel leader's accept
loop (trainer/partitioned.py) gets malformed hellos from strangers and still accepts its real
followers, which connect the way `adamps train --partition k` does (PartitionFollower._connect);
the data plane's listener gets garbage and keeps serving."""

from __future__ import annotations

import dataclasses
import socket
import struct
import threading
import time
from typing import Any

import msgpack
import pytest

from adamps.up.procs import free_port
from trainer.config import TrainConfig
from trainer.exchange import token_digest
from trainer.partition_follower import PartitionFollower
from trainer.partitioned import PartitionLeader

TOKEN = "links-token"


def _send_hello(port: int, body: bytes, length: int | None = None) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        # the control link's frame: an 8-byte big-endian length, then the msgpack body
        s.sendall(struct.pack("!Q", len(body) if length is None else length) + body)
        s.settimeout(5)
        try:  # the leader refuses (closes); wait for that so the cases run one after another
            while s.recv(4096):
                pass
        except OSError:
            pass


def _hello(**fields: Any) -> bytes:
    msg = {"op": "hello", "partition": 1, "replica": 0, "digest": token_digest(TOKEN), **fields}
    return msgpack.packb(msg, use_bin_type=True)


HOSTILE = [
    _hello(digest="not bytes"),
    _hello(digest=1 << 40),
    _hello(digest=[1, 2, 3]),
    _hello(partition=[1]),
    _hello(partition="1"),
    _hello(partition=(1 << 64) - 1),
    _hello(partition=True),
    _hello(partition=7),
    _hello(digest=b"\0" * 32),
    msgpack.packb([1, 2, 3]),
    msgpack.packb(42),
    b"\xc1\xc1garbage",
    b"",
]


@pytest.mark.timeout(60)
def test_the_partition_leader_survives_any_hello_and_its_followers_join() -> None:
    base = free_port()
    addrs = [f"127.0.0.1:{base}", "127.0.0.1:1", "127.0.0.1:2"]
    cfg = TrainConfig(
        token=TOKEN,
        ps=["http://127.0.0.1:1"],
        partitions=3,
        partition=0,
        partition_addrs=addrs,
        wait_timeout=30,
    )
    leader = PartitionLeader(cfg)
    failure: list[BaseException] = []

    def accept() -> None:
        try:
            leader._accept_followers()
        except BaseException as exc:  # noqa: BLE001 - reported to the test below
            failure.append(exc)

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    deadline = time.monotonic() + 10
    while True:  # until the leader listens
        try:
            socket.create_connection(("127.0.0.1", base), timeout=1).close()
            break
        except OSError:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    for body in HOSTILE:
        _send_hello(base, body)
        assert t.is_alive() and not failure, (body[:40], failure)
    _send_hello(base, b"x" * 10, length=1 << 30)  # a length beyond the hello's limit
    followers = [PartitionFollower(dataclasses.replace(cfg, partition=k)) for k in (1, 2)]
    links = [f._connect() for f in followers]
    t.join(20)
    assert not t.is_alive() and not failure, failure
    assert sorted(leader.followers) == [1, 2]
    for ctl in [*links, *leader.followers.values()]:
        ctl.close()
