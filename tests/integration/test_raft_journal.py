"""The controller's Raft journal (controller/raft_journal.py, issue 39 finding 5): pysyncobj's
file format both ways, a full disk as an error rather than SIGBUS, and the pysyncobj members the
guarded node overrides. tests/chaos/test_controller_disk.py runs three controllers on it."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pysyncobj.syncobj as ps_syncobj
import pytest
from pysyncobj import SyncObj
from pysyncobj.journal import FileJournal

from adamps.up.procs import free_port
from controller.raft_journal import RAFT_FOLLOWER, DiskJournal, GuardedSyncObj, make_guarded_node
from controller.raft_node import raft_conf
from controller.state import state_digest
from tests.chaos import disks
from tests.integration.raft_hand import hand_ticked

ROOT = Path(__file__).resolve().parents[2]


def entries(j) -> list[tuple]:
    return [tuple(j[i]) for i in range(len(j))]


# pysyncobj's own journal leaves its meta file to the garbage collector (open(...).read())
@pytest.mark.filterwarnings("ignore::ResourceWarning")
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_the_journal_reads_and_writes_pysyncobjs_format(tmp_path: Path) -> None:
    path = str(tmp_path / "raft.journal")
    theirs = FileJournal(path)
    for i in range(1, 60):
        theirs.add(b"entry %d " % i * 7, i, 1 + i // 20)
    theirs.setCurrentTerm(3, "127.0.0.1:1")
    theirs.setRaftCommitIndex(41)
    theirs.onOneSecondTimer()
    written = entries(theirs)
    theirs._destroy()

    ours = DiskJournal(path)
    assert entries(ours) == written
    assert (ours.getCurrentTerm(), ours.getVotedForNodeId(), ours.getRaftCommitIndex()) == (
        3,
        "127.0.0.1:1",
        41,
    )
    # Every way the log changes: truncation of the tail, appends, compaction of the head.
    ours.deleteEntriesFrom(50)
    ours.add(b"new", 51, 4)
    ours.deleteEntriesTo(12)
    ours.setCurrentTerm(4, None)
    ours.setRaftCommitIndex(45)
    ours.onOneSecondTimer()
    kept = entries(ours)
    assert kept[0][1] == 13 and kept[-1] == (b"new", 51, 4) and len(kept) == 39
    assert ours.state() == {
        "writable": True,
        "error": None,
        "write_failures": 0,
        "bytes": ours.state()["bytes"],
    }
    ours._destroy()

    again = FileJournal(path)
    assert entries(again) == kept
    assert (again.getCurrentTerm(), again.getRaftCommitIndex()) == (4, 45)
    again._destroy()
    last = DiskJournal(path)
    assert entries(last) == kept
    last._destroy()


FULL_DISK = textwrap.dedent(
    """
    import json, sys, time
    from pathlib import Path
    from controller import raft_journal
    from controller.raft_journal import DiskJournal
    from tests.chaos import disks

    at = Path(sys.argv[1])
    raft_journal.PROBE_EVERY = 0.0
    j = DiskJournal(str(at / "raft.journal"), reserve=64 << 10)
    j.add(b"first", 1, 1)
    disks.fill(at)
    out = {"added": 0}
    try:
        for i in range(2, 100_000):  # far more than the reserve holds
            j.add(b"x" * 1000, i, 1)
            out["added"] += 1
    except OSError as exc:
        out["raised"] = exc.errno
    out["full"] = j.state()
    try:
        j.setCurrentTerm(7, "me")
    except OSError as exc:
        out["term_raised"] = exc.errno
    out["term_after_failure"] = j.getCurrentTerm()
    disks.unfill(at)
    j.onOneSecondTimer()  # the probe
    out["freed"] = j.state()
    j.add(b"after", out["added"] + 2, 2)
    j.setCurrentTerm(8, None)
    n = len(j)
    j._destroy()
    again = DiskJournal(str(at / "raft.journal"))
    out["reopened"] = [len(again) == n, again[-1][0].decode(), again.getCurrentTerm()]
    print(json.dumps(out))
    """
)


def test_a_full_disk_is_an_error_never_sigbus_and_the_journal_notices_space_return(
    tmp_path: Path,
) -> None:
    reason = disks.cannot_mount()
    if reason:
        pytest.skip(reason)
    at = tmp_path / "fs"
    at.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(at)], check=True)
    try:
        # A child process: pysyncobj's own journal dies there with SIGBUS (-7).
        res = subprocess.run(
            [sys.executable, "-c", FULL_DISK, str(at)],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
    finally:
        subprocess.run(["umount", "-l", str(at)], capture_output=True, timeout=30)
    assert res.returncode == 0, f"exit {res.returncode}: {res.stderr[-2000:]}"
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["raised"] == 28, out  # ENOSPC, after the records the reserve held
    assert out["added"] >= 60, out  # 64 KiB of reserve: ~60 records of 1 KB still fit
    assert out["full"]["writable"] is False and "disk is full" in out["full"]["error"], out
    assert out["full"]["write_failures"] >= 1
    assert out["term_raised"] == 28 and out["term_after_failure"] == 0, out
    assert out["freed"]["writable"] is True and out["freed"]["error"] is None, out
    assert out["reopened"] == [True, "after", 8], out


@pytest.mark.filterwarnings("ignore::ResourceWarning")
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_the_pysyncobj_members_the_guarded_node_overrides_exist(tmp_path: Path) -> None:
    """pysyncobj is pinned below 0.4: these private names are what raft_journal.py relies on."""
    for name in ("_SyncObj__onMessageReceived", "_SyncObj__setState", "_onTick", "_isLeader"):
        assert callable(getattr(SyncObj, name, None)), name
    assert callable(ps_syncobj.createJournal)
    assert ps_syncobj._RAFT_STATE.FOLLOWER == RAFT_FOLLOWER
    conf = raft_conf(
        password="pw",
        journal_file=str(tmp_path / "raft.journal"),
        dump_file=str(tmp_path / "raft.dump"),
        autoTick=False,
    )
    node = make_guarded_node(f"127.0.0.1:{free_port()}", [], conf=conf)
    try:
        assert isinstance(node, GuardedSyncObj) and isinstance(node.journal, DiskJournal)
        names = vars(node)
        for name in (
            "_SyncObj__raftLog",
            "_SyncObj__raftLeader",
            "_SyncObj__raftCurrentTerm",
            "_SyncObj__votedForNodeId",
            "_SyncObj__raftElectionDeadline",
        ):
            assert name in names, name
        # The substitution was for that one constructor call.
        assert ps_syncobj.createJournal is not None
        other = ps_syncobj.createJournal(str(tmp_path / "other.journal"))
        assert type(other) is FileJournal
        other._destroy()
    finally:
        node.destroy()


def test_pysyncobjs_truncation_of_applied_entries_after_a_stale_reply_is_no_divergence(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """pysyncobj's `CRITICAL ... truncating already-applied log entries ... may have diverged`
    (seen by the testers after a controller restarted): a follower's late `next_node_idx` reply
    (reset) makes the leader send again entries the follower already appended and applied, and
    pysyncobj drops the follower's whole suffix after `prevLogIdx` even though it matches. The
    dropped entries are committed, so the leader sends them again unchanged; the applied state
    does not go back and nothing is applied twice. Three real nodes on loopback, the
    controller's replicated state, ticked by hand; the stale reply is delivered to the leader
    as the transport would."""
    h = hand_ticked(tmp_path)
    addrs, clusters, nodes, tick_until = h.addrs, h.clusters, h.nodes, h.tick_until

    def digests() -> set[str]:
        return {c.read(state_digest) for c in clusters}

    def commit(k: int) -> None:
        done: list[int] = []
        leader = next(i for i, n in enumerate(nodes) if n._isLeader())
        for j in range(k):
            clusters[leader].report_progress(
                j, f"r{j}", 0.5, False, 1000.0 + j, callback=lambda res, err: done.append(err)
            )
        tick_until(lambda: len(done) == k)
        assert set(done) == {0}  # FAIL_REASON.SUCCESS
        tick_until(lambda: len({n.raftLastApplied for n in nodes}) == 1)

    try:
        tick_until(lambda: any(n._isLeader() for n in nodes))
        commit(20)
        leader = next(n for n in nodes if n._isLeader())
        i = next(i for i, n in enumerate(nodes) if n is not leader)
        follower = nodes[i]
        applied = follower.raftLastApplied
        assert len(digests()) == 1
        # The follower's late reply to an append it once could not take: "resend from here".
        peer = next(p for p in leader.otherNodes if p.address == addrs[i])
        caplog.set_level(logging.CRITICAL, logger="pysyncobj.syncobj")
        leader._SyncObj__onMessageReceived(
            peer,
            {
                "type": "next_node_idx",
                "reset": True,
                "next_node_idx": applied - 5,
                "success": False,
            },
        )
        tick_until(lambda: "may have diverged" in caplog.text, 5)
        commit(5)
        assert follower.raftLastApplied >= applied + 5
        assert len(digests()) == 1, "the members' states differ"
        # 25 entries applied once each on every member (the model counts its applies).
        assert {c.read(lambda m: m.applied) for c in clusters} == {25}
    finally:
        h.destroy()
