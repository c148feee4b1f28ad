"""A controller asks "do I lead?" from its event loop several times a second (the leader loop,
every heartbeat's handler, the forwarding of writes): it reads pysyncobj's state attribute, not
``getStatus()``, a dump of about twenty entries walking the peers' indexes (issue 36's profile
of an idle leader: a tenth of its event loop)."""

from __future__ import annotations

import socket
import time
from pathlib import Path

from controller.raft_journal import make_guarded_node
from controller.raft_node import RaftNode, raft_conf


def test_is_leader_and_leader_raft_read_state_not_the_status_dump(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    conf = raft_conf(
        password="pw", journal_file=str(tmp_path / "j"), dump_file=str(tmp_path / "d"),
        autoTick=False,
    )  # fmt: skip
    node = make_guarded_node(f"127.0.0.1:{port}", [], conf=conf)
    try:
        deadline = time.monotonic() + 10
        while not node._isLeader() and time.monotonic() < deadline:
            node.doTick(0.01)
        raft = RaftNode.__new__(RaftNode)
        raft.node = node

        def dump() -> dict:
            raise AssertionError("getStatus() called")

        node.getStatus = dump  # type: ignore[method-assign]
        assert raft.is_leader()
        assert raft.leader_raft() == f"127.0.0.1:{port}"
        node._SyncObj__raftState = 0  # a follower now
        assert not raft.is_leader()
    finally:
        node.destroy()
