"""The Raft journal on the controller's disk, and a node that stands aside when it cannot write it
(issue 39, finding 5).

pysyncobj's FileJournal memory-maps the journal and grows the file with ``ftruncate``, which on a
full disk succeeds and leaves a hole: the next store into the mapping faults, and the kernel kills
the process with SIGBUS. Its term/vote/commit-index file (``.meta``) fails with ENOSPC instead,
once a second, and the node went on acting on what it had not recorded.

`DiskJournal` writes the same file format (a journal written by either reads in the other) with
plain ``pwrite`` into space reserved ahead with ``posix_fallocate``: a full disk is an OSError,
never a signal. It keeps `RESERVE` bytes allocated beyond its end; once it cannot, or once any
write of the journal or of its meta file fails, it is *unwritable*: it says so (`state()`), and
`GuardedSyncObj` stands aside until a probe (once a second) finds room again:

- a leader steps down (handing over to a caught-up follower at once, Raft's TimeoutNow), while
  the reserve still holds what it already accepted;
- it stands for no election and grants no vote (a vote must be recorded before it is sent), and
  acknowledges no append (an entry must be in the journal before it is acknowledged): to the
  others it is as if it were unreachable, so the two others go on as a majority;
- it still learns who leads, so the writes it receives are forwarded there.

Once the disk has room again it takes appends again, and the leader brings it up to date (or
sends its snapshot). Nothing it acknowledged was ever unrecorded, so it cannot diverge.

pysyncobj builds its journal with the module-level ``createJournal`` inside ``SyncObj.__init__``;
`make_guarded_node` substitutes `DiskJournal` for that call only, under a lock. The overridden
private methods (``_SyncObj__onMessageReceived`` ...) are pysyncobj 0.3's (pinned below 0.4;
tests/integration/test_raft_journal.py checks that they exist).
"""

from __future__ import annotations

import errno
import logging
import os
import struct
import threading
import time
from typing import Any

import pysyncobj.syncobj as ps_syncobj
from pysyncobj import SyncObj
from pysyncobj.journal import (
    APP_NAME,
    APP_VERSION,
    FIRST_RECORD_OFFSET,
    JOURNAL_FORMAT_VERSION,
    LAST_RECORD_OFFSET_OFFSET,
    NAME_SIZE,
    VERSION_SIZE,
    Journal,
)
from pysyncobj.monotonic import monotonic
from pysyncobj.pickle import dumps, loads, to_bytes

from controller import raft_timing
from controller.raft_answers import ThinAnswers
from controller.raft_riding import RidingAppends

log = logging.getLogger("controller.raft")

#: bytes kept allocated beyond the journal's end: what a leader accepted before it noticed it
#: cannot grow the file still fits, and a step down needs no write
RESERVE = 1 << 20
#: messages whose handling writes the journal or the meta file (term, vote)
NEEDS_JOURNAL = frozenset({"append_entries", "request_vote", "timeout_now"})
#: pysyncobj's state of a follower (getStatus()["state"]: 0 follower, 1 candidate, 2 leader)
RAFT_FOLLOWER = 0
RAFT_LEADER = 2
#: seconds between probes of an unwritable journal
PROBE_EVERY = 1.0
_REC = struct.Struct("<I")
_IDX_TERM = struct.Struct("<QQ")


#: pysyncobj's journal header: app name, its version, format version, end of the last record
HEADER = (
    APP_NAME.ljust(NAME_SIZE, b"\0")
    + APP_VERSION.ljust(VERSION_SIZE, b"\0")
    + struct.pack("<II", JOURNAL_FORMAT_VERSION, FIRST_RECORD_OFFSET)
)


def _pwrite_all(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


class DiskJournal(Journal):
    """pysyncobj's journal file, written with pwrite into space allocated ahead (module doc).
    Called by the Raft thread only; `state()` may be read from any thread."""

    def __init__(self, path: str, reserve: int = RESERVE) -> None:
        self.path = path
        self.reserve = reserve
        self._meta_path = path + ".meta"
        #: (command, index, term) of every record, and the file offset where each begins
        self._entries: list[tuple[bytes, int, int]] = []
        self._offsets: list[int] = []
        #: why the journal cannot be written now (None: it can)
        self.error: str | None = None
        #: writes (journal or meta) that failed since start
        self.failures = 0
        self._next_probe = 0.0
        #: a truncation or rewrite failed: the file is behind the entries in memory, and is
        #: written again in full before anything else is appended (or the probe succeeds)
        self._dirty = False
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        size = os.fstat(self._fd).st_size
        if size < FIRST_RECORD_OFFSET:
            _pwrite_all(self._fd, HEADER, 0)  # a new journal: a full disk fails the start
            size = FIRST_RECORD_OFFSET
        data = os.pread(self._fd, size, 0)
        (last,) = _REC.unpack_from(data, LAST_RECORD_OFFSET_OFFSET)
        at = FIRST_RECORD_OFFSET
        while at < last:
            (n,) = _REC.unpack_from(data, at)
            idx, term = _IDX_TERM.unpack_from(data, at + 4)
            self._entries.append((data[at + 4 + _IDX_TERM.size : at + 4 + n], idx, term))
            self._offsets.append(at)
            at += n + 8
        self._end = at
        #: bytes of the file known to be allocated (a journal pysyncobj grew may have holes)
        self._allocated = 0
        self._meta: dict[str, Any] = {}
        try:
            with open(self._meta_path, "rb") as f:
                self._meta = loads(f.read())
        except (OSError, EOFError, ValueError):
            pass  # no meta yet (pysyncobj's reading is as lenient)
        self._meta_saved = True
        try:
            self._allocate(self._end + self.reserve)
        except OSError as exc:
            self._failed("reserve space for", exc)

    # -- the Journal interface (pysyncobj's names) ---------------------------------------------

    def add(self, command: bytes, idx: int, term: int) -> None:
        if self._dirty:
            self._rewrite()
        body = _IDX_TERM.pack(idx, term) + to_bytes(command)
        n = _REC.pack(len(body))
        self._write_records(self._end, n + body + n)
        self._offsets.append(self._end)
        self._entries.append((command, idx, term))
        self._end += len(body) + 8
        if self.error is None and self._allocated - self._end < self.reserve:
            try:
                self._allocate(self._end + 2 * self.reserve)
            except OSError as exc:  # the record is written; the next ones may not be
                self._failed("reserve space for", exc)

    def clear(self) -> None:
        self.deleteEntriesFrom(0)

    def deleteEntriesFrom(self, entryFrom: int) -> None:  # noqa: N802 - pysyncobj's name
        """Drops the records from `entryFrom` on: the end-of-records mark moves back. Memory
        first: if the mark cannot be written, the file is rewritten before the next append."""
        if entryFrom >= len(self._entries):
            return
        self._end = self._offsets[entryFrom]
        del self._entries[entryFrom:], self._offsets[entryFrom:]
        if self._dirty:
            self._rewrite()
            return
        try:
            _pwrite_all(self._fd, _REC.pack(self._end), LAST_RECORD_OFFSET_OFFSET)
        except OSError as exc:
            self._dirty = True
            self._failed("truncate", exc)
            raise

    def deleteEntriesTo(self, entryTo: int) -> None:  # noqa: N802 - pysyncobj's name
        """Drops the first `entryTo` records (after a full dump): the rest is written again from
        the start, into space the file already holds."""
        self._entries = self._entries[entryTo:]
        self._rewrite()

    def __getitem__(self, item: Any) -> Any:
        return self._entries[item]

    def __len__(self) -> int:
        return len(self._entries)

    def _destroy(self) -> None:
        os.close(self._fd)

    def flush(self) -> None:
        os.fsync(self._fd)

    def setRaftCommitIndex(self, raftCommitIndex: int) -> None:  # noqa: N802
        self._meta["raftCommitIndex"] = raftCommitIndex
        self._meta_saved = False

    def getRaftCommitIndex(self) -> int:  # noqa: N802
        return self._meta.get("raftCommitIndex", 1)

    def setCurrentTerm(self, term: int, votedForNodeId: Any) -> None:  # noqa: N802
        """Recorded before it is acted on (a vote is sent only once it is on disk); when it
        cannot be, the meta keeps the recorded values and the error is raised."""
        meta = {**self._meta, "currentTerm": term, "votedForNodeId": votedForNodeId}
        try:
            self._store_meta(meta)
        except OSError as exc:
            self._failed("record the term and vote in", exc)
            raise
        self._meta, self._meta_saved = meta, True

    def getCurrentTerm(self) -> int:  # noqa: N802
        return self._meta.get("currentTerm", 0)

    def getVotedForNodeId(self) -> Any:  # noqa: N802
        return self._meta.get("votedForNodeId", None)

    def onOneSecondTimer(self) -> None:  # noqa: N802
        if self.error is not None:
            self.probe()
        elif not self._meta_saved:
            try:
                self._store_meta(self._meta)
                self._meta_saved = True
            except OSError as exc:  # the commit index is learned again from the leader
                self._failed("record the commit index in", exc)

    # -- space and failures ------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        return {
            "writable": self.error is None,
            "error": self.error,
            "write_failures": self.failures,
            "bytes": self._end,
        }

    def probe(self) -> bool:
        """Whether the journal can be written again: its reserve allocated and its meta stored.
        At most once per PROBE_EVERY."""
        now = monotonic()
        if now < self._next_probe:
            return False
        self._next_probe = now + PROBE_EVERY
        try:
            if self._dirty:
                self._rewrite()
            self._allocate(self._end + 2 * self.reserve)
            self._store_meta(self._meta)
        except OSError as exc:
            self.error = self._describe("write", exc)
            return False
        log.warning("raft journal %s can be written again: this controller takes part", self.path)
        self.error, self._meta_saved = None, True
        return True

    def _allocate(self, upto: int) -> None:
        """Allocates the file up to `upto` (from 0 the first time: holes fault like a full disk)."""
        if upto > self._allocated:
            os.posix_fallocate(self._fd, self._allocated, upto - self._allocated)
            self._allocated = upto

    def _write_records(self, at: int, blob: bytes) -> None:
        """Writes `blob` at `at`, then moves the end-of-records mark past it (a torn write is
        never read: the mark still ends before it)."""
        try:
            self._allocate(at + len(blob))
            _pwrite_all(self._fd, blob, at)
            _pwrite_all(self._fd, _REC.pack(at + len(blob)), LAST_RECORD_OFFSET_OFFSET)
        except OSError as exc:
            self._failed("append to", exc)
            raise

    def _rewrite(self) -> None:
        """Writes every record in memory again from the start. Like pysyncobj, the mark says
        "no records" while they are written: a crash then leaves the full dump to start from."""
        blob, offsets, at = bytearray(), [], FIRST_RECORD_OFFSET
        for command, idx, term in self._entries:
            body = _IDX_TERM.pack(idx, term) + to_bytes(command)
            n = _REC.pack(len(body))
            offsets.append(at)
            blob += n + body + n
            at += len(body) + 8
        self._offsets, self._end = offsets, at
        try:
            _pwrite_all(self._fd, _REC.pack(FIRST_RECORD_OFFSET), LAST_RECORD_OFFSET_OFFSET)
            self._allocate(at)
            _pwrite_all(self._fd, bytes(blob), FIRST_RECORD_OFFSET)
            _pwrite_all(self._fd, _REC.pack(at), LAST_RECORD_OFFSET_OFFSET)
        except OSError as exc:
            self._dirty = True
            self._failed("rewrite", exc)
            raise
        self._dirty = False

    def _store_meta(self, meta: dict[str, Any]) -> None:
        tmp = self._meta_path + ".tmp"
        with open(tmp, "wb") as f:
            f.write(dumps(meta))
        os.replace(tmp, self._meta_path)

    def _describe(self, what: str, exc: OSError) -> str:
        full = " (the disk is full)" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else ""
        return f"cannot {what} {self.path}: {exc.strerror or exc}{full}"

    def _failed(self, what: str, exc: OSError) -> None:
        self.failures += 1
        first = self.error is None
        self.error = self._describe(what, exc)
        self._next_probe = monotonic() + PROBE_EVERY
        if first:
            log.error(
                "raft journal: %s. This controller stands aside (it does not lead, vote or "
                "acknowledge entries) until it can write again; free space in its data_dir "
                "(docs/operations.md, A controller's disk)",
                self.error,
            )


class GuardedSyncObj(ThinAnswers, RidingAppends, SyncObj):
    """A SyncObj that stands aside while its `DiskJournal` cannot be written (module doc), whose
    renewal rounds ride the heartbeats (controller/raft_riding.py) and whose followers answer
    empty heartbeats every other one (controller/raft_answers.py)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._riding_init()  # before the Raft thread starts (in SyncObj.__init__)
        self._answers_init()
        super().__init__(*args, **kwargs)

    @property
    def journal(self) -> Journal:
        return self._SyncObj__raftLog  # type: ignore[attr-defined]

    def leads(self) -> bool:
        """This node is the leader now: one attribute read. ``getStatus()`` builds a dump of
        about twenty entries (walking the peers' indexes), and the event loop asks several times
        a second: a tenth of an idle leader's loop (issue 36's profile)."""
        return self._isLeader()

    def leader_node(self) -> Any:
        """The last leader this node heard of (a pysyncobj Node), or None."""
        return self._getLeader()

    def journal_error(self) -> str | None:
        return getattr(self.journal, "error", None)

    def _onTick(self, timeToWait: float = 0.0) -> None:  # noqa: N802 - pysyncobj's name
        if self.journal_error() is not None:
            self._stand_aside()
        self._release_riding()
        # Waits until this node's next deadline, at most timeToWait (controller/raft_timing.py)
        timeToWait = self._tick_wait(timeToWait)  # noqa: N806
        try:
            super()._onTick(timeToWait)
        except OSError:
            if self.journal_error() is None:
                raise
            # The journal logged the failed write; this step stopped before anything that
            # relied on it was sent. Forget a term or vote that was not recorded.
            self._forget_unrecorded()
            time.sleep(timeToWait)

    def _tick_wait(self, longest: float) -> float:
        conf = self.conf
        return raft_timing.tick_wait(
            monotonic(),
            leader=self._SyncObj__raftState == RAFT_LEADER,  # type: ignore[attr-defined]
            next_append=self._SyncObj__newAppendEntriesTime,  # type: ignore[attr-defined]
            period=conf.appendEntriesPeriod,
            election_deadline=self._SyncObj__raftElectionDeadline,  # type: ignore[attr-defined]
            election_min=conf.raftMinTimeout,
            longest=longest,
        )

    def _SyncObj__applyLogEntries(self) -> bool:  # noqa: N802 - overrides a mangled name
        """Applies the committed entries as pysyncobj does, and never asks for an append at once
        for it: unbatched, pysyncobj sent one to every follower after every entry the leader
        applied, only to carry the new commit index, and each follower answered it. The next
        append (a new entry, or the heartbeat due within ``appendEntriesPeriod``) carries it:
        followers apply an entry at most one append period later, the leader's commit (and the
        caller's answer) is not delayed, and an idle leader's renewal rounds cost one exchange
        per follower instead of two (issue 36: idle costs nothing)."""
        super()._SyncObj__applyLogEntries()  # type: ignore[misc]
        return False

    def _SyncObj__onMessageReceived(self, node: Any, message: Any) -> None:  # noqa: N802
        kind = message.get("type") if isinstance(message, dict) else None
        if self.journal_error() is not None and kind in NEEDS_JOURNAL:
            # As if unreachable: no acknowledgement, no vote. Only who leads is noted, so
            # that writes sent to this controller are forwarded there.
            if kind == "append_entries" and message.get("term", -1) >= self.raftCurrentTerm:
                self._SyncObj__raftLeader = node
            return
        self._note_append(message)
        try:
            super()._SyncObj__onMessageReceived(node, message)  # type: ignore[misc]
        except OSError:
            if self.journal_error() is None:
                raise
            self._forget_unrecorded()

    def _stand_aside(self) -> None:
        if self._isLeader():
            log.error("raft: stepping down as leader: %s", self.journal_error())
            # Hands over at once to a caught-up follower (Raft's TimeoutNow); without one the
            # others elect a leader after their election timeout.
            self.transferLeadership()
            self._SyncObj__setState(RAFT_FOLLOWER)  # type: ignore[attr-defined]
            self._SyncObj__raftLeader = None
        # No election while a vote cannot be recorded.
        self._SyncObj__raftElectionDeadline = monotonic() + self.conf.raftMaxTimeout

    def _forget_unrecorded(self) -> None:
        """The term and vote in memory become the recorded ones again: pysyncobj sets them
        before it records them, and nothing was sent on their account (the write raised)."""
        journal = self.journal
        recorded = max(journal.getCurrentTerm(), journal[-1][2])
        if self.raftCurrentTerm != recorded:
            self._SyncObj__raftCurrentTerm = recorded
            self._SyncObj__votedForNodeId = journal.getVotedForNodeId()
            if not self._isLeader():
                self._SyncObj__setState(RAFT_FOLLOWER)  # type: ignore[attr-defined]


_FACTORY = threading.Lock()


def make_guarded_node(*args: Any, **kwargs: Any) -> GuardedSyncObj:
    """A GuardedSyncObj whose file journal is a DiskJournal: pysyncobj's module-level
    ``createJournal`` is replaced for the constructor's call only (it builds the journal before
    it starts its thread)."""
    with _FACTORY:
        original = ps_syncobj.createJournal
        ps_syncobj.createJournal = lambda path: (
            original(None) if path is None else DiskJournal(path)
        )
        try:
            return GuardedSyncObj(*args, **kwargs)
        finally:
            ps_syncobj.createJournal = original
