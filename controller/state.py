"""The controller's replicated state: servers, buckets and leases, layout, replica progress.

Project Adam 3.3.3: the controllers form a consensus group whose replicated state maps buckets to
a primary (via a lease) and secondaries, receives heartbeats, and relocates the buckets of failed
servers evenly. Here the group is Raft (pysyncobj) and the state has two layers:

* `ClusterModel`: plain, deterministic Python, assembled from its rules (``cluster_rules.py``),
  operations (``cluster_ops.py``) and queries (``cluster_views.py``). Every mutating method
  takes `now` (the proposing leader's wall clock) as an argument and never reads a clock, never
  does IO, never raises on bad input (it returns ``{"ok": False, "error": code, ...}``): a replicated method that raised
  would stall the Raft apply loop on every replica.
* `ReplicatedCluster`: a pysyncobj consumer whose ``@replicated`` methods take small plain
  arguments and call the model under a lock (HTTP threads read while the Raft thread applies).

Only decisions are replicated. Heartbeat arrivals stay soft state on the leader (controller/
leader.py), which turns silence into a committed `declare_dead` and batches lease renewals into
one entry per renewal round (controller/renewals.py), which renews each server in it once
(controller/server_leases.py). Every lease grant, renewal, hand-off and relocation is a
committed entry; a lease moves to another server only once the old one has certainly expired
(adamps/core/lease.py) or was released by its holder.

Bucket life cycle: `want` is the placement's target ([primary, secondaries...]); `holders` are the
caught-up copies (the replica set the primary replicates to); `joining` are copies being
transferred (they enter the replica set by `caught_up`, which the primary reports once the copy
holds every batch it committed and every later round waits for it). A primary is granted only
to a caught-up copy; a member outside `want` leaves once every wanted copy has caught up (a
draining server's copy, in addition, only after its drain's hold and once the bucket has the
copies the drain planned: `Operations.drain`).

Copies outlive their server's registration. Every acknowledged batch is on every member of the
replica set, so when the last live member of a bucket leaves it (declared dead, or registered
again as a new incarnation after a restart or a pause), its copy is recorded as a `candidate`:
a copy that may hold every acknowledged batch (in memory after a pause; from LMDB after a crash,
up to its last flush). So is the copy of every member that left within one lease duration
before it (`WAVE`): the members of a crash of every copy leave one by one (each declared dead or
registered again on its own), and any of them may have flushed more than the last one. The
bucket is then *unavailable*: nobody serves it, nothing re-creates it. Servers offer their
copies with (epoch, seq) when they register; once every candidate is back (with its copy, or
without it: then it is no candidate) and the old lease has certainly expired, the most
up-to-date one is granted the lease and the others catch up from it. A candidate that never
comes back keeps the bucket unavailable: only an operator may give up on its copy. A bucket that ever held data is never re-created empty or
from an older copy except by an operator's explicit `write_off` (`POST /buckets/{b}/declare-lost`), which is logged and counted.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from pysyncobj import SyncObjConsumer, replicated

from adamps.core.lease import LeaseTerms
from controller.ckpt_record import CheckpointRecord
from controller.cluster_ops import Operations
from controller.cluster_rules import (  # noqa: F401 (server states: the model's vocabulary)
    DEAD,
    DRAINING,
    LIVE,
    BucketRules,
    refusal,
)
from controller.cluster_views import Views
from controller.cluster_wants import WantCounts
from controller.run_ops import RunOps
from controller.server_leases import ServerLeases

log = logging.getLogger(__name__)


#: attributes of the model derived from its state (indexes, caches): never dumped or copied
DERIVED = frozenset(
    {
        "_leased",
        "_touching",
        "_unavailable",
        "_unavail",
        "_dirty",
        "_unsettled",
        "_stamps",
        "_floor",
        "_gone",
        "_wanted",
        "_offers",
        "_attached",
        "_answers",
    }
)


# The class keeps its name and module: pysyncobj's full dump pickles the model, and a dump written
# by an earlier release names controller.state.ClusterModel. Its methods live in the mixins.
class ClusterModel(
    Operations, ServerLeases, Views, CheckpointRecord, BucketRules, WantCounts, RunOps
):
    """The cluster configuration. Mutated only by the Raft apply thread, through its methods."""

    def __init__(
        self, n_buckets: int, terms: LeaseTerms, replication: int = 3, min_servers: int = 1
    ) -> None:
        self.n_buckets = n_buckets
        self.terms = terms
        self.replication = replication
        #: Servers needed before buckets are first placed (so a starting cluster spreads evenly).
        self.min_servers = min_servers
        #: The replicated clock: the largest `now` applied so far (never goes back).
        self.clock = 0.0
        #: Routing table version: grows on every change of servers, roles or leases' holders.
        self.version = 0
        #: Count of applied mutating entries (for tests and /status).
        self.applied = 0
        #: id -> {"address", "state", "incarnation", "since", "copies"}; copies: bucket -> [epoch,
        #: seq] of the copies the server offered when it registered (this incarnation)
        self.servers: dict[str, dict[str, Any]] = {}
        #: per bucket: {"want", "holders", "joining", "lease", "holder_inc", "candidates", "lost",
        #: "left"}; holders excludes the primary; candidates: servers whose copy may hold every
        #: acknowledged batch while no member is live (see the module docstring); left: member
        #: -> when it left, for the members that left while others stayed (pruned after a WAVE)
        self.buckets: list[dict[str, Any]] = [
            {
                "want": [],
                "holders": [],
                "joining": [],
                "lease": None,
                "holder_inc": 0,
                "candidates": [],
                "lost": False,
                "left": {},
            }
            for _ in range(n_buckets)
        ]
        #: buckets an operator declared lost (each one logged)
        self.declared_lost = 0
        #: ids of joins: each entry into a bucket's `joining` gets the next one, and a caught-up
        #: report names the join it is about (a report of an earlier join is refused)
        self.joins = 0
        #: closed leases (dicts with "bucket"), oldest first
        self.history: list[dict[str, Any]] = []
        self.layout: dict[str, Any] | None = None
        self.layout_version = 0
        #: str(epoch) -> replica id -> {"progress", "done", "at"}
        self.progress: dict[str, dict[str, dict[str, Any]]] = {}
        #: runs (issue 25, controller/run_ops.py): name -> record; runs_version grows with each
        #: change (the servers refetch the table when it does)
        self.runs: dict[str, dict[str, Any]] = {}
        self.runs_version = 0
        #: server -> [renewal rounds that renewed it, the clock of the last]; a bucket's lease
        #: follows its holder's rounds (controller/server_leases.py, issue 40)
        self.renewals: dict[str, list] = {}
        #: buckets whose record an entry changed: the next entry re-decides whether they
        #: follow their holder's rounds (`ServerLeases._sync_follows`)
        self.follow_check: set[int] = set()

    # Derived indexes (`leased_to`, `touching`, `unavailable_buckets`) are no replicated state: they are
    # left out of pysyncobj's dump and of copies, and rebuilt from the state on first use.
    def __getstate__(self) -> dict[str, Any]:
        # dict(): one step under the GIL, while a reader may add a derived index meanwhile
        return {k: v for k, v in dict(self.__dict__).items() if k not in DERIVED}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)


#: operations about one bucket (their first argument): a dry run copies that bucket only
BUCKET_OPS = frozenset(
    {"role_change", "caught_up", "verified_caught_up", "drop_secondary", "release", "write_off"}
)


def dry_run(model: ClusterModel, op: str, args: tuple) -> dict[str, Any]:
    """What `op(*args)` would answer, computed on a copy of `model` (which stays unchanged).

    The leader asks this before it proposes a client's operation (controller/raft_node.py), so
    its cost is paid on every role change, caught-up report, drop and release. An operation
    about one bucket changes only that bucket's record, the offers of that bucket in the server
    records (`_drop_stale_offers`), the lease history and scalar counters: the copy shares
    everything else. A deepcopy of the whole state was O(state) per proposal (issue 26's scale
    simulation: seconds per caught-up report at 100,000 buckets, 15,000 reports after a rack
    fails). tests/core/test_scale_sim.py checks, for every such operation, that the original
    is unchanged and the answer is the one the real apply gives."""
    b = args[0] if args else None
    if op not in BUCKET_OPS or not isinstance(b, int) or not 0 <= b < model.n_buckets:
        return getattr(copy.deepcopy(model), op)(*copy.deepcopy(args))
    trial = copy.copy(model)  # shallow; __getstate__ leaves the derived indexes out
    trial.buckets = OneBucket(model.buckets, b, copy.deepcopy(model.buckets[b]))
    trial.servers = dict(model.servers)
    for s in model.offering(b):  # their offer of b may be voided: copied
        rec = model.servers[s]
        trial.servers[s] = {**rec, "copies": dict(rec["copies"])}
    # Only bucket b's offers are read by an operation about b (`offering(b)`).
    trial.offers_only(b, model.offering(b))
    trial.history = list(model.history)
    # Its own marks: re-deciding the model's would write other buckets' shared records.
    trial.follow_check = set()
    return getattr(trial, op)(*copy.deepcopy(args))


class OneBucket(Sequence):
    """A dry run's bucket list: `buckets` with bucket `b` replaced by its copy, without
    copying the list (100,000 references per proposal: issue 40's scale simulation, 15,000
    caught-up reports after a rack fails). Only bucket `b` may be written."""

    def __init__(self, buckets: list[dict[str, Any]], b: int, mine: dict[str, Any]) -> None:
        self._base, self._b, self._mine = buckets, b, mine

    def __len__(self) -> int:
        return len(self._base)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(len(self._base))[i]]
        return self._mine if i == self._b or i == self._b - len(self._base) else self._base[i]

    def __setitem__(self, i: int, value: dict[str, Any]) -> None:
        if i != self._b:
            raise IndexError(f"a dry run about bucket {self._b} wrote bucket {i}")
        self._mine = value


def state_digest(model: ClusterModel) -> str:
    """sha256 of the replicated state in a canonical form (maps by key, sets sorted, derived
    indexes left out): equal on every controller that applied the same entries, whatever the
    order its dicts were filled in (GET /state/digest; issue 39 compares it across members)."""
    canon = json.dumps(_canon(model.__getstate__()), sort_keys=True, default=repr)
    return hashlib.sha256(canon.encode()).hexdigest()


def _canon(x: Any) -> Any:
    if isinstance(x, dict):
        return {repr(k): _canon(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_canon(v) for v in x]
    if isinstance(x, set | frozenset):
        return sorted((_canon(v) for v in x), key=repr)
    if x is None or isinstance(x, str | int | float):
        return x
    if hasattr(x, "__dict__"):
        return {"class": type(x).__name__, "vars": _canon(vars(x))}
    return repr(x)


class ReplicatedCluster(SyncObjConsumer):
    """The Raft-replicated face of `ClusterModel`: one @replicated method per operation.

    Arguments are small plain values; `now` is supplied by the caller (the leader's wall clock).
    Readers call `read(fn)`, which runs `fn(model)` under the lock the apply thread also takes.
    """

    def __init__(self, model: ClusterModel) -> None:
        super().__init__()
        self._lock = threading.RLock()
        self._model = model

    # pysyncobj dumps what _serialize returns at log compaction and restores it on restart.
    # No copy (issue 40: a deepcopy of 100,000 buckets was seconds of the Raft thread): the
    # dump is taken on the Raft thread, which is also the only thread that applies entries,
    # so the replicated state cannot change under it; with the forked dump (raft_node.py) the
    # child pickles the state as it was at the fork. Readers on other threads change only
    # the derived indexes, which the dump leaves out (`ClusterModel.__getstate__`).
    def _serialize(self) -> dict[str, Any]:
        return {"model": self._model}

    def _deserialize(self, data: dict[str, Any]) -> None:
        with self._lock:
            self._model = data["model"]

    def read(self, fn: Callable[[ClusterModel], Any]) -> Any:
        with self._lock:
            return fn(self._model)

    def _apply(self, name: str, *args: Any) -> dict[str, Any]:
        with self._lock:
            try:
                return getattr(self._model, name)(*args)
            except Exception as exc:  # a bug must not wedge the apply loop of every replica
                log.exception("replicated %s%r failed", name, args)
                return refusal("internal", f"{type(exc).__name__}: {exc}")

    @replicated
    def register(
        self,
        sid: str,
        address: str,
        now: float,
        copies: dict | None = None,
        rack: str | None = None,
    ) -> dict[str, Any]:
        # `rack` (issue 26) is a trailing optional argument: the journal's earlier entries
        # replay without it.
        return self._apply("register", sid, address, now, copies, rack)

    @replicated
    def declare_dead(self, sid: str, now: float, reports: dict | None = None) -> dict[str, Any]:
        return self._apply("declare_dead", sid, now, reports)

    @replicated
    def renew(self, sid: str, now: float) -> dict[str, Any]:
        return self._apply("renew", sid, now)

    @replicated
    def reconcile(self, now: float, reports: dict | None = None) -> dict[str, Any]:
        return self._apply("reconcile", now, reports)

    @replicated
    def role_change(
        self, b: int, sid: str, prev_epoch: int, reports: dict, now: float
    ) -> dict[str, Any]:
        return self._apply("role_change", b, sid, prev_epoch, reports, now)

    @replicated
    def caught_up(self, b: int, sid: str, epoch: int, now: float) -> dict[str, Any]:
        # The previous release's entry (the journal replays it); new reports: verified_caught_up.
        return self._apply("caught_up", b, sid, epoch, now)

    @replicated
    def drop_secondary(
        self, b: int, primary: str, epoch: int, sid: str, now: float
    ) -> dict[str, Any]:
        return self._apply("drop_secondary", b, primary, epoch, sid, now)

    @replicated
    def release(self, b: int, sid: str, epoch: int, now: float) -> dict[str, Any]:
        return self._apply("release", b, sid, epoch, now)

    @replicated
    def drain(self, sid: str, now: float, hold: float = 0.0, back: bool = False) -> dict[str, Any]:
        # `back`: undrain (one entry for both: a new method would renumber the journal's).
        return self._apply("drain", sid, now, hold, back)

    @replicated
    def rebalance(self, now: float) -> dict[str, Any]:
        return self._apply("rebalance", now)

    @replicated
    def set_layout(self, layout: dict, now: float) -> dict[str, Any]:
        return self._apply("set_layout", layout, now)

    # pysyncobj numbers replicated methods by sorted name (within a `ver`), and the journal
    # stores the numbers: a new method must sort after every existing one, or a journal written
    # by the previous version replays as the wrong operations (tests/core/test_raft_method_ids.py).
    @replicated
    def sweep_dead(self, sid: str, dead_before: float, now: float) -> dict[str, Any]:
        return self._apply("sweep_dead", sid, dead_before, now)

    # Issue 11's operations. Their names sort after every earlier one (see above); `ver` is no
    # way out: pysyncobj enables a higher `ver` only after an explicit setCodeVersion.
    @replicated
    def verified_caught_up(
        self, b: int, primary: str, epoch: int, sid: str, now: float, join: int | None = None
    ) -> dict[str, Any]:
        return self._apply("verified_caught_up", b, primary, epoch, sid, now, join)

    @replicated
    def write_off(self, b: int, now: float) -> dict[str, Any]:
        return self._apply("write_off", b, now)

    # Issue 29's operation: its name sorts after "write_off" (see above).
    @replicated
    def write_storage(
        self, sid: str, not_durable: str | None, now: float, hold: float = 0.0
    ) -> dict[str, Any]:
        # (`hold` defaults to 0: a journal entry written before it existed replays as it did)
        return self._apply("write_storage", sid, not_durable, now, hold)

    # Issue 25's runs: one method for create, delete and a run's layout; its name sorts after
    # "write_storage" (see above).
    @replicated
    def write_tenancy(self, op: str, name: str, fields: dict, now: float) -> dict[str, Any]:
        return self._apply("write_tenancy", op, name, fields, now)

    @replicated
    def report_progress(
        self, epoch: int, replica: str, progress: float, done: bool, now: float
    ) -> dict[str, Any]:
        return self._apply("report_progress", epoch, replica, progress, done, now)

    # Issue 24's operation (periodic checkpoints: controller/ckpt_record.py). Its name sorts
    # after every earlier one (see above); one method, several actions, so that later actions
    # (the consistent cut's write hold) add no journal number.
    @replicated
    def x_checkpoint(self, action: str, fields: dict, now: float) -> dict[str, Any]:
        return self._apply("x_checkpoint", action, fields, now)

    # Issue 40's renewal round (controller/renewals.py): its name sorts after "x_checkpoint".
    @replicated
    def x_renew_round(self, sids: list, now: float) -> dict[str, Any]:
        return self._apply("renew_round", sids, now)
