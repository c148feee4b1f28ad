"""The controller's metrics (``adamps_controller_*``): its Raft node, the cluster's servers and
buckets, and the writes it proposed."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from adamps import metrics
from controller.state import ClusterModel, ReplicatedCluster


class ControllerMetrics:
    """Counters and gauges of one controller node."""

    def __init__(
        self, registry: CollectorRegistry, cluster: ReplicatedCluster | None = None
    ) -> None:
        r = registry
        self.started = time.time()
        #: the gauges of the applied state, computed at each scrape
        self.state = StateGauges(self.started, cluster)
        registry.register(self.state)
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
        """The gauges from the node's Raft view and its journal's state (cheap: once a second
        from the leader loop); those of the applied state are computed at scrape time
        (`StateGauges`)."""
        self.leader.set(1 if leader else 0)
        if journal is not None:
            self.journal_writable.set(1 if journal["writable"] else 0)
            failed = journal["write_failures"]
            if failed > self._journal_failures_seen:
                self.journal_failures.inc(failed - self._journal_failures_seen)
                self._journal_failures_seen = failed
        self.term.set(term)
        self.commit.set(commit_index)
        self.state.cluster = cluster


class StateGauges(Collector):
    """The gauges read off the applied state (servers by state, buckets under-replicated,
    unassigned, unavailable, lost, rack-shared, the table version, the last periodic
    checkpoint), computed when /metrics is scraped (issue 36: idle costs nothing). Set every
    second, they walked every bucket five times on each controller whether anybody scraped or
    not: a third of an idle follower's event loop."""

    def __init__(self, started: float, cluster: ReplicatedCluster | None = None) -> None:
        #: the controller's applied state (None: nothing to report yet)
        self.cluster = cluster
        #: when this controller started (the checkpoint age before the first checkpoint)
        self.started = started

    def describe(self) -> Iterator[GaugeMetricFamily]:
        return iter(self._families())

    def collect(self) -> Iterator[GaugeMetricFamily]:
        fams = self._families()
        if self.cluster is None:
            return iter(())
        states, under, unassigned, unavailable, lost, version, conflicts, shared, rec = (
            self.cluster.read(_snap)
        )
        for k, v in states.items():
            fams[0].add_metric([k], v)
        figures = [under, unassigned, unavailable, lost, conflicts, shared, version]
        last = rec.get("last") or {}
        age = time.time() - (last["finished"] if last else self.started)
        figures += [
            max(0.0, age),
            last.get("bytes", 0),
            last.get("written_bytes", 0),
            last.get("seconds", 0),
            last.get("hold_ms", 0.0) / 1e3,
            rec["count"],
        ]
        for fam, v in zip(fams[1:], figures, strict=True):
            fam.add_metric([], v)
        return iter(fams)

    @staticmethod
    def _families() -> list[GaugeMetricFamily]:
        return [
            GaugeMetricFamily(
                "adamps_controller_servers", "parameter servers by state", labels=["state"]
            ),
            GaugeMetricFamily(
                "adamps_controller_under_replicated_buckets",
                "buckets with fewer copies than the replication",
            ),
            GaugeMetricFamily(
                "adamps_controller_unassigned_buckets", "buckets without a live lease holder"
            ),
            GaugeMetricFamily(
                "adamps_controller_unavailable_buckets",
                "buckets that held data and have no live copy to serve them (pushes and pulls "
                "get 503 bucket_unavailable until a candidate copy is back or an operator "
                "declares them lost)",
            ),
            GaugeMetricFamily(
                "adamps_controller_buckets_declared_lost",
                "buckets an operator declared lost (POST /buckets/{b}/declare-lost), in the "
                "replicated record (survives controller restarts)",
            ),
            GaugeMetricFamily(
                "adamps_controller_digest_conflicts",
                "times candidates of a bucket at the same (epoch, seq) offered copies whose "
                "values' digests disagreed, in the replicated record: resolved by majority or "
                "left unavailable, never silently",
            ),
            GaugeMetricFamily(
                "adamps_controller_rack_shared_buckets",
                "buckets with two caught-up copies in one rack: a failure of that rack "
                "takes both; 0 while the eligible servers span at least replication racks",
            ),
            GaugeMetricFamily("adamps_controller_table_version", "routing table version"),
            # Issue 24: periodic checkpoints (controller/ckpt_schedule.py). Age, size and
            # duration come from the replicated record, so every controller reports the same.
            GaugeMetricFamily(
                "adamps_controller_checkpoint_age_seconds",
                "seconds since the last periodic checkpoint finished (before the first: since "
                "this controller started, so that checkpoints that never succeed still age)",
            ),
            GaugeMetricFamily(
                "adamps_controller_checkpoint_bytes",
                "bytes of the files the last periodic checkpoint names (its own and its bases')",
            ),
            GaugeMetricFamily(
                "adamps_controller_checkpoint_written_bytes",
                "bytes the last periodic checkpoint wrote (incremental: only what changed)",
            ),
            GaugeMetricFamily(
                "adamps_controller_checkpoint_duration_seconds",
                "how long the last periodic checkpoint took",
            ),
            GaugeMetricFamily(
                "adamps_controller_checkpoint_hold_seconds",
                "how long the last periodic checkpoint held writes for its cut (0: per-bucket "
                "cuts)",
            ),
            GaugeMetricFamily("adamps_controller_checkpoints", "periodic checkpoints completed"),
        ]


def _snap(m: ClusterModel) -> tuple[Any, ...]:
    """The applied state's figures `StateGauges` reports (under the state's lock)."""
    states: dict[str, int] = {"live": 0, "dead": 0, "draining": 0}
    for rec in m.servers.values():
        states[rec["state"]] = states.get(rec["state"], 0) + 1
    unassigned = sum(1 for b in range(m.n_buckets) if not m.holder_live(b))
    unavailable = sum(1 for b in range(m.n_buckets) if m.unavailable(b))
    lost = getattr(m, "declared_lost", 0)
    conflicts = getattr(m, "digest_conflicts", 0)
    under = m.under_replicated()
    shared = m.rack_shared()
    ckpt = dict(m.checkpoint_record())
    return states, under, unassigned, unavailable, lost, m.version, conflicts, shared, ckpt
