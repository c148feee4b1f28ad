"""The controller's metrics (``adamps_controller_*``): its Raft node, the cluster's servers and
buckets, and the writes it proposed."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from adamps import metrics
from controller.state import ClusterModel, ReplicatedCluster


class ControllerMetrics:
    """Counters and gauges of one controller node."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.started = time.time()
        self.leader = Gauge(
            "adamps_controller_is_leader", "1 if this node is the Raft leader", registry=r
        )
        self.term = Gauge("adamps_controller_raft_term", "current Raft term", registry=r)
        self.commit = Gauge("adamps_controller_commit_index", "Raft commit index", registry=r)
        # Issue 39: a controller that cannot write its Raft journal (its data_dir is full or
        # failing) stands aside: it does not lead, vote or acknowledge entries until it can.
        self.journal_writable = Gauge(
            "adamps_controller_journal_writable",
            "1 if this controller can write its Raft journal; 0: it stands aside (no leading, "
            "voting or acknowledging) until space returns (see its log and /status raft.journal)",
            registry=r,
        )
        self.journal_failures = Counter(
            "adamps_controller_journal_write_failures_total",
            "writes of the Raft journal or its term/vote file that failed (each episode logged)",
            registry=r,
        )
        self._journal_failures_seen = 0
        self.servers = Gauge(
            "adamps_controller_servers", "parameter servers by state", ["state"], registry=r
        )
        self.under = Gauge(
            "adamps_controller_under_replicated_buckets",
            "buckets with fewer copies than the replication",
            registry=r,
        )
        self.unassigned = Gauge(
            "adamps_controller_unassigned_buckets",
            "buckets without a live lease holder",
            registry=r,
        )
        self.unavailable = Gauge(
            "adamps_controller_unavailable_buckets",
            "buckets that held data and have no live copy to serve them (pushes and pulls get "
            "503 bucket_unavailable until a candidate copy is back or an operator declares them "
            "lost)",
            registry=r,
        )
        self.lost = Gauge(
            "adamps_controller_buckets_declared_lost",
            "buckets an operator declared lost (POST /buckets/{b}/declare-lost), in the "
            "replicated record (survives controller restarts)",
            registry=r,
        )
        self.digest_conflicts = Gauge(
            "adamps_controller_digest_conflicts",
            "times candidates of a bucket at the same (epoch, seq) offered copies whose values' "
            "digests disagreed, in the replicated record: resolved by majority or "
            "left unavailable, never silently",
            registry=r,
        )
        self.rack_shared = Gauge(
            "adamps_controller_rack_shared_buckets",
            "buckets with two caught-up copies in one rack: a failure of that rack "
            "takes both; 0 while the eligible servers span at least replication racks",
            registry=r,
        )
        self.version = Gauge("adamps_controller_table_version", "routing table version", registry=r)
        self.writes = Counter(
            "adamps_controller_writes_total",
            "writes proposed by this node, by operation and result",
            ["op", "result"],
            registry=r,
        )
        self.write_s = Histogram(
            "adamps_controller_commit_seconds",
            "time from proposal to commit",
            buckets=metrics.LATENCY_BUCKETS,
            registry=r,
        )
        self.refused = Counter(
            "adamps_controller_refused_total",
            "mutating calls this node refused (4xx), by endpoint (the bucket operation or the "
            "route's last segment: declare-lost, drain, rebalance, layout, register, "
            "heartbeat, ...) and reason (the error code); each is also logged",
            ["endpoint", "reason"],
            registry=r,
        )
        self.forwarded = Counter(
            "adamps_controller_forwarded_total", "writes forwarded to the leader", registry=r
        )
        self.heartbeats = Counter(
            "adamps_controller_heartbeats_total", "server heartbeats handled as leader", registry=r
        )
        # Issue 24: periodic checkpoints (controller/ckpt_schedule.py). Age, size and duration
        # come from the replicated record, so every controller reports the same figures.
        self.ckpt_age = Gauge(
            "adamps_controller_checkpoint_age_seconds",
            "seconds since the last periodic checkpoint finished (before the first: since this "
            "controller started, so that checkpoints that never succeed still age)",
            registry=r,
        )
        self.ckpt_bytes = Gauge(
            "adamps_controller_checkpoint_bytes",
            "bytes of the files the last periodic checkpoint names (its own and its bases')",
            registry=r,
        )
        self.ckpt_written = Gauge(
            "adamps_controller_checkpoint_written_bytes",
            "bytes the last periodic checkpoint wrote (incremental: only what changed)",
            registry=r,
        )
        self.ckpt_seconds = Gauge(
            "adamps_controller_checkpoint_duration_seconds",
            "how long the last periodic checkpoint took",
            registry=r,
        )
        self.ckpt_hold = Gauge(
            "adamps_controller_checkpoint_hold_seconds",
            "how long the last periodic checkpoint held writes for its cut (0: per-bucket cuts)",
            registry=r,
        )
        self.ckpt_count = Gauge(
            "adamps_controller_checkpoints", "periodic checkpoints completed", registry=r
        )
        self.ckpt_interval = Gauge(
            "adamps_controller_checkpoint_interval_seconds",
            "the checkpoint_interval setting (0: periodic checkpoints are off)",
            registry=r,
        )
        self.ckpt_failures = Counter(
            "adamps_controller_checkpoint_failures_total",
            "periodic checkpoints this node began as leader that failed (each one logged)",
            registry=r,
        )
        self.dead = Counter(
            "adamps_controller_servers_declared_dead_total",
            "servers declared dead by this leader",
            registry=r,
        )

    def update(
        self,
        leader: bool,
        term: int,
        commit_index: int,
        cluster: ReplicatedCluster,
        journal: dict | None = None,
    ) -> None:
        """The gauges from the node's Raft view, its journal's state and its applied state."""
        self.leader.set(1 if leader else 0)
        if journal is not None:
            self.journal_writable.set(1 if journal["writable"] else 0)
            failed = journal["write_failures"]
            if failed > self._journal_failures_seen:
                self.journal_failures.inc(failed - self._journal_failures_seen)
                self._journal_failures_seen = failed
        self.term.set(term)
        self.commit.set(commit_index)

        def snap(m: ClusterModel) -> tuple[dict[str, int], int, int, int, int, int, int, int]:
            states: dict[str, int] = {"live": 0, "dead": 0, "draining": 0}
            for rec in m.servers.values():
                states[rec["state"]] = states.get(rec["state"], 0) + 1
            unassigned = sum(1 for b in range(m.n_buckets) if not m.holder_live(b))
            unavailable = sum(1 for b in range(m.n_buckets) if m.unavailable(b))
            lost = getattr(m, "declared_lost", 0)
            conflicts = getattr(m, "digest_conflicts", 0)
            shared = m.rack_shared()
            under = m.under_replicated()
            return states, under, unassigned, unavailable, lost, m.version, conflicts, shared

        states, under, unassigned, unavailable, lost, version, conflicts, shared = cluster.read(
            snap
        )
        self.rack_shared.set(shared)
        self.digest_conflicts.set(conflicts)
        for k, v in states.items():
            self.servers.labels(k).set(v)
        self.under.set(under)
        self.unassigned.set(unassigned)
        self.unavailable.set(unavailable)
        self.lost.set(lost)
        self.version.set(version)
        rec = cluster.read(lambda m: dict(m.checkpoint_record()))
        last = rec.get("last")
        self.ckpt_count.set(rec["count"])
        if last is not None:
            self.ckpt_age.set(max(0.0, time.time() - last["finished"]))
            self.ckpt_bytes.set(last["bytes"])
            self.ckpt_written.set(last["written_bytes"])
            self.ckpt_seconds.set(last["seconds"])
            self.ckpt_hold.set(last.get("hold_ms", 0.0) / 1e3)
        else:
            self.ckpt_age.set(time.time() - self.started)
