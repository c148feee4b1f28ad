"""A parameter server's replication gauges (its primary buckets, the under-replicated ones, the
highest lease epoch, each one's lag) are read off its replication core when /metrics is
scraped (issue 36: idle costs nothing): they were set at every ping round, every 0.75 s,
walking every primary bucket whether anybody scraped or not. Three cores wired by hand
(tests/core/test_repl_core.py's cluster); no ping or tick between a change and the scrape."""

from __future__ import annotations

import ast
from pathlib import Path

from prometheus_client import CollectorRegistry

from adamps.server.replication.metrics import ReplMetrics
from tests.core.test_repl_core import Cluster, role

ROOT = Path(__file__).resolve().parents[2]


def gauges(reg: CollectorRegistry) -> dict[str, float | None]:
    get = reg.get_sample_value
    return {
        "primary": get("adamps_ps_primary_buckets"),
        "under": get("adamps_ps_under_replicated_buckets"),
        "epoch": get("adamps_ps_lease_epoch_max"),
        "lag0": get("adamps_ps_replication_lag_batches", {"bucket": "0"}),
    }


def test_the_gauges_are_the_cores_at_scrape_time() -> None:
    cl = Cluster()
    a, b = CollectorRegistry(), CollectorRegistry()
    ReplMetrics(a, cl.cores["a"])
    ReplMetrics(b, cl.cores["b"])
    assert gauges(a) == {"primary": 1, "under": 0, "epoch": 1, "lag0": 0}
    assert gauges(b) == {"primary": 0, "under": 0, "epoch": 0, "lag0": None}
    # the controllers drop c: a's next scrape says so, with no ping round in between
    for s in "ab":
        cl.cores[s].on_roles({"version": 2, "roles": [role(0, 2, "a", ["b"])]}, 1.0, 1.0)
    assert gauges(a) == {"primary": 1, "under": 1, "epoch": 2, "lag0": 0}


def test_no_ping_round_sets_a_metric() -> None:
    """The carrier's ping round calls no metrics port (it called ``pinged()``, which walked
    the primary buckets)."""
    src = (ROOT / "adamps" / "server" / "replication" / "carry.py").read_text()
    calls = {
        n.func.attr
        for n in ast.walk(ast.parse(src))
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
    }
    assert "pinged" not in calls
