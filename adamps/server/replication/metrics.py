"""What an operator sees of a parameter server's replication: its metrics
(``adamps_ps_replication_*`` and friends, counted from each ``Ready`` and read from the core) and
its part of ``/status``."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from adamps import metrics
from adamps.core.replication import copies as repl_copies
from adamps.core.replication.node import ReplCore
from adamps.core.replication.ready import Ready


class ReplMetrics:
    def __init__(self, registry: CollectorRegistry, core: ReplCore) -> None:
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
        self.failovers = Counter(
            "adamps_ps_failovers",
            "buckets this server became primary of after another server held them",
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
        registry.register(PrimaryGauges(core))

    def count(self, rd: Ready) -> None:
        """What the core decided, as counted: rounds, promotions, stale messages, duplicates, secondaries
        dropped (asked of the controllers)."""
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


class PrimaryGauges(Collector):
    """The gauges of this server's primary buckets (how many, how many under-replicated, the
    highest lease epoch, each one's replication lag), computed when /metrics is scraped, on
    the event loop that owns the core. Set at every ping round before (every 0.75 s), they
    walked every primary bucket whether anybody scraped or not (issue 36: idle costs
    nothing)."""

    def __init__(self, core: ReplCore) -> None:
        self.core = core

    def describe(self) -> Iterator[GaugeMetricFamily]:
        return iter(self._families())

    def collect(self) -> Iterator[GaugeMetricFamily]:
        count, under, epoch, lag = fams = self._families()
        core = self.core
        prim = sorted(repl_copies.primaries(core))
        reps = core.buckets
        count.add_metric([], len(prim))
        under.add_metric([], sum(1 for b in prim if len(reps[b].assignment.secondaries) < 2))
        epoch.add_metric([], max((reps[b].assignment.epoch for b in prim), default=0))
        for b in prim:
            lag.add_metric([str(b)], repl_copies.lag(core, b))
        return iter(fams)

    @staticmethod
    def _families() -> list[GaugeMetricFamily]:
        return [
            GaugeMetricFamily("adamps_ps_primary_buckets", "buckets this server is primary of"),
            GaugeMetricFamily(
                "adamps_ps_under_replicated_buckets",
                "buckets this server is primary of with fewer than 2 secondaries",
            ),
            GaugeMetricFamily(
                "adamps_ps_lease_epoch_max",
                "highest lease epoch among the buckets this server is primary of",
            ),
            GaugeMetricFamily(
                "adamps_ps_replication_lag_batches",
                "batches committed here that the slowest secondary has not committed, per bucket",
                labels=["bucket"],
            ),
        ]


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
