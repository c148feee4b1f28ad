"""LocalCluster.start (every test cluster, and `adamps up`): the servers start with the
controllers, not after the controllers answer. A server retries its controllers until they do,
so its start (about half a CPU second of imports, its LMDB) runs while the controllers start and
elect a leader; started one phase after the other, a cluster's start is the sum of the two."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from adamps.up.cluster import FAST_CONTROLLER_OPTS, FAST_PS_OPTS, LocalCluster

pytestmark = pytest.mark.slow

#: how long each controller is held before it execs: longer than a server takes to be spawned
#: after the controllers are, far shorter than a controller's start plus this hold
HOLD = 3.0


@pytest.mark.timeout(120)
def test_servers_are_started_before_the_controllers_answer(tmp_path: Path) -> None:
    spawned = tmp_path / "spawned"
    spawned.mkdir()

    def wrap(name: str, argv: list[str]) -> list[str]:
        # the time each process is spawned, then (a controller) a hold before it runs
        hold = HOLD if name.startswith("controller") else 0
        script = f'date +%s.%N > {spawned / name}; sleep {hold}; exec "$@"'
        return ["sh", "-c", script, "sh", *argv]

    c = LocalCluster(
        tmp_path / "cluster",
        token="test-token",
        n_servers=3,
        n_buckets=8,
        controller_opts=FAST_CONTROLLER_OPTS,
        ps_opts=FAST_PS_OPTS,
        wrap=wrap,
    )
    try:
        t0 = time.time()
        c.start(timeout=60)
        at = {p.name: float(p.read_text()) - t0 for p in spawned.iterdir()}
        controllers = [at[f"controller{i}"] for i in range(3)]
        servers = [at[s] for s in c.server_ids]
        # every server was spawned before any controller could run (held HOLD seconds), let
        # alone answer; one phase after the other, each would be spawned after a controller
        # answered /healthz, at least HOLD seconds after the controllers were spawned
        assert max(servers) < min(controllers) + HOLD, (controllers, servers)
        # and the cluster those servers joined is whole: every bucket placed and replicated
        view = c.cluster()
        assert view is not None and view["unassigned"] == 0 and view["under_replicated"] == 0
    finally:
        c.stop()
