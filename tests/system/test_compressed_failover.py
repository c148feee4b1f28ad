"""Compressed pushes (Strom's +-tau updates, push_compressed) through replication with real
processes: 3 controllers and 3 parameter servers on loopback, the busiest primary SIGKILLed under
load. Reference: Project Adam 3.3.3 (exactly-once pushes across a failover), Strom 2.5.

The exactness load pushes +1 to distinct elements as compressed updates (tau = 1, SGD lr = -1): at
the end every acknowledged push is present exactly once, failed ones absent, unknown ones at most
once, and every bucket's replicas agree (they applied the same batches, carried compressed)."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from adamps.testing.exactness import ExactnessLoad
from adamps.up.cluster import LocalCluster

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from replicated_cluster import LEASE, digests_agree, make_client, running_cluster  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    with running_cluster(tmp_path, n_servers=3) as c:
        yield c


def test_compressed_push_under_primary_sigkill_is_applied_exactly_once(
    cluster: LocalCluster,
) -> None:
    client, layout = make_client(cluster)
    view = cluster.cluster()
    victim = max(
        cluster.server_ids,
        key=lambda s: sum(1 for b in view["buckets"] if b["primary"] == s),
    )
    led = {b["bucket"] for b in view["buckets"] if b["primary"] == victim}
    load = ExactnessLoad(client, layout, "x", threads=4, compressed=True)
    load.start()
    time.sleep(1.0)
    killed_at = time.monotonic()
    cluster.kill(victim)
    time.sleep(2 * LEASE + 3)
    load.stop()
    values, _ = client.pull(["x"])
    counts = load.check(values["x"])  # acknowledged exactly once, failed absent, unknown <= 1
    print(f"outcomes: {counts}; victim {victim} led buckets {sorted(led)}")
    assert counts["acked"] > 50
    after = [
        e for t, e in load.out.ack_times
        if t > killed_at and layout.bucket_of[next(s.id for s in layout.shards_of["x"] if s.start <= e < s.stop)] in led
    ]  # fmt: skip
    assert after, "no compressed push to the killed primary's buckets succeeded after the kill"
    digests_agree(cluster)
    client.close()
