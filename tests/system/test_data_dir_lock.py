"""Commands typed twice or against what is already there, on a real cluster (issue skeptic20):

- a second `adamps ps` (or `adamps controller`) on a data directory a running server uses is
  refused at once, naming the directory and the process holding it (it opened the same LMDB
  environment and ran beside the first); the first one keeps serving;
- `adamps checkpoint restore` without `--force` onto a cluster that holds the checkpoint's table
  is refused before any write (the refusal came from the first bucket installed, after the
  restore had created the checkpoint's tensors on the cluster);
- `adamps status --run NAME` of a run that does not exist says so, exit code 1 (it printed an
  empty run, exit code 0)."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from adamps.client import PSClient
from adamps.client.ps import ControllerRouting
from adamps.client.rpc import get_json
from adamps.layout import Layout, TensorSpec
from adamps.up.cluster import FAST_CONTROLLER_OPTS, FAST_PS_OPTS, LocalCluster
from adamps.up.procs import adamps_argv, free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

TOKEN = "a-test-token-of-skeptic20"


def _adamps(tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    keep = {"ADAMPS_FREE_PORT_RANGE"}
    env = {k: v for k, v in os.environ.items() if not k.startswith("ADAMPS_") or k in keep}
    env.update(HOME=str(tmp / "home"), XDG_CONFIG_HOME=str(tmp / "config"), ADAMPS_TOKEN=TOKEN)
    return subprocess.run(adamps_argv(*args), cwd=tmp, env=env, capture_output=True, text=True,
                          timeout=120)  # fmt: skip


def test_mistakes_against_a_running_cluster(tmp_path: Path) -> None:
    c = LocalCluster(
        tmp_path / "cluster", token=TOKEN, n_controllers=1, n_servers=1, n_buckets=8,
        controller_opts={**FAST_CONTROLLER_OPTS, "replication": 1}, ps_opts=FAST_PS_OPTS,
    )  # fmt: skip
    try:
        c.start(timeout=60)
        c.wait_placed(timeout=60)
        ctl = ",".join(c.controllers)
        ps_dir = tmp_path / "cluster" / c.server_ids[0]

        # the same data directory twice: refused at once, the first server untouched
        second = _adamps(tmp_path, "ps", "--port", str(free_port()), "--data-dir", str(ps_dir))
        assert second.returncode == 1, second.stderr[-2000:]
        assert f"data directory {ps_dir} is in use by another process (adamps ps, pid" in (
            second.stderr
        )
        assert "Traceback" not in second.stderr
        ctl_dir = next((tmp_path / "cluster").glob("controller*"))
        port = free_port()
        third = _adamps(tmp_path, "controller", "--members", f"127.0.0.1:{free_port()}:{port}",
                        "--member", "0", "--data-dir", str(ctl_dir))  # fmt: skip
        assert third.returncode == 1 and "is in use by another process (adamps controller" in (
            third.stderr
        ), third.stderr[-2000:]
        assert get_json(c.servers[0], "/healthz", timeout=5)["ok"] is True

        # a checkpoint of a run's tensor and a table; then the run is deleted (its tensor
        # goes), so the cluster holds the table alone
        assert _adamps(tmp_path, "run", "create", "r1", "--controllers", ctl).returncode == 0
        w = TensorSpec("r1..w", (100,))
        client = PSClient(ControllerRouting(c.controllers), Layout([w], n_buckets=8), TOKEN,
                          retry_for=20.0)  # fmt: skip
        try:
            client.create(w, init={"kind": "zeros"}, optimizer={"kind": "sgd", "lr": 0.1})
            client.create_table("emb", 4, optimizer={"kind": "rowwise_adagrad", "lr": 0.05})
            client.push_rows("emb", np.arange(50, dtype=np.int64), np.ones((50, 4), np.float32))
        finally:
            client.close()
        saved = _adamps(tmp_path, "checkpoint", "save", "--to", "ck", "--controllers", ctl)
        assert saved.returncode == 0, saved.stderr[-2000:]
        assert _adamps(tmp_path, "run", "delete", "r1", "--controllers", ctl).returncode == 0

        def tensors() -> list[str]:
            return sorted(get_json(c.servers[0], "/status", timeout=5).get("tensors", {}))

        deadline = time.monotonic() + 30
        while tensors() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert tensors() == []
        out = _adamps(tmp_path, "checkpoint", "restore", "--from", "ck", "--controllers", ctl)
        assert out.returncode == 1, out.stderr[-2000:]
        assert "the cluster already holds tables ['emb']" in out.stderr, out.stderr[-2000:]
        assert tensors() == []  # nothing created before the refusal

        # a run name that does not exist
        nosuch = _adamps(tmp_path, "status", "--run", "nosuch", "--controllers", ctl)
        assert nosuch.returncode == 1, nosuch.stdout + nosuch.stderr
        assert "no run 'nosuch' on this cluster" in nosuch.stderr
    finally:
        c.stop()
