"""Issue 36 (idle costs nothing): a committed entry's new commit index rides on the next append
(a new entry, or the heartbeat due), not on an append of its own. pysyncobj, unbatched, sent
every follower an extra append after each entry the leader applied; an idle cluster's lease
renewal rounds (one entry per server heartbeat) cost two exchanges per follower instead of one.

Three real nodes (GuardedSyncObj, the controller's replicated state) on loopback, ticked by
hand; the leader's appends are counted by whether a heartbeat was due when each was sent."""

from __future__ import annotations

from pathlib import Path

import pytest
from pysyncobj.monotonic import monotonic

from tests.integration.raft_hand import hand_ticked

K = 12


@pytest.mark.filterwarnings("ignore::ResourceWarning")
def test_an_entry_costs_one_append_per_follower_and_followers_still_apply_it(
    tmp_path: Path,
) -> None:
    h = hand_ticked(tmp_path)
    clusters, nodes, tick_until = h.clusters, h.nodes, h.tick_until
    try:
        tick_until(lambda: any(n._isLeader() for n in nodes))
        lead = next(i for i, n in enumerate(nodes) if n._isLeader())
        leader = nodes[lead]
        tick_until(lambda: len({n.raftLastApplied for n in nodes}) == 1)
        sends = {"due": 0, "not_due": 0}
        original = leader._SyncObj__sendAppendEntries

        def counted() -> None:
            due = monotonic() > leader._SyncObj__newAppendEntriesTime
            sends["due" if due else "not_due"] += 1
            original()

        leader._SyncObj__sendAppendEntries = counted  # the instance's: _onTick looks it up there
        done: list[int] = []
        for j in range(K):
            clusters[lead].report_progress(
                j, f"r{j}", 0.5, False, 1000.0 + j, callback=lambda res, err: done.append(err)
            )
            tick_until(lambda j=j: len(done) > j)  # one entry at a time, each committed
        assert done == [0] * K  # FAIL_REASON.SUCCESS
        # one append per new entry (sent at once); the commit index waits for the next one
        assert sends["not_due"] <= K + 1, sends
        # ... and the followers learn it from the heartbeat: every member applies every entry
        tick_until(lambda: len({n.raftLastApplied for n in nodes}) == 1, 5)
        assert {c.read(lambda m: m.applied) for c in clusters} == {
            clusters[lead].read(lambda m: m.applied)
        }
    finally:
        h.destroy()
