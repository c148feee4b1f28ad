"""Prometheus metrics: one registry per server object, injected, never the global default.

Several servers share one process in the integration tests, so every server builds its metrics on
the registry it is given; names start with ``adamps_``.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

#: Latency buckets (seconds) for request/round histograms: 50 us .. 10 s.
LATENCY_BUCKETS = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0,
)  # fmt: skip


def new_registry() -> CollectorRegistry:
    return CollectorRegistry(auto_describe=True)


def exposition(registry: CollectorRegistry) -> tuple[bytes, str]:
    """The registry in the Prometheus text format, with its content type."""
    return generate_latest(registry), CONTENT_TYPE_LATEST
