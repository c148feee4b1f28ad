"""Entries that ride the leader's next heartbeat instead of an append of their own (issue 36:
idle costs nothing).

pysyncobj, unbatched, appends a command at once: the caller's thread wakes the Raft thread
through its pipe, which appends the entry and sends it to every follower in an append of its
own; each follower wakes and answers. An idle cluster's entries are its lease renewal rounds
(controller/renewals.py, one for every few server heartbeats): each cost the leader's Raft
thread three wake-ups (the pipe and both answers) and each follower one, beside the heartbeats
that go out every ``appendEntriesPeriod`` anyway.

A call made through `RidingAppends.ride_next_append` is instead held here until the leader's
next heartbeat is due: the Raft thread then queues it as pysyncobj would have (no pipe) and its
append *is* that heartbeat (the heartbeat's own send is skipped), so the followers' answers to
it carry the entry's acknowledgement. The entry waits at most one ``appendEntriesPeriod``
(150 ms by default); nothing else changes: it is proposed, committed and applied as before, with
the arguments it was called with (a renewal round's clock was read before it was proposed, so
its leases are timed no later: adamps/core/lease.py). A node that does not lead when the
entry's turn comes hands it to pysyncobj at once, which forwards or refuses it as it does any
command. Other writes (registrations, role changes, grants) do not wait: failover times are
those of docs/operations.md.

Mixed into ``raft_journal.GuardedSyncObj`` (pysyncobj 0.3's private names, pinned below 0.4;
tests/integration/test_raft_riding.py checks them against a real node).
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Callable
from typing import Any

from pysyncobj import FAIL_REASON
from pysyncobj.monotonic import monotonic

#: pysyncobj's state of a leader
RAFT_LEADER = 2
#: seconds before the heartbeat's due time at which a tick counts as its (the tick thread's
#: wait ends on a millisecond clock: a tick a little early must not leave the entry a period)
SLACK = 0.002


class RidingAppends:
    """The held calls of a SyncObj subclass (see the module doc). `_release_riding` runs on the
    Raft thread at the start of each tick; the others on any thread."""

    def _riding_init(self) -> None:
        """Called before SyncObj.__init__ starts the Raft thread."""
        #: (command, callback) held for the leader's next heartbeat
        self._riding: list[tuple[bytes, Any]] = []
        self._riding_lock = threading.Lock()
        #: set on the thread making a call through `ride_next_append`, while it makes it
        self._riding_call = threading.local()
        #: entries that rode a heartbeat (for tests and /status)
        self.rode = 0

    def ride_next_append(self, propose: Callable[[], None]) -> None:
        """Makes `propose` (a replicated method's call with its callback) on this thread, its
        entry held for the leader's next heartbeat."""
        self._riding_call.active = True
        try:
            propose()
        finally:
            self._riding_call.active = False

    def _applyCommand(  # noqa: N802 - pysyncobj's name
        self,
        command: bytes,
        callback: Any,
        commandType: Any = None,  # noqa: N803
    ) -> None:
        if getattr(self._riding_call, "active", False):
            # as pysyncobj's _applyCommand queues it: the type's byte first
            held = command if commandType is None else struct.pack("B", commandType) + command
            with self._riding_lock:
                self._riding.append((held, callback))
            return
        super()._applyCommand(command, callback, commandType)  # type: ignore[misc]

    def _release_riding(self) -> None:
        """Raft thread, before a tick: the held entries go when this tick sends the heartbeat
        (they are then its append), or at once on a node that does not lead."""
        if not self._riding:
            return
        leader = self._SyncObj__raftState == RAFT_LEADER  # type: ignore[attr-defined]
        now = monotonic()
        if leader and now + SLACK < self._SyncObj__newAppendEntriesTime:  # type: ignore[attr-defined]
            return
        with self._riding_lock:
            riding, self._riding = self._riding, []
        queue = self._SyncObj__commandsQueue  # type: ignore[attr-defined]
        for command, callback in riding:
            try:
                queue.put_nowait((command, callback))
            except Exception:  # the queue is full: refused as pysyncobj refuses it
                if callback is not None:
                    callback(None, FAIL_REASON.QUEUE_FULL)
                continue
            self.rode += 1
        if leader:
            # This tick's commands are appended and sent (_checkCommandsToApply, unbatched):
            # that append is the heartbeat, whose own send is skipped.
            self._SyncObj__newAppendEntriesTime = now + self.conf.appendEntriesPeriod  # type: ignore[attr-defined]
