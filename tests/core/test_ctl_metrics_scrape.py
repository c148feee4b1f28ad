"""Issue 36 (idle costs nothing): a controller's gauges of the applied state are computed when
/metrics is scraped, not every second by the leader loop, which walked every bucket five times
on each controller whether anybody scraped or not."""

from __future__ import annotations

from typing import Any

from prometheus_client import generate_latest

from adamps import metrics
from adamps.core.lease import LeaseTerms
from controller.ctl_metrics import ControllerMetrics
from controller.state import ClusterModel, ReplicatedCluster


class CountingCluster(ReplicatedCluster):
    """The real replicated state, counting the reads of it."""

    def __init__(self, model: ClusterModel) -> None:
        super().__init__(model)
        self.reads = 0

    def read(self, fn: Any) -> Any:
        self.reads += 1
        return super().read(fn)


def sample(text: str, name: str) -> float:
    line = next(x for x in text.splitlines() if x.startswith(name + " "))
    return float(line.split()[1])


def test_the_once_a_second_update_does_not_read_the_applied_state() -> None:
    model = ClusterModel(64, LeaseTerms(5.0, 0.1, 0.5), 3, 3)
    cluster = CountingCluster(model)
    m = ControllerMetrics(metrics.new_registry(), cluster)
    for _ in range(10):
        m.update(True, 3, 17, cluster, {"writable": True, "write_failures": 0})
    assert cluster.reads == 0, "the leader loop's metrics update walked the state"


def test_a_scrape_reports_the_state_as_applied_now() -> None:
    model = ClusterModel(64, LeaseTerms(5.0, 0.1, 0.5), 3, 3)
    cluster = ReplicatedCluster(model)
    registry = metrics.new_registry()
    m = ControllerMetrics(registry, cluster)
    m.update(True, 1, 1, cluster)
    text = generate_latest(registry).decode()
    assert sample(text, "adamps_controller_unassigned_buckets") == 64
    assert 'adamps_controller_servers{state="live"} 0.0' in text
    for i in range(3):  # applied after the last update: a scrape still sees it
        model.register(f"ps{i}", f"127.0.0.1:{7000 + i}", now=100.0)
    text = generate_latest(registry).decode()
    assert 'adamps_controller_servers{state="live"} 3.0' in text
    assert sample(text, "adamps_controller_unassigned_buckets") == 0
    assert sample(text, "adamps_controller_under_replicated_buckets") == 0
    assert sample(text, "adamps_controller_table_version") == model.version > 0
    assert sample(text, "adamps_controller_checkpoints") == 0
    assert sample(text, "adamps_controller_is_leader") == 1
