"""The replication core's invariants, checked after an input (dask's ``WorkerState.validate``):
``ReplCore.validate()`` calls ``check``. Each rule holds after every input the core takes, so a
breach names the input that broke the state, not the later step that trips over it. The
randomized simulation (tests/core/test_replication_sim.py) checks them after every input it
feeds; a server checks them after each input when ``ADAMPS_DEBUG_CORE=1``
(adamps.server.replication.shell).

Only what the code guarantees in every case is checked (a false alarm would hide a real one):
a role "standby" keeps its copy's state as it was, so the primary-side rules follow the copy's
assignment (``is_primary``), not its role.
"""

from __future__ import annotations

from typing import Any

from adamps.core.replication.bucket import BucketReplica

#: a ReplCore (repl_core imports this module: no import cycle in adamps.core, pyproject.toml)
ReplCore = Any

ROLES = frozenset({"primary", "secondary", "joining", "standby"})
LEARNER_STATES = frozenset({"syncing", "reporting", "reported"})


class InvariantViolation(AssertionError):
    """A rule of the replication core's state does not hold: names the bucket and the rule."""


def _fail(core: ReplCore, b: int, rule: str) -> None:
    raise InvariantViolation(f"{core.server_id}: bucket {b}: {rule}")


def check(core: ReplCore) -> None:
    """Raises InvariantViolation at the first rule that does not hold."""
    # tick, pings and next_deadline index `buckets` by every key of `roles`, and a copy held
    # without a role would never be served, dropped or offered.
    for b in set(core.roles) ^ set(core.buckets):
        _fail(core, b, "a role without a copy" if b in core.roles else "a copy without a role")
    for b, rep in core.buckets.items():
        check_bucket(core, b, rep)
    # Per-bucket tables of copies no longer held would outlive them (_forget drops them all).
    for name in ("persisted", "join_ids", "installing", "_accepted", "_rounds", "_fetching"):
        extra = set(getattr(core, name)) - set(core.buckets)
        if extra:
            _fail(core, min(extra), f"{name} names a bucket not held")
    # Every message in flight is known by its id: its one answer must find its round.
    for b, rs in core._rounds.items():
        for m, o in rs.out.items():
            if core._rids.get(o.rid) != (b, m):
                _fail(core, b, f"message {o.rid} to {m} in flight but not in the message ids")
            if o.rid > core._next_rid:
                _fail(core, b, f"message id {o.rid} above the last one given ({core._next_rid})")


def check_bucket(core: ReplCore, b: int, rep: BucketReplica) -> None:
    role = core.roles[b]
    if role not in ROLES:
        _fail(core, b, f"unknown role {role!r}")
    if rep.bucket != b or rep.server != core.server_id:
        _fail(core, b, f"holds the state of bucket {rep.bucket} on {rep.server}")
    # Only the recorded primary sequences rounds (pump and next_round both require it).
    if role == "primary" and not rep.is_primary:
        _fail(core, b, f"role primary but the assignment's primary is {rep.assignment.primary}")
    c = rep.committed
    # A prepared batch at or below `committed` was applied: holding it would apply it twice.
    for s, batch in rep.prepared.items():
        if s <= c:
            _fail(core, b, f"prepared seq {s} <= committed {c}")
        if batch.seq != s:
            _fail(core, b, f"prepared[{s}] holds the batch of seq {batch.seq}")
    # The log is what lagging members catch up from: consecutive, ending at `committed`.
    if len(rep.log) > rep.log_limit:
        _fail(core, b, f"log of {len(rep.log)} batches > log_limit {rep.log_limit}")
    if rep.log:
        # Its ends only (a server checks after every input; _committed appends committed + 1).
        first, last = rep.log[0], rep.log[-1]
        if last.seq - first.seq != len(rep.log) - 1:
            _fail(core, b, f"log of {len(rep.log)} batches from seq {first.seq} to {last.seq}")
        if last.seq != c or last.epoch != rep.committed_epoch:
            _fail(
                core,
                b,
                f"log ends at ({last.epoch}, {last.seq}), "
                f"not at the committed position ({rep.committed_epoch}, {c})",
            )
    # The flush's last cut was of this copy's committed seq, which only grows.
    if b in core.persisted and core.persisted[b] > c:
        _fail(core, b, f"persisted cut {core.persisted[b]} > committed {c}")
    check_primary_side(core, b, rep)


def check_primary_side(core: ReplCore, b: int, rep: BucketReplica) -> None:
    """What only the assignment's primary holds: on_assignment hands it all back (its waiters
    answered "unknown") when the copy stops being the primary."""
    c = rep.committed
    if not rep.is_primary:
        for name in ("pending", "awaiting_commit", "doubt_waiters", "learners", "learner_joins"):
            if getattr(rep, name):
                _fail(core, b, f"{name} held, but {core.server_id} is not the primary")
        if rep.inflight is not None:
            _fail(core, b, "a round in flight, but this copy is not the primary")
        if rep.needs_recovery:
            _fail(core, b, "needs recovery, but this copy is not the primary")
    if rep.inflight is not None:
        batch = rep.inflight[0]
        # One round at a time, the next seq: commit_round applies it as committed + 1.
        if batch.seq != c + 1:
            _fail(core, b, f"round in flight of seq {batch.seq}, committed {c}")
        # A round restarted under a new epoch is re-stamped (on_assignment): its members
        # accept only the epoch they learned.
        if batch.epoch != rep.assignment.epoch:
            _fail(core, b, f"round in flight of epoch {batch.epoch} under {rep.assignment.epoch}")
    # Waiters of a batch wait for its commit acks only once it is applied here.
    for s in rep.awaiting_commit:
        if s > c:
            _fail(core, b, f"awaiting_commit of seq {s} > committed {c}")
    for m, state in rep.learners.items():
        if state not in LEARNER_STATES:
            _fail(core, b, f"learner {m} in unknown state {state!r}")
    # A report names its learner's join: no join id without a learner.
    extra = set(rep.learner_joins) - set(rep.learners)
    if extra:
        _fail(core, b, f"join ids of {sorted(extra)}, not learners")
