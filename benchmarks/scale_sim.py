"""Scale simulation of one controller group (issue 26): 1,000 servers, 100,000 buckets, a rack fails.

One process, simulated time (an event queue; no sleeps, no sockets), running the production code:

* the controllers' replicated state machine, `controller.state.ClusterModel`, through the entries
  Raft would apply on every controller (`register`, `renew_round`, `declare_dead`, `reconcile`,
  `verified_caught_up`), each with the leader's clock passed in as `now`;
* the leader's duties as `controller/leader.py` and `service.py` carry them out: silence past
  `server_timeout` -> `declare_dead` with the reported positions; `grants_due`/`holds_due` ->
  `reconcile`; the heartbeats of lease holders -> one `renew_round` per commit window, which
  renews each server in it once (controller/server_leases.py: leases follow their holder);
* on the server side a thin adapter: registration, heartbeats every `heartbeat_interval`,
  positions reported, the lease core `adamps.core.lease.HolderLeases` timing each confirmed
  grant on the holder's clock, and state transfers (a joining copy asks its primary; the
  primary reports `verified_caught_up` after `transfer` simulated seconds, one transfer at a
  time per server on either end). The replication core is not run: no pushes are simulated, so
  every copy reports seq 0 (positions only break ties); the adapter is where a run of the new
  per-server core would plug in.

Measured, for the rack failure: simulated seconds until every bucket is served again (a primary
whose own lease core lets it write) and until every bucket is back at RF caught-up copies; Raft
entries per simulated second (steady state and during the failure) and their pickled bytes;
real CPU seconds the apply thread spends per simulated second; CPU time of `placement.place`
per decision and in total; the replicated state's size as pysyncobj dumps it (deepcopy +
pickle) and how long that takes. Safety: no bucket has two primaries in one epoch, and no two
servers may write one bucket at the same simulated instant (sampled every leader step).

The limits it is compared against, measured in the same run: pysyncobj's commit rate (three
in-process nodes on loopback, `--raft-seconds`), the lease length (a placement decision slower
than it stalls the renewals queued behind it), and one CPU second per second for the apply
thread.

Run: python benchmarks/scale_sim.py [--servers 1000] [--buckets 100000] [--rack 50]
     python benchmarks/scale_sim.py --sweep 100,300,1000      (buckets = 100 x servers)
The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import heapq
import json
import pickle
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from adamps.core.lease import HolderLeases, LeaseTerms, check_history
from controller import cluster_rules, cluster_wants
from controller.config import ControllerConfig
from controller.leader import expired_dead
from controller.state import DEAD, ClusterModel, dry_run


def _default(name: str) -> Any:
    """A ControllerConfig default, read from the dataclass (no config files, no token)."""
    return next(f.default for f in dataclasses.fields(ControllerConfig) if f.name == name)


@dataclass(frozen=True)
class Settings:
    """One simulated cluster. Timings default to the controller's own defaults."""

    servers: int = 1000
    buckets: int = 100_000
    replication: int = 3
    #: servers of the rack that fails at once (the first `rack` servers)
    rack: int = 50
    #: every server names its rack (servers i // rack): placement keeps copies on distinct racks
    racks: bool = True
    heartbeat: float = _default("heartbeat_interval")
    server_timeout: float = _default("server_timeout")
    reconcile_interval: float = _default("reconcile_interval")
    lease: LeaseTerms = LeaseTerms(
        _default("lease_duration"), _default("lease_skew"), _default("lease_margin")
    )
    #: simulated seconds one state transfer of one bucket takes (1 MiB at ~100 MB/s, plus setup)
    transfer: float = 0.02
    #: simulated seconds of steady state measured before the rack fails
    steady: float = 10.0
    #: give up this many simulated seconds after the failure
    horizon: float = 300.0
    #: simulated seconds from a renewal round's first heartbeat to its commit (a round
    #: renews every heartbeat that arrived meanwhile: controller/renewals.py)
    round_s: float = 0.01


class Sim:
    """The simulated cluster: the production model, the leader's duties, thin servers."""

    def __init__(self, cfg: Settings) -> None:
        self.cfg = cfg
        self.model = ClusterModel(cfg.buckets, cfg.lease, cfg.replication, min_servers=cfg.servers)
        self.ids = [f"ps{i:05d}" for i in range(cfg.servers)]
        self.alive = dict.fromkeys(self.ids, True)
        self.holder = {s: HolderLeases(cfg.lease) for s in self.ids}
        self.granted: dict[str, set[int]] = {s: set() for s in self.ids}  # buckets in its core
        self.last_seen: dict[str, float] = {}  # leader soft state (controller/leader.py)
        self.reports: dict[int, dict[str, list[int]]] | None = None
        self.busy = dict.fromkeys(self.ids, 0.0)  # transfers: when each server is free again
        self.queued: set[tuple] = set()  # transfers asked for (bucket, joiner, join, epoch)
        self.next_hb: dict[str, float] = {}
        self.events: list[tuple[float, int, str, Any]] = []
        self.seq = 0
        self.now = 0.0
        self.entries: list[tuple[float, str, float, int]] = []  # (sim t, op, cpu s, bytes)
        self.placements: list[float] = []  # CPU seconds of each placement.place
        self.epoch_holder: dict[tuple[int, int], str] = {}
        self.violations: list[str] = []
        #: leader CPU seconds outside the apply thread: dry runs, heartbeat answers, leader loop
        self.work: list[tuple[float, str, float]] = []  # (sim t, what, cpu s)
        self.index = {s: i for i, s in enumerate(self.ids)}
        self.scans = 0
        self.scanned = -1  # the model version the last scan saw
        self.known: dict[str, int] = {}  # the routing version each server last saw
        self.sample = max(1, cfg.servers // 50)
        self._reports_bytes: int | None = None
        #: heartbeats waiting for the next renewal round: server -> when it asked
        self.round: dict[str, float] = {}

    def rack_of(self, sid: str) -> str | None:
        """The rack `sid` registers in: servers i // rack (the failing rack is rack 0)."""
        return f"rack{self.index[sid] // self.cfg.rack:03d}" if self.cfg.racks else None

    # -- plumbing -------------------------------------------------------------------------------
    def at(self, t: float, kind: str, arg: Any = None) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, arg))

    def apply(self, op: str, *args: Any) -> dict[str, Any]:
        """One Raft entry, applied as every controller's apply thread would (timed)."""
        size = len(pickle.dumps((op, args[:1] if op in ("declare_dead", "reconcile") else args)))
        if op in ("declare_dead", "reconcile"):  # their reports: the leader's whole table
            size += self._reports_size()
        t0 = time.process_time()
        res = getattr(self.model, op)(*args)
        self.entries.append((self.now, op, time.process_time() - t0, size))
        return res

    def positions(self) -> dict[int, dict[str, list[int]]]:
        """The leader's table of reported positions (bucket -> server -> [epoch, seq]), as the
        members' heartbeats left it (leader.reports_copy): every live member at its epoch."""
        if self.reports is None:
            self.reports = {}
            for b, bk in enumerate(self.model.buckets):
                lease = bk["lease"]
                if lease is not None:
                    members = [lease.holder, *bk["holders"]]
                    self.reports[b] = {s: [lease.epoch, 0] for s in members if self.alive[s]}
        return self.reports

    def charge(self, what: str, cpu: float) -> None:
        self.work.append((self.now, what, cpu))

    def _reports_size(self) -> int:
        if self._reports_bytes is None:
            self._reports_bytes = len(pickle.dumps(self.reports))
        return self._reports_bytes

    def run_until(self, stop: float) -> None:
        while self.events and self.events[0][0] <= stop:
            t, _, kind, arg = heapq.heappop(self.events)
            self.now = t
            getattr(self, "_on_" + kind)(arg)
        self.now = stop

    # -- servers --------------------------------------------------------------------------------
    def start(self) -> None:
        """Every server registers (the last registration places every bucket), then heartbeats
        on its own phase."""
        for i, sid in enumerate(self.ids):
            self.now = i * 1e-4
            addr = f"10.0.{i // 250}.{i % 250}:7100"
            self.apply("register", sid, addr, self.now, {}, self.rack_of(sid))
            self.last_seen[sid] = self.now
        t0 = self.now
        for i, sid in enumerate(self.ids):
            first = t0 + self.cfg.heartbeat * (i + 0.5) / len(self.ids)
            self.next_hb[sid] = first
            self.at(first, "heartbeat", sid)
        self.at(t0 + self.cfg.reconcile_interval, "leader")

    def _on_heartbeat(self, sid: str) -> None:
        if not self.alive[sid]:
            return
        now = self.now
        self.next_hb[sid] = now + self.cfg.heartbeat
        self.at(now + self.cfg.heartbeat, "heartbeat", sid)
        m = self.model
        if m.servers[sid]["state"] == DEAD:  # declared dead while alive: a new incarnation
            self.apply("register", sid, m.servers[sid]["address"], now, {}, self.rack_of(sid))
        self.last_seen[sid] = now
        # service.h_heartbeat: a server holding a live lease waits for the next renewal round
        # (controller/renewals.py: one entry for the heartbeats that arrived meanwhile)
        t0 = time.process_time()
        holds = m.holds_lease(sid)
        self.charge("heartbeat_reads", time.process_time() - t0)
        if holds:
            if not self.round:
                self.at(now + self.cfg.round_s, "round")
            self.round[sid] = now  # asked_at = when the heartbeat was sent
        if self.index[sid] % self.sample == 0:
            # The answer's reads (roles when the version moved, unavailable buckets): timed on a
            # sample of the servers and counted for all of them.
            t0 = time.process_time()
            view = m.heartbeat_view(sid, self.known.get(sid), deltas=True)
            self.charge("heartbeat_reads", (time.process_time() - t0) * self.sample)
            self.known[sid] = view["version"]

    def _on_round(self, _: Any) -> None:
        """A renewal round commits: one entry renewing every server whose heartbeat came
        since the last round was proposed, its clock read after all of them arrived."""
        batch, self.round = self.round, {}
        res = self.apply("renew_round", sorted(batch), self.now)
        for sid, ans in res["servers"].items():
            for b, epoch in ans.get("renewed", []):
                self.holder[sid].on_granted(b, epoch, batch[sid])  # the lease core's rule
                self.granted[sid].add(b)

    def _on_transfer(self, job: tuple) -> None:
        b, primary, epoch, sid, join = job
        if self.alive[primary] and self.alive[sid]:
            args = (b, primary, epoch, sid, self.now, join)
            t0 = time.process_time()
            dry = dry_run(self.model, "verified_caught_up", args)  # raft_node.commit's check
            self.charge("dry_runs", time.process_time() - t0)
            if dry.get("ok"):
                self.apply("verified_caught_up", *args)

    def _on_fail(self, rack: list[str]) -> None:
        for sid in rack:
            self.alive[sid] = False

    # -- the leader -----------------------------------------------------------------------------
    def _on_leader(self, _: Any) -> None:
        now, m = self.now, self.model
        self.at(now + self.cfg.reconcile_interval, "leader")
        self._scan()
        for sid, rec in list(m.servers.items()):
            if (
                rec["state"] != DEAD
                and now - self.last_seen.get(sid, now) > self.cfg.server_timeout
            ):
                self.apply("declare_dead", sid, now, self.positions())
        t0 = time.process_time()
        due = m.grants_due(now) or m.holds_due(now)
        self.charge("leader_loop", time.process_time() - t0)
        if due:
            self.apply("reconcile", now, self.positions())
        if expired_dead(m, now - _default("dead_server_ttl")):
            raise AssertionError("a dead server to sweep within the horizon: lengthen the TTL")

    def _scan(self) -> None:
        """What the servers learn from their roles (they read them at their next heartbeat):
        positions to report, joins to ask their primary for; and the safety checks."""
        m = self.model
        self.reports = None  # rebuilt when an entry carries them
        self._reports_bytes = None
        self.scans += 1
        if self.scans % 4 == 0:
            self._check_writers()
        if m.version == self.scanned:  # no grant, no join since the last scan
            return
        self.scanned = m.version
        for b, bk in enumerate(m.buckets):
            lease = bk["lease"]
            if lease is None:
                continue
            key = (b, lease.epoch)
            if self.epoch_holder.setdefault(key, lease.holder) != lease.holder:
                self.violations.append(f"bucket {b} epoch {lease.epoch}: two primaries")
            if not bk["joining"] or not m.holder_live(b) or not self.alive[lease.holder]:
                continue
            for sid in bk["joining"]:
                join = bk.get("join_ids", {}).get(sid)
                job = (b, lease.holder, lease.epoch, sid, join)
                if job in self.queued or not self.alive[sid]:
                    continue
                self.queued.add(job)
                start = max(self.next_hb[sid], self.busy[lease.holder], self.busy[sid])
                self.busy[lease.holder] = self.busy[sid] = start + self.cfg.transfer
                self.at(start + self.cfg.transfer, "transfer", job)

    def _check_writers(self) -> None:
        now = self.now
        writers: dict[int, list[str]] = {}
        for sid in self.ids:  # no two servers' lease cores may let them write one bucket at once
            core = self.holder[sid]
            for b in self.granted[sid]:
                deadline = core.deadline(b)
                if deadline is not None and now < deadline:
                    writers.setdefault(b, []).append(sid)
        for b, who in writers.items():
            if len(who) > 1:
                self.violations.append(f"bucket {b} at {now:.2f}: {who} may all write")

    # -- figures --------------------------------------------------------------------------------
    def served(self) -> int:
        """Buckets whose primary's lease core lets it write now (a live server)."""
        m, n = self.model, 0
        for b, bk in enumerate(m.buckets):
            lease = bk["lease"]
            if lease is not None and self.alive[lease.holder]:
                n += self.holder[lease.holder].can_write(b, lease.epoch, self.now)
        return n

    def granted_live(self) -> int:
        """Buckets whose lease (controller view) is held by a live, running server."""
        m = self.model
        return sum(m.holder_live(b) and self.alive[m.primary_of(b)] for b in range(m.n_buckets))

    def at_rf(self) -> int:
        m = self.model
        return sum(1 for b in range(m.n_buckets) if len(m.holders_of(b)) >= m.replication)


def pysyncobj_dump(data: Any) -> bytes:
    """The bytes pysyncobj writes for a full dump of `data` (its serializer: pickle, gzipped)."""
    import gzip
    import io

    from pysyncobj import pickle as raft_pickle

    with io.BytesIO() as buf:
        with gzip.GzipFile(fileobj=buf, mode="wb") as g:
            raft_pickle.dump(data, g)
        return buf.getvalue()


def forked_dump(model: ClusterModel) -> tuple[float, float, int]:
    """The controllers' dump as pysyncobj takes it (controller/raft_node.py: useFork), through
    pysyncobj's own Serializer and `ReplicatedCluster._serialize`: (CPU seconds of the Raft
    thread, which forks and goes on; wall seconds until the child wrote the file; its bytes).
    """
    import os

    from pysyncobj.config import SERIALIZER_STATE
    from pysyncobj.serializer import Serializer

    from controller.state import ReplicatedCluster

    path = str(Path(tempfile.mkdtemp(prefix="scale-sim-dump-")) / "raft.dump")
    ser = Serializer(path, 2**16, True, None, None, None)
    cluster = ReplicatedCluster(model)
    t0, w0 = time.process_time(), time.perf_counter()
    ser.serialize(([{}, cluster._serialize()], None, None, None), 1)
    raft_thread_s = time.process_time() - t0
    while ser.checkSerializing()[0] == SERIALIZER_STATE.SERIALIZING:
        time.sleep(0.01)
    child_s = time.perf_counter() - w0
    size = os.path.getsize(path)
    os.remove(path)
    return raft_thread_s, child_s, size


def timed_place(sim: Sim) -> None:
    """Times every placement decision of the production code (the modules' own functions,
    called): the whole re-placement and, after a death, that of the dead server's buckets."""
    real = cluster_rules.placement.place
    real_lost = cluster_wants.placement_loss.place_lost

    def timed(fn: Any) -> Any:
        def call(*args: Any, **kw: Any) -> Any:
            t0 = time.process_time()
            try:
                return fn(*args, **kw)
            finally:
                sim.placements.append(time.process_time() - t0)

        return call

    cluster_rules.placement.place = timed(real)  # type: ignore[assignment]
    cluster_wants.placement_loss.place_lost = timed(real_lost)  # type: ignore[assignment]

    def restore() -> None:
        cluster_rules.placement.place = real  # type: ignore[assignment]
        cluster_wants.placement_loss.place_lost = real_lost  # type: ignore[assignment]

    sim.restore_place = restore  # type: ignore[attr-defined]


def window(sim: Sim, t0: float, t1: float) -> dict[str, Any]:
    sel = [e for e in sim.entries if t0 <= e[0] < t1]
    span = max(t1 - t0, 1e-9)
    other: Counter[str] = Counter()
    for t, what, cpu in sim.work:
        if t0 <= t < t1:
            other[what] += cpu
    apply_cpu = sum(e[2] for e in sel)
    return {
        "seconds": round(span, 3),
        "entries": len(sel),
        "entries_per_s": round(len(sel) / span, 1),
        "by_op": dict(Counter(e[1] for e in sel)),
        "apply_cpu_s": round(apply_cpu, 3),
        "apply_cpu_per_s": round(apply_cpu / span, 3),
        # the leader's other work per simulated second (one Python process: one core at most)
        "leader_cpu_per_s": {k: round(v / span, 3) for k, v in sorted(other.items())},
        "leader_total_cpu_per_s": round((apply_cpu + sum(other.values())) / span, 3),
        "bytes_per_s": round(sum(e[3] for e in sel) / span),
    }


def simulate(cfg: Settings, progress: bool = False) -> dict[str, Any]:
    """Starts the cluster, measures steady state, fails a rack, runs until every bucket is back
    at RF (or the horizon). Returns the figures."""
    sim = Sim(cfg)
    timed_place(sim)
    try:
        t_real = time.perf_counter()
        sim.start()
        initial_place = list(sim.placements)
        if progress:
            print(f"  placed; real {time.perf_counter() - t_real:.0f}s", file=sys.stderr)
        warm = sim.now + cfg.lease.duration + cfg.heartbeat  # every lease renewed at least once
        sim.run_until(warm)
        sim.run_until(warm + cfg.steady)
        steady = window(sim, warm, warm + cfg.steady)
        t0 = time.process_time()
        clone = copy.deepcopy(sim.model)
        deepcopy_s = time.process_time() - t0  # what every dry run cost before issue 26
        state_bytes = len(pickle.dumps({"model": clone}))
        t1 = time.process_time()
        pysyncobj_dump({"model": clone})  # pickle + gzip: the whole dump's work
        whole_s = deepcopy_s + time.process_time() - t1  # in-thread, before issue 40
        del clone
        snapshot_s, child_s, dump_bytes = forked_dump(sim.model)
        fail_at = sim.now
        rack_shared_before = sim.model.rack_shared()
        n_before = len(sim.placements)
        rack = set(sim.ids[: cfg.rack])
        # Buckets with every caught-up copy in the rack: nobody may serve them again until a
        # copy comes back (or an operator writes them off). None with racks (issue 26).
        doomed = [b for b in range(cfg.buckets) if set(sim.model.holders_of(b)) <= rack]
        target = cfg.buckets - len(doomed)
        sim.at(fail_at, "fail", sim.ids[: cfg.rack])
        served_at = rf_at = granted_at = None
        t = fail_at
        while t < fail_at + cfg.horizon and rf_at is None:
            t += cfg.reconcile_interval
            sim.run_until(t)
            if granted_at is None and sim.granted_live() == target:
                granted_at = t - fail_at
            # (each count is a pass over every bucket: only once the one before it is reached)
            if served_at is None and granted_at is not None and sim.served() == target:
                served_at = t - fail_at
            if served_at is not None and sim.at_rf() == target:
                rf_at = t - fail_at
            if progress:
                print(
                    f"  t+{t - fail_at:.2f}s entries {len(sim.entries)} real "
                    f"{time.perf_counter() - t_real:.0f}s",
                    file=sys.stderr,
                )
        failure = window(sim, fail_at, fail_at + (rf_at or cfg.horizon))
        recovery_place = sim.placements[n_before:]
        bad = check_history(sim.model.lease_records(), cfg.lease)
        out = {
            "servers": cfg.servers,
            "buckets": cfg.buckets,
            "rack": cfg.rack,
            "racks": cfg.racks,
            "rack_shared_before": rack_shared_before,
            "transfer_s": cfg.transfer,
            "granted_again_s": None if granted_at is None else round(granted_at, 2),
            "served_again_s": None if served_at is None else round(served_at, 2),
            "rf_again_s": None if rf_at is None else round(rf_at, 2),
            "state_bytes": state_bytes,
            "dump_bytes": dump_bytes,
            "snapshot_s": round(snapshot_s, 3),
            "dump_child_s": round(child_s, 3),
            "whole_dump_s": round(whole_s, 3),
            "steady": steady,
            "failure": failure,
            "initial_place_cpu_s": round(sum(initial_place), 3),
            "place_per_decision_cpu_s": round(max(recovery_place, default=0.0), 3),
            "place_decisions": len(recovery_place),
            "place_recovery_cpu_s": round(sum(recovery_place), 3),
            "full_deepcopy_s": round(deepcopy_s, 3),
            "two_primaries": len(sim.violations),
            "lease_history_violations": len(bad),
            "at_rf_end": sim.at_rf(),
            "all_copies_in_rack": len(doomed),
            "unavailable_end": [b for b in range(cfg.buckets) if sim.model.unavailable(b)],
            "doomed": doomed,
            "real_s": round(time.perf_counter() - t_real, 1),
        }
        out["violations"] = (sim.violations + bad)[:5]
        return out
    finally:
        sim.restore_place()  # type: ignore[attr-defined]


# -- the limits, measured in the same run ------------------------------------------------------
def raft_commit_rate(seconds: float, payload: int = 64) -> dict[str, float]:
    """Commits per second of three pysyncobj nodes in this process on loopback, pipelined (the
    controllers' own settings: controller.raft_node.raft_conf and its bounded transport)."""
    from pysyncobj import SyncObjConsumer, replicated

    from adamps.up.procs import free_port
    from controller.raft_node import make_node, raft_conf

    class Counter_(SyncObjConsumer):
        def __init__(self) -> None:
            super().__init__()
            self.n = 0

        @replicated
        def add(self, blob: bytes) -> int:
            self.n += 1
            return self.n

    ports = [free_port() for _ in range(3)]
    addrs = [f"127.0.0.1:{p}" for p in ports]
    tmp = tempfile.mkdtemp(prefix="scale-sim-raft-")
    consumers = [Counter_() for _ in addrs]
    nodes = [
        make_node(
            a,
            [o for o in addrs if o != a],
            c,
            raft_conf(
                password="scale-sim",
                journal_file=str(Path(tmp) / f"j{i}"),
                dump_file=str(Path(tmp) / f"d{i}"),
            ),
        )
        for i, (a, c) in enumerate(zip(addrs, consumers, strict=True))
    ]
    try:
        deadline = time.monotonic() + 20
        leader = None
        while leader is None and time.monotonic() < deadline:
            time.sleep(0.05)
            leader = next((n for n in nodes if n.getStatus()["state"] == 2), None)
        if leader is None:
            raise RuntimeError("no pysyncobj leader within 20 s")
        c = consumers[nodes.index(leader)]
        done = threading.Semaphore(0)
        blob = b"x" * payload
        inflight = threading.BoundedSemaphore(1000)

        def cb(res: Any, err: Any) -> None:
            inflight.release()
            done.release()

        n = 0
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            inflight.acquire()
            c.add(blob, callback=cb)
            n += 1
        for _ in range(n):
            done.acquire(timeout=30)
        elapsed = time.perf_counter() - t0
        return {"commits_per_s": round(n / elapsed, 1), "payload_bytes": payload}
    finally:
        for node in nodes:
            node.destroy()


def report(out: dict[str, Any], raft: dict[str, float], lease_s: float) -> None:
    s, f = out["steady"], out["failure"]
    print(
        f"{out['servers']} servers, {out['buckets']} buckets, RF 3; rack of {out['rack']} fails"
        f" (transfer {out['transfer_s']} s/bucket)"
    )
    racks = (
        f"{-(-out['servers'] // out['rack'])} racks of up to {out['rack']} named, "
        f"{out['rack_shared_before']} buckets with two copies in one rack"
        if out["racks"]
        else "no racks named"
    )
    print(
        f"  {racks}; {out['all_copies_in_rack']} buckets had every copy in the failed rack"
        " (unavailable until it returns); of the others:"
    )
    print(
        f"  every lease on a live server after {out['granted_again_s']} s, every bucket writable"
        f" after {out['served_again_s']} s, back at RF after {out['rf_again_s']} s"
    )
    print(
        f"  replicated state {out['state_bytes'] / 1e6:.1f} MB pickled,"
        f" {out['dump_bytes'] / 1e6:.1f} MB dumped (gzip); dump on the Raft thread"
        f" {out['snapshot_s']} s (fork), in the child {out['dump_child_s']} s wall (in-thread"
        f" before issue 40: {out['whole_dump_s']} s; a whole-state deepcopy, each dry run"
        f" before issue 26: {out['full_deepcopy_s']} s)"
    )
    # pysyncobj dumps the whole state (forked: the Raft thread forks, the child pickles)
    # every `compaction_entries` entries: the share of that thread the dumps take.
    every = _default("compaction_entries") / max(s["entries_per_s"], 1e-9)
    every = min(every, _default("compaction_seconds"))
    out["dump_every_s"] = round(every, 2)
    out["dump_share"] = round(out["snapshot_s"] / every, 3)
    print(
        f"  steady state dumps every {every:.1f} s ({_default('compaction_entries')} entries):"
        f" {out['dump_share']:.3f} of the Raft thread (limit 1.0)"
    )
    rate = raft["commits_per_s"]
    for name, w in (("steady", s), ("failure", f)):
        print(
            f"  {name}: {w['entries_per_s']} entries/s ({w['entries_per_s'] / rate:.3f} of "
            f"pysyncobj's {rate}/s), {w['bytes_per_s'] / 1e6:.2f} MB/s, apply CPU "
            f"{w['apply_cpu_per_s']} s/s; leader total {w['leader_total_cpu_per_s']} s/s"
            f" (limit 1.0) {w['by_op']} {w['leader_cpu_per_s']}"
        )
    print(
        f"  placement: first {out['initial_place_cpu_s']} s CPU; recovery {out['place_decisions']}"
        f" decisions, {out['place_recovery_cpu_s']} s CPU, worst {out['place_per_decision_cpu_s']}"
        f" s (lease {lease_s} s: ratio {out['place_per_decision_cpu_s'] / lease_s:.3f})"
    )
    print(
        f"  safety: {out['two_primaries']} double primaries, "
        f"{out['lease_history_violations']} lease-history violations"
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--servers", type=int, default=1000)
    ap.add_argument("--buckets", type=int, default=100_000)
    ap.add_argument("--rack", type=int, default=50)
    ap.add_argument("--transfer", type=float, default=Settings.transfer)
    ap.add_argument("--sweep", default="", help="server counts (buckets = 100 x, rack = 5%%)")
    ap.add_argument("--raft-seconds", type=float, default=3.0)
    ap.add_argument("--steady", type=float, default=Settings.steady)
    ap.add_argument(
        "--no-racks", action="store_true", help="servers name no rack (placement as before racks)"
    )
    ap.add_argument("--progress", action="store_true")
    args = ap.parse_args(argv)
    raft = raft_commit_rate(args.raft_seconds)
    print(f"pysyncobj, 3 nodes on loopback: {raft['commits_per_s']} commits/s (pipelined)")
    runs = []
    if args.sweep:
        sizes = [(n, 100 * n, max(1, n // 20)) for n in map(int, args.sweep.split(","))]
    else:
        sizes = [(args.servers, args.buckets, args.rack)]
    lease_s = Settings.lease.duration
    for n, nb, rack in sizes:
        out = simulate(
            Settings(
                servers=n,
                buckets=nb,
                rack=rack,
                transfer=args.transfer,
                steady=args.steady,
                racks=not args.no_racks,
            ),
            args.progress,
        )
        report(out, raft, lease_s)  # adds the dump figures to `out`
        runs.append(out)
    print(json.dumps({"raft": raft, "lease_s": lease_s, "runs": runs}))


if __name__ == "__main__":
    main()
