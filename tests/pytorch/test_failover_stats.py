"""A failover is visible from adamps.torch (issue 37): a DownpourOptimizer loop on 3 replicated
parameter servers rides through a SIGKILL of the primary of its tensors' bucket; the client logs
one line naming the bucket, the old and the new primary and the seconds stalled, and
``opt.stats()`` counts it."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="adamps.torch needs torch")

import adamps.torch as at  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from replicated_cluster import TOKEN, running_cluster  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_failover_is_logged_and_counted(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="adamps.client")
    with running_cluster(tmp_path, n_servers=3) as c:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        opt = at.DownpourOptimizer(model, controllers=c.controllers, run="fo", token=TOKEN, lr=0.01)
        x, y = torch.randn(32, 4), torch.randn(32, 1)

        def step() -> None:
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()

        for _ in range(5):
            step()
        assert opt.stats()["failovers"] == 0
        client = opt.conn.remote.client
        buckets = {client.layout.bucket_of[s.id] for ss in client.layout.shards_of.values()
                   for s in ss}  # fmt: skip
        routes = client.routing(refresh=True).routes
        bucket = min(buckets)
        old = routes[bucket].primary
        moved = {b for b in buckets if routes[b].primary == old}  # every one fails over
        victim = c.server_ids[[f"http://{a}" for a in c.servers].index(old)]
        c.kill(victim)
        for _ in range(5):
            step()  # the first of these waits for the controllers to promote a secondary
        stats = opt.stats()
        opt.close()
    assert stats["failovers"] == len(moved), (stats, moved)
    last = stats["last_failover"]
    assert last["bucket"] in moved and last["old"] == old and last["new"] != old, stats
    assert last["stalled_s"] > 0
    lines = [r.getMessage() for r in caplog.records if "failover" in r.getMessage()]
    assert len(lines) == len(moved), lines
    assert f"failover: bucket {last['bucket']} primary {old} -> {last['new']}, stalled" in lines[-1]
