"""A follower answers the leader's empty heartbeats at most every `answer_every` (issue 36: idle
costs nothing).

pysyncobj's follower answers every append, heartbeats included, with ``next_node_idx``: with
appends every ``appendEntriesPeriod`` (150 ms), each follower sends about 6.7 answers a second
and the leader's Raft thread wakes for them. An answer to an append that carried no entry, when
the previous answer to that leader said the same (the same next index, success, no reset), tells
the leader nothing new but that the follower is alive, which only the leader's step-down needs:
it steps down when no majority answered for ``leaderFallbackTimeout`` (1 s). So such an answer
is sent only once `answer_every` (``leaderFallbackTimeout`` / 4) has passed since the last:
about every other heartbeat, still three or more answers per fallback window. Everything else
is answered at once, as before: an append with entries (or a snapshot, or a part of one), a
refusal, a reset, a new next index (a commit waits for nothing it waited for before).

What the followers' failure detection sees is unchanged: every heartbeat still goes out and
still pushes a follower's election deadline on. Mixed into ``raft_journal.GuardedSyncObj``
(pysyncobj 0.3's private names, pinned below 0.4; tests/integration/test_raft_riding.py counts
the answers against a real node).
"""

from __future__ import annotations

from typing import Any

from pysyncobj.monotonic import monotonic

#: answers to empty heartbeats per leader fallback window at most (one every window / this)
ANSWERS_PER_FALLBACK = 4


class ThinAnswers:
    """A follower's answers to the leader (see the module doc). Raft thread only."""

    def _answers_init(self) -> None:
        """Called before SyncObj.__init__ starts the Raft thread."""
        #: leader node -> ((next index, reset, success), when) of the last answer sent to it
        self._answered: dict[Any, tuple[tuple[int, bool, bool], float]] = {}
        #: the append being handled carried entries or a snapshot: its answer goes at once
        self._answer_now = True
        #: answers to empty heartbeats left out (for tests and /status)
        self.answers_skipped = 0

    def _note_append(self, message: Any) -> None:
        """Before pysyncobj handles `message`: whether its answer may be left out."""
        self._answer_now = not (
            isinstance(message, dict)
            and message.get("type") == "append_entries"
            and not message.get("entries")
            and "serialized" not in message
            and "transmission" not in message
        )

    def _SyncObj__sendNextNodeIdx(  # noqa: N802 - overrides a mangled name
        self,
        node: Any,
        reset: bool = False,
        nextNodeIdx: int | None = None,  # noqa: N803 - pysyncobj's name
        success: bool = False,
    ) -> None:
        if nextNodeIdx is None:
            nextNodeIdx = self._SyncObj__getCurrentLogIndex() + 1  # type: ignore[attr-defined]  # noqa: N806
        said = (nextNodeIdx, reset, success)
        now = monotonic()
        last = self._answered.get(node)
        every = self.conf.leaderFallbackTimeout / ANSWERS_PER_FALLBACK  # type: ignore[attr-defined]
        if (
            not self._answer_now
            and success
            and not reset
            and last is not None
            and last[0] == said
            and now - last[1] < every
        ):
            self.answers_skipped += 1
            return
        self._answered[node] = (said, now)
        super()._SyncObj__sendNextNodeIdx(node, reset, nextNodeIdx, success)  # type: ignore[misc]
