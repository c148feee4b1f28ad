"""What an operator sees of a parameter server's replication: its metrics
(``adamps_ps_replication_*`` and friends, counted from each ``Ready`` and read from the core) and
its part of ``/status``."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from adamps import metrics
from adamps.core.replication import copies as repl_copies
from adamps.core.replication.node import ReplCore
from adamps.core.replication.ready import Ready


class ReplMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        #: buckets with a replication-lag series (removed when the bucket goes)
        self._lag_buckets: set[int] = set()
        self.round_seconds = Histogram(
            "adamps_ps_replication_round_seconds",
            "two-phase-commit round as primary: first prepare to the last commit ack",
            buckets=metrics.LATENCY_BUCKETS,
            registry=registry,
        )
        self.round_pushes = Histogram(
            "adamps_ps_replication_round_pushes",
            "client pushes carried by one round",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 1024),
            registry=registry,
        )
        self.lag = Gauge(
            "adamps_ps_replication_lag_batches",
            "batches committed here that the slowest secondary has not committed, per bucket",
            ["bucket"],
            registry=registry,
        )
        self.failovers = Counter(
            "adamps_ps_failovers",
            "buckets this server became primary of after another server held them",
            registry=registry,
        )
        self.under_replicated = Gauge(
            "adamps_ps_under_replicated_buckets",
            "buckets this server is primary of with fewer than 2 secondaries",
            registry=registry,
        )
        self.stale = Counter(
            "adamps_ps_stale_epoch_rejected",
            "replication messages refused for an old lease epoch",
            registry=registry,
        )
        self.dedup = Counter(
            "adamps_ps_deduplicated_pushes",
            "pushes recognised as retries and not applied again",
            registry=registry,
        )
        self.dropped = Counter(
            "adamps_ps_secondaries_dropped",
            "secondaries reported to the controller as unresponsive",
            registry=registry,
        )
        self.snapshots = Counter(
            "adamps_ps_state_transfers",
            "state transfers by direction (sent, received)",
            ["direction"],
            registry=registry,
        )
        for direction in ("sent", "received"):
            self.snapshots.labels(direction)  # both series exist from the start (dashboards)
        self.primary_buckets = Gauge(
            "adamps_ps_primary_buckets", "buckets this server is primary of", registry=registry
        )
        self.lease_epoch = Gauge(
            "adamps_ps_lease_epoch_max",
            "highest lease epoch among the buckets this server is primary of",
            registry=registry,
        )

    def count(self, rd: Ready) -> None:
        """What the core decided, as counted: rounds, promotions, stale messages, duplicates, secondaries
        dropped (asked of the controllers); a forgotten bucket's lag series goes with it."""
        for seconds, pushes in rd.rounds:
            self.round_seconds.observe(seconds)
            self.round_pushes.observe(pushes)
        if rd.failovers:
            self.failovers.inc(rd.failovers)
        if rd.stale:
            self.stale.inc(rd.stale)
        if rd.duplicates:
            self.dedup.inc(rd.duplicates)
        for req in rd.requests:
            if req.kind == "drop_secondary":
                self.dropped.inc()
        for b in rd.forget:
            if b in self._lag_buckets:
                self._lag_buckets.discard(b)
                self.lag.remove(str(b))

    def observe(self, core: ReplCore) -> None:
        """The gauges of this server's primary buckets."""
        prim = repl_copies.primaries(core)
        reps = core.buckets
        self.primary_buckets.set(len(prim))
        self.under_replicated.set(sum(1 for b in prim if len(reps[b].assignment.secondaries) < 2))
        self.lease_epoch.set(max((reps[b].assignment.epoch for b in prim), default=0))
        for b in prim:
            self.lag.labels(str(b)).set(repl_copies.lag(core, b))
            self._lag_buckets.add(b)


def status(core: ReplCore, address: str, now: float) -> dict[str, Any]:
    """The replication's part of /status: this server, the version of the controllers' record
    it applied, the buckets they report unavailable, and each copy (repl_copies.status)."""
    return {
        "server_id": core.server_id,
        "address": address,
        "table_version": core.table_version,
        "unavailable": sorted(core.unavailable),
        "buckets": repl_copies.status(core, now),
    }
