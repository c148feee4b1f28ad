"""A restarted controller answers state reads only once it applied the cluster state (issue 26).

Before, a controller restarted from its journal answered `GET /routing` with version 0 and no
primaries for about 0.6 s, which the docs define as "never placed". Now it answers `503
unavailable` (a JSON error) until it applied the log up to the leader's commit index, and
clients (PSClient's routing, ControllerClient) move on to another controller or retry.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import pytest

from adamps.client import ControllerRouting, PSClient
from adamps.client.controller import ControllerClient
from adamps.client.rpc import http_json
from adamps.up.cluster import LocalCluster

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from replicated_cluster import TOKEN, make_client, running_cluster  # noqa: E402

pytestmark = pytest.mark.slow


def restart_follower(c: LocalCluster) -> int:
    leader = c.controller_leader()
    i = next(i for i in range(len(c.controllers)) if i != leader)
    c.kill(f"controller{i}")
    c.start_controller(i)
    return i


def test_a_restarted_controller_answers_503_until_it_applied_the_state(tmp_path: Path) -> None:
    with running_cluster(tmp_path, n_servers=3) as c:
        client, _layout = make_client(c)
        client.push_dense("x", np.ones(16_000, np.float32))
        placed = c.cluster()
        assert placed is not None and placed["version"] > 0
        for _round in range(2):
            i = restart_follower(c)
            url = f"http://{c.controllers[i]}"
            answers: list[tuple[int, str]] = []
            good = 0
            deadline = time.monotonic() + 20.0
            while good < 20 and time.monotonic() < deadline:
                code, body = http_json(url + "/routing", timeout=1.0)
                if code == 0:
                    continue  # not listening yet
                if code == 200:
                    good += 1
                    no_primary = [b["bucket"] for b in body["buckets"] if b["primary"] is None]
                    answers.append((code, f"version {body['version']}, no primary {no_primary}"))
                    assert body["version"] > 0 and not no_primary, answers[-3:]
                else:
                    answers.append((code, str(body)))
                    assert code == 503 and body["error"]["code"] == "unavailable", answers[-3:]
                    assert "not yet applied" in body["error"]["message"]
                    for path in ("/cluster", "/servers/ps0", "/leases", "/progress"):
                        code2, body2 = http_json(url + path, timeout=1.0)
                        assert code2 in (200, 503), (path, code2, body2)
                    for path in ("/healthz", "/status"):  # always answer
                        assert http_json(url + path, timeout=1.0)[0] == 200, path
            assert good == 20, answers[-3:]
            print(f"restart {_round}: {sum(a[0] == 503 for a in answers)} answers 503 first")
        # Clients that know only a just-restarted controller retry through its 503s.
        i = restart_follower(c)
        only = [c.controllers[i]]
        fresh = PSClient(ControllerRouting(only), client.layout, TOKEN, retry_for=20.0)
        values, _ = fresh.pull(["x"])
        assert np.array_equal(values["x"], np.ones(16_000, np.float32))
        fresh.close()
        i = restart_follower(c)
        ctl = ControllerClient([c.controllers[i]], TOKEN, retry_for=20.0)
        assert ctl.routing()["version"] > 0
        ctl.close()
        client.close()
