"""The parameter store: shards in memory, each mutated by exactly one owner thread (Adam 3.3.1).

Who may mutate what:

- ``Store.tensors`` / ``Store.layout`` / ``Store.shards``: the event-loop thread only (create, load);
  owner threads never look them up, they receive the :class:`ShardState` inside a work item.
- A :class:`ShardState`'s values, accumulator, version and dirty mark: its owner thread only
  (shard -> owner by a stable hash). No locks on the update path.
- Reads (pulls, flush snapshots) are work items on the owner's queue too, so a reader always sees a
  whole batch applied or not at all, with the matching version, never a torn shard.

An owner thread drains its queue, groups the updates per shard in arrival order, and applies each
shard's group as one batch (``optim.apply_batch``): a 1 MB shard's updates while it is hot in
cache. A read or snapshot item is a barrier: the updates queued before it are applied first.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry

from adamps.layout import MAX_SHARD_ELEMS, Layout, Shard, TensorSpec, stable_bucket
from adamps.server.store import shardrecord
from adamps.server.store.cut_copies import keep
from adamps.server.store.initial import initial_values
from adamps.server.store.shards import ShardState, Snapshot, StoreError, TensorState
from adamps.server.store.tables.rowtables import RowShardState, RowTables
from adamps.server.store.tickets import Ticket
from adamps.server.updates import install, optim, vecapply
from adamps.server.updates.optim import Fc, Optimizer, Scratch, Signs, initial_state, state_array

log = logging.getLogger(__name__)


# Work items are tuples (cheap to build, no per-item class instance):
#   (_UPDATE, shard_state, update, ticket, kind)
#   (_CALL, fn, ticket)             fn(owner_index) runs on the owner thread
#   (_GROUP, {shard: [update]}, ticket)  one batch per shard, alone (push_group)
#   (_UPDATES, [(shard_state, update)], ticket)  several shards of one push, one owner
#   (_STOP,)
_UPDATE, _CALL, _STOP, _GROUP, _UPDATES = 0, 1, 2, 3, 4


class Store:
    """Tensors -> held shards, the owner threads and their queues."""

    def __init__(
        self,
        *,
        n_buckets: int,
        buckets: Iterable[int] | None = None,
        owner_threads: int = 2,
        max_shard_elems: int = MAX_SHARD_ELEMS,
        clock: Callable[[], float] = time.monotonic,
        on_applied: Callable[[str, int], None] | None = None,
        registry: CollectorRegistry | None = None,
    ) -> None:
        if owner_threads < 1:
            raise ValueError("owner_threads must be >= 1")
        self.layout = Layout([], n_buckets, max_shard_elems)
        #: buckets this server holds (all when None): the static bucket map of this issue
        self.buckets: frozenset[int] | None = None if buckets is None else frozenset(buckets)
        self.tensors: dict[str, TensorState] = {}
        #: shard id -> state (held shards only)
        self.shards: dict[str, ShardState] = {}
        self.clock = clock
        #: embedding tables: their row shards of the held buckets (adamps/server/store/tables/rowtables.py)
        self.tables = RowTables(n_buckets, owner_threads, registry)
        #: runs deleted at the controllers (adamps/server/api/tenancy.py): their updates in flight are refused alone
        self.deleted_runs: frozenset[str] = frozenset()
        self._on_applied = on_applied
        self._queues: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in range(owner_threads)]
        #: items queued to the owner threads (after each; not a flush's copies): Flusher.offer
        self.puts = 0
        #: per owner: shards with updates not yet taken by a snapshot (owner thread only)
        self._dirty: list[set[ShardState]] = [set() for _ in range(owner_threads)]
        self._threads = [
            threading.Thread(target=self._run, args=(i,), name=f"adamps-owner-{i}", daemon=True)
            for i in range(owner_threads)
        ]
        #: per owner: [dense, fc, compressed] updates applied (each written by its owner only)
        self._applied = [[0, 0, 0] for _ in range(owner_threads)]
        for t in self._threads:
            t.start()

    # -- definition (event-loop thread) -----------------------------------------------------------

    def holds(self, shard: Shard) -> bool:
        return self.holds_id(shard.id)

    def holds_id(self, sid: str) -> bool:
        return self.buckets is None or stable_bucket(sid, self.layout.n_buckets) in self.buckets

    def define(
        self,
        spec: TensorSpec,
        optimizer: Optimizer,
        init: dict[str, Any],
        values: np.ndarray | None,
        saved: Mapping[str, tuple[int, np.ndarray, np.ndarray | None]] | None = None,
        own: bool = False,
    ) -> TensorState:
        """Adds a new tensor; its held shards get `saved` state (shard id -> (version, value,
        accum)) or else the initial values. `own`: saved arrays are taken uncopied (adamps/server/storage/catalog.py)."""
        self.layout = self.layout.with_tensor(spec)
        t = TensorState(spec, optimizer, init, layout_shards=self.layout.shards_of[spec.name])
        saved = saved or {}
        whole: np.ndarray | None = None
        for s in t.layout_shards:
            if not self.holds(s):
                continue
            if s.id in saved:
                self._materialize(t, s, *saved[s.id], own=own)
            else:
                if whole is None:
                    whole = initial_values(spec.shape, init, values).reshape(-1)
                self._materialize(t, s, 0, whole[s.start : s.stop], None)
        self.tensors[spec.name] = t
        return t

    def _materialize(self, t: TensorState, s: Shard, *state: Any, own: bool = False) -> ShardState:
        version, value, accum = state  # (int, values, optimizer state or None)
        opt = t.optimizer
        if accum is None and opt.has_accumulator:
            accum = initial_state(opt, s.size)
        take = np.asarray if own else np.array
        st = ShardState(
            s,
            owner=stable_bucket(s.id, len(self._queues)),
            value=take(value, dtype=np.float32, order="C").reshape(s.shape),
            accum=None if accum is None else state_array(opt, s, accum),
            version=version,
        )
        t.shards[s.index] = st
        self.shards[s.id] = st
        return st

    def hold_bucket(self, bucket: int) -> int:
        """Starts holding `bucket` (a replicated server's new copy): materialises its shards of
        every defined tensor from the tensor's initial values, which a state transfer then
        replaces. Returns the number of shards added. Event-loop thread only."""
        if self.buckets is None or bucket in self.buckets:
            return 0
        self.buckets = self.buckets | {bucket}
        self.tables.hold(bucket)
        added = 0
        for t in self.tensors.values():
            mine = [s for s in t.layout_shards if self.layout.bucket_of[s.id] == bucket]
            if not mine:
                continue
            # A tensor defined from given values keeps only their digest: zeros until the
            # transfer (only a bucket placed before any lease, i.e. empty, skips the transfer).
            given = np.zeros(t.spec.shape, np.float32) if t.init["kind"] == "values" else None
            whole = initial_values(t.spec.shape, t.init, given).reshape(-1)
            for s in mine:
                self._materialize(t, s, 0, whole[s.start : s.stop], None)
                added += 1
        return added

    def release_bucket(self, bucket: int) -> int:
        """Stops holding `bucket`: its shards leave the store (work already queued for them
        completes on the detached state, harmlessly). Returns the number of shards dropped."""
        if self.buckets is None or bucket not in self.buckets:
            return 0
        self.buckets = self.buckets - {bucket}
        self.tables.release(bucket)
        dropped = 0
        for t in self.tensors.values():
            for s in t.layout_shards:
                if s.index in t.shards and self.layout.bucket_of[s.id] == bucket:
                    del t.shards[s.index]
                    del self.shards[s.id]
                    dropped += 1
        return dropped

    def forget_tensors(self, names: Iterable[str]) -> int:
        """Removes tensors (a deleted run's, issue 25) and their held shards; returns the number
        of shards dropped. Work already queued for them completes on the detached state, and a
        snapshot of them is not written (Persister.forget_tensors)."""
        gone = {n for n in names if n in self.tensors}
        dropped = 0
        for n in gone:
            for st in self.tensors.pop(n).shards.values():
                self.shards.pop(st.id, None)
                dropped += 1
        if gone:
            kept = [t for n, t in self.layout.tensors.items() if n not in gone]
            self.layout = Layout(kept, self.layout.n_buckets, self.layout.max_shard_elems)
        return dropped

    def tensor(self, name: str) -> TensorState:
        t = self.tensors.get(name)
        if t is None:
            raise StoreError("unknown_tensor", f"no tensor named {name!r}")
        return t

    def shard(self, sid: str) -> ShardState:
        st = self.shards.get(sid)
        if st is None:
            raise StoreError("unknown_shard", f"no shard {sid!r} on this server")
        return st

    # -- updates ----------------------------------------------------------------------------------

    def push(
        self,
        parts: Sequence[tuple[ShardState, optim.Update]],
        on_done: Callable[[dict[str, int], BaseException | None], None],
    ) -> Ticket:
        """Queues one update per shard; on_done({shard id: new version}, error) when all applied.
        One queue item per owner thread, not per shard: a 64-shard push wakes each owner once."""
        ticket = Ticket(len(parts), on_done)
        if len(parts) == 1:
            st, upd = parts[0]
            self._put(st.owner, (_UPDATE, st, upd, ticket))
            return ticket
        by_owner: dict[int, list[tuple[ShardState, optim.Update]]] = {}
        for st, upd in parts:
            by_owner.setdefault(st.owner, []).append((st, upd))
        for owner, items in by_owner.items():
            self._put(owner, (_UPDATES, items, ticket))
        return ticket

    def read(
        self,
        states: Sequence[ShardState],
        outs: Sequence[np.ndarray],
        on_done: Callable[[dict[str, int], BaseException | None], None],
        accums: Sequence[np.ndarray | None] | None = None,
    ) -> Ticket:
        """Copies each shard's values into its `out` (same size) on the owner thread, and its
        Adagrad accumulator into `accums[i]` where that is given and the shard has one;
        on_done({shard id: version}, error). Sees every update queued before it."""
        accs = list(accums) if accums is not None else [None] * len(states)
        by_owner: dict[int, list[tuple[ShardState, np.ndarray, np.ndarray | None]]] = {}
        for st, out, acc in zip(states, outs, accs, strict=True):
            by_owner.setdefault(st.owner, []).append((st, out, acc))
        ticket = Ticket(len(by_owner), on_done)

        for owner, items in by_owner.items():

            def copy(_owner: int, items: list = items) -> None:
                for st, out, acc in items:
                    np.copyto(out.reshape(st.value.shape), st.value)
                    if acc is not None and st.accum is not None:
                        np.copyto(acc.reshape(st.accum.shape), st.accum)
                    ticket.result[st.id] = st.version

            self._put(owner, (_CALL, copy, ticket))
        return ticket

    def call(
        self,
        states: Sequence[ShardState],
        fn: Callable[[ShardState], Any],
        on_done: Callable[[dict[str, Any], BaseException | None], None],
    ) -> Ticket:
        """Runs ``fn(state)`` per shard on its owner thread (sees every update queued before)."""
        by_owner: dict[int, list[ShardState]] = {}
        for st in states:
            by_owner.setdefault(st.owner, []).append(st)
        ticket = Ticket(len(by_owner), on_done)
        for owner, items in by_owner.items():

            def run(_owner: int, items: list = items) -> None:
                for st in items:
                    ticket.result[st.id] = fn(st)

            self._put(owner, (_CALL, run, ticket))
        return ticket

    def mark_dirty(
        self,
        states: Sequence[ShardState],
        on_done: Callable[[dict[str, Any], BaseException | None], None],
    ) -> Ticket:
        """Marks shards dirty, values unchanged, so the next flush rewrites them (the scrub
        found their record on disk damaged; the copy in memory is the replicated one)."""

        def mark(st: ShardState) -> int:
            if isinstance(st, RowShardState):
                st.value.full = True  # a damaged row record: every row is written again
            if st.dirty_since is None:
                st.dirty_since = self.clock()
            self._dirty[st.owner].add(st)
            return st.version

        return self.call(states, mark, on_done)

    def push_group(
        self,
        parts: Sequence[tuple[ShardState, optim.Update]],
        on_done: Callable[[dict[str, int], BaseException | None], None],
    ) -> Ticket:
        """Like push, but the parts are applied as exactly one batch per shard: never merged with
        other queued updates, never split (replication: every replica applies the same batches).
        Updates for one shard keep their order in `parts`."""
        by_owner: dict[int, dict[ShardState, list[optim.Update]]] = {}
        for st, upd in parts:
            by_owner.setdefault(st.owner, {}).setdefault(st, []).append(upd)
        ticket = Ticket(len(by_owner), on_done)
        for owner, groups in by_owner.items():
            self._put(owner, (_GROUP, groups, ticket))
        return ticket

    def overwrite(
        self,
        states: Sequence[ShardState],
        values: Sequence[np.ndarray],
        accums: Sequence[np.ndarray | None],
        versions: Sequence[int],
        on_done: Callable[[dict[str, int], BaseException | None], None],
    ) -> Ticket:
        """Replaces shards' values, accumulators and versions (a state transfer); marks them dirty."""
        for st, v, a in zip(states, values, accums, strict=True):  # checked before anything changes
            if v.size != st.value.size or (
                a is not None and st.accum is not None and a.size != st.accum.size
            ):
                raise StoreError("bad_shape", f"shard {st.id}: state of the wrong size")
        by_owner: dict[int, list[tuple[ShardState, np.ndarray, np.ndarray | None, int]]] = {}
        for st, v, a, ver in zip(states, values, accums, versions, strict=True):
            by_owner.setdefault(st.owner, []).append((st, v, a, ver))
        ticket = Ticket(len(by_owner), on_done)

        for owner, items in by_owner.items():

            def put(o: int, items: list = items) -> None:
                now = self.clock()
                for st, v, a, ver in items:
                    np.copyto(st.value, v.reshape(st.value.shape))
                    if a is not None and st.accum is not None:
                        np.copyto(st.accum, a.reshape(st.accum.shape))
                    st.version = int(ver)
                    if st.dirty_since is None:
                        st.dirty_since = now
                    self._dirty[o].add(st)
                    ticket.result[st.id] = st.version

            self._put(owner, (_CALL, put, ticket))
        return ticket

    def replace(
        self,
        states: Sequence[ShardState],
        fn: Callable[[ShardState], int],
        on_done: Callable[[dict[str, int], BaseException | None], None],
    ) -> Ticket:
        """Runs ``fn(state)`` (which replaces the state and returns its new version) for each
        shard on its owner thread and marks it dirty, as `overwrite` does: a row shard's state
        transfer."""
        by_owner: dict[int, list[ShardState]] = {}
        for st in states:
            by_owner.setdefault(st.owner, []).append(st)
        ticket = Ticket(len(by_owner), on_done)
        for owner, items in by_owner.items():

            def put(o: int, items: list = items) -> None:
                now = self.clock()
                for st in items:
                    st.version = int(fn(st))
                    if st.dirty_since is None:
                        st.dirty_since = now
                    self._dirty[o].add(st)
                    ticket.result[st.id] = st.version

            self._put(owner, (_CALL, put, ticket))
        return ticket

    def _put(self, owner: int, item: tuple) -> None:
        self._queues[owner].put(item)
        self.puts += 1  # after it: a cut queued after a reading of `puts` follows every item

    def snapshot_dirty(self, timeout: float = 60.0) -> list[Snapshot]:
        """Copies every dirty shard on its owner thread and marks it clean (blocking; not on the loop)."""
        return self.begin_snapshot()(timeout)

    def begin_snapshot(
        self, buckets: Collection[int] | None = None
    ) -> Callable[[float], list[Snapshot]]:
        """Queues the copy of every dirty shard (of `buckets`; None: of all) on every owner thread
        now, and returns the wait for the copies (blocking; not on the loop). Queued from the
        thread that queues updates (the event loop), the copies are one consistent cut: every
        update queued before is in them, none queued after. Each copy is the shard's sealed LMDB
        record (shardrecord.pack): the one copy a flush makes of what it writes."""
        done = threading.Event()
        snaps: list[Snapshot] = []
        lock = threading.Lock()
        bucket_of = self.layout.bucket_of

        def take(owner: int) -> None:
            mine = []
            for st in list(self._dirty[owner]):
                b = _bucket(st, bucket_of)
                if buckets is not None and b not in buckets:
                    continue
                since = st.dirty_since if st.dirty_since is not None else self.clock()
                if isinstance(st, RowShardState):
                    # an embedding table's rows: the block's header and the rows touched
                    # since the previous cut, not the whole block (adamps/server/store/tables/rowdelta.py)
                    blk = st.value
                    rec = shardrecord.pack_bytes(st.version, blk.header_bytes(), None)
                    mine.append(Snapshot(st.id, st.version, rec, since, b, blk.take_delta()))
                else:
                    rec = shardrecord.pack(st.version, st.value, st.accum)
                    mine.append(Snapshot(st.id, st.version, rec, since, b))
                st.dirty_since = None
                self._dirty[owner].discard(st)
            with lock:
                snaps.extend(mine)

        ticket = Ticket(len(self._queues), lambda _r, _e: done.set())
        for q in self._queues:
            q.put((_CALL, take, ticket))

        def wait(timeout: float) -> list[Snapshot]:
            if not done.wait(timeout):
                raise TimeoutError("owner threads did not answer the snapshot in time")
            if ticket.error is not None:
                raise ticket.error
            return snaps

        return wait

    def dirty_bytes(self) -> dict[int, int]:
        """Bucket -> record bytes of its dirty shards (racy: the flush's plan; cuts are exact)."""
        bucket_of = self.layout.bucket_of
        out: dict[int, int] = {}
        for owner_set in self._dirty:
            for _ in range(10):  # an owner thread may add to its set while we copy it
                try:
                    items = list(owner_set)
                    break
                except RuntimeError:
                    continue
            else:
                items = []
            for st in items:
                b = _bucket(st, bucket_of)
                if isinstance(st, RowShardState):
                    out[b] = out.get(b, 0) + st.value.flush_nbytes
                else:
                    out[b] = out.get(b, 0) + shardrecord.record_bytes(st.value, st.accum)
        return out

    def oldest_dirty(self) -> float | None:
        """Monotonic time of the oldest update not yet snapshotted (a racy read; for metrics)."""
        oldest = None
        for owner_set in self._dirty:
            for st in list(owner_set):
                d = st.dirty_since
                if d is not None and (oldest is None or d < oldest):
                    oldest = d
        return oldest

    @property
    def applied(self) -> dict[str, int]:
        """Updates applied so far, by kind."""
        kinds = ("dense", "fc", "compressed")
        return {k: sum(c[i] for c in self._applied) for i, k in enumerate(kinds)}

    def dirty_count(self) -> int:
        return sum(len(s) for s in self._dirty)

    def queue_depths(self) -> list[int]:
        return [q.qsize() for q in self._queues]

    def close(self) -> None:
        for q in self._queues:
            q.put((_STOP,))
        for t in self._threads:
            t.join(timeout=10)

    # -- owner threads ----------------------------------------------------------------------------

    def _run(self, owner: int) -> None:
        q = self._queues[owner]
        scratch = Scratch(self.layout.max_shard_elems)
        while True:
            items = [q.get()]
            while True:
                try:
                    items.append(q.get_nowait())
                except queue.Empty:
                    break
            # Updates per shard in arrival order; a call or stop is a barrier.
            pending: dict[ShardState, list[tuple[optim.Update, Ticket]]] = {}
            for item in items:
                tag = item[0]
                if tag == _UPDATE:
                    pending.setdefault(item[1], []).append((item[2], item[3]))
                    continue
                if tag == _UPDATES:
                    ticket = item[2]
                    for st, upd in item[1]:
                        pending.setdefault(st, []).append((upd, ticket))
                    continue
                if pending:
                    self._apply(owner, pending, scratch)
                    pending = {}
                if tag == _STOP:
                    return
                if tag == _GROUP:
                    _, groups, ticket = item
                    self._apply(
                        owner,
                        {st: [(u, ticket) for u in ups] for st, ups in groups.items()},
                        scratch,
                        once=ticket,
                    )
                    continue
                _, fn, ticket = item
                try:
                    fn(owner)
                except BaseException as exc:  # never let a bad item kill the owner thread
                    log.exception("owner thread %d: call failed", owner)
                    ticket.part_done(exc)
                else:
                    ticket.part_done()
            if pending:
                self._apply(owner, pending, scratch)

    def _apply(
        self,
        owner: int,
        pending: dict[ShardState, list[tuple[optim.Update, Ticket]]],
        scratch: Scratch,
        once: Ticket | None = None,
    ) -> None:
        """Applies each shard's group as one batch. With `once`, every update belongs to that one
        ticket, which counts one part per owner (push_group), not one per update."""
        now = self.clock()
        dirty = self._dirty[owner]
        for st, group in pending.items():
            error: BaseException | None = None
            if st.cuts is not None:  # a consistent cut wants it as it is: copied first
                keep(st)
            try:
                if isinstance(st, RowShardState):  # an embedding table's rows (rowblock.py)
                    st.apply_rows([u for u, _ in group])
                else:
                    opt, ups = self.tensors_by_shard(st), [u for u, _ in group]
                    st.applied = vecapply.apply_batch(opt, st.value, st.accum, ups, scratch)
            except BaseException as exc:  # a logged failure of this batch, not of the thread
                log.exception(
                    "owner thread %d: applying %d updates to %s failed", owner, len(group), st.id
                )
                error = exc
            else:
                st.version = install.version_after(st.version, group)  # per update or install
                if st.dirty_since is None:
                    st.dirty_since = now
                dirty.add(st)
                n_fc = sum(1 for u, _ in group if isinstance(u, Fc))
                n_sig = sum(1 for u, _ in group if isinstance(u, Signs))
                n_rows = len(group) if isinstance(st, RowShardState) else 0
                n_dense = len(group) - n_fc - n_sig - n_rows
                # Counted before the pushers hear back, so /metrics never lags an acknowledged push.
                counts = self._applied[owner]
                counts[0] += n_dense
                counts[1] += n_fc
                counts[2] += n_sig
                if self._on_applied is not None:
                    if n_dense:
                        self._on_applied("dense", n_dense)
                    if n_fc:
                        self._on_applied("fc", n_fc)
                    if n_sig:
                        self._on_applied("compressed", n_sig)
                    if n_rows:
                        self._on_applied("rows", n_rows)
            if once is not None:
                if error is None:
                    once.result[st.id] = st.version
                elif once.error is None:
                    once.error = error
                continue
            # Resolved shard by shard: a push to a shard early in the drain does not wait for the rest.
            for _, ticket in group:
                if error is None:
                    ticket.result[st.id] = st.version
                ticket.part_done(error)
        if once is not None:
            once.part_done(once.error)

    def tensors_by_shard(self, st: ShardState) -> Optimizer:
        # A dict lookup of an immutable entry: the tensor is never removed while its shards live.
        return self.tensors[st.shard.tensor].optimizer


def _bucket(st: ShardState, bucket_of: Mapping[str, int]) -> int:
    """The bucket of a held shard (a row shard knows its own)."""
    b = getattr(st, "bucket", None)
    return int(b) if b is not None else bucket_of.get(st.id, -1)
