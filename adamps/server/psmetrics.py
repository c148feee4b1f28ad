"""The request metrics of a parameter server (``adamps_ps_*``): requests, bytes, latency,
flushes, and gauges of the store."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from adamps import metrics


class PsMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.applied = Counter(
            "adamps_ps_updates_applied",
            "updates applied to shards, by kind",
            ["kind"],
            registry=registry,
        )
        self.requests = Counter(
            "adamps_ps_requests",
            "requests by op (data plane: dp_*) and outcome (ok or the error code)",
            ["op", "outcome"],
            registry=registry,
        )
        self.bytes_in = Counter(
            "adamps_ps_bytes_in",
            "request bytes received (/rpc bodies, data-plane payloads)",
            registry=registry,
        )
        self.bytes_out = Counter(
            "adamps_ps_bytes_out",
            "reply bytes sent (/rpc bodies, data-plane payloads)",
            registry=registry,
        )
        self.latency = Histogram(
            "adamps_ps_request_latency_seconds",
            "time from a complete request body to its reply, by op (pushes: until applied)",
            ["op"],
            buckets=metrics.LATENCY_BUCKETS,
            registry=registry,
        )
        self.flush_seconds = Histogram(
            "adamps_ps_flush_seconds", "duration of a flush (snapshot + LMDB commit)",
            buckets=metrics.LATENCY_BUCKETS, registry=registry,
        )  # fmt: skip
        self.flushed_shards = Counter(
            "adamps_ps_flushed_shards", "shard records written to LMDB", registry=registry
        )
        self.flushed_bytes = Counter(
            "adamps_ps_flushed_bytes", "bytes written to LMDB by flushes", registry=registry
        )
        self.corrupt = Counter(
            "adamps_ps_corrupt_records",
            "persisted or transferred records that failed their checksum, by where they were "
            "found (load, scrub, transfer): never served, the copy rejoins by state transfer",
            ["where"],
            registry=registry,
        )
        for where in ("load", "scrub", "transfer"):
            self.corrupt.labels(where)  # every series exists from the start (dashboards, alerts)
        self.scrubbed_bytes = Counter(
            "adamps_ps_scrubbed_bytes", "bytes of LMDB records verified by the scrub",
            registry=registry,
        )  # fmt: skip
        self.dirty = Gauge(
            "adamps_ps_dirty_shards", "shards with updates not yet flushed", registry=registry
        )
        self.loss_window = Gauge(
            "adamps_ps_loss_window_seconds",
            "age of the oldest update not yet committed to LMDB (what a crash now would lose)",
            registry=registry,
        )
        self.durable = Gauge(
            "adamps_ps_durable",
            "1 while this server may acknowledge pushes; 0 while updates stayed unflushed past "
            "max_unflushed (flushes failing or stalled): pushes get 503 not_durable",
            registry=registry,
        )
        self.flush_starved = Gauge(
            "adamps_ps_flush_starved",
            "1 while updates stayed unflushed past max_unflushed because the flush is starved of "
            "CPU, not stalled on the disk: the server stays durable and keeps its "
            "buckets",
            registry=registry,
        )
        self.flush_age = Gauge(
            "adamps_ps_last_flush_age_seconds",
            "seconds since the last successful flush ended (0 before the first)",
            registry=registry,
        )
        self.flush_failures = Gauge(
            "adamps_ps_flush_failures",
            "flushes that failed since the process started",
            registry=registry,
        )
        self.queue_depth = Gauge(
            "adamps_ps_queue_depth", "work items queued to owner threads", registry=registry
        )
        self.shards = Gauge("adamps_ps_shards", "shards held by this server", registry=registry)
        self.tensors = Gauge(
            "adamps_ps_tensors", "tensors defined on this server", registry=registry
        )
