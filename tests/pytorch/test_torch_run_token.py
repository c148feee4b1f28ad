"""Issue 25, the PyTorch path: `adamps train --torch ... --run NAME --token-file F` trains with a
run's token alone. Its tensors are NAME..<parameter> on the servers and in the layout, its
progress is reported as NAME/torch/<replica> (which the run's token may write), and the data
server (started with --controllers) streams to it."""

from __future__ import annotations

import json
import subprocess
import urllib.request
from pathlib import Path

import pytest

from adamps.up.cluster import FAST_CONTROLLER_OPTS, FAST_PS_OPTS, LocalCluster
from adamps.up.procs import adamps_argv

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

TRAIN_ARGS = ["--batch-size", "16", "--n-push", "2", "--n-fetch", "4", "--optimizer", "sgd",
              "--lr", "0.1", "--local-lr", "0.1"]  # fmt: skip


def test_a_torch_replica_trains_with_its_runs_token_only(tmp_path: Path) -> None:
    c = LocalCluster(
        tmp_path / "cluster",
        token="torch-run-token-cluster",
        n_servers=3,
        n_buckets=8,
        controller_opts=FAST_CONTROLLER_OPTS,
        ps_opts=FAST_PS_OPTS,
    )
    c.start(timeout=60)
    try:
        token_file = tmp_path / "gamma.token"
        made = subprocess.run(
            adamps_argv("run", "create", "gamma", "--token-file", str(token_file),
                        "--controllers", ",".join(c.controllers)),
            capture_output=True, text=True, timeout=60, env=c.env,
        )  # fmt: skip
        assert made.returncode == 0, made.stderr
        ds = c.start_dataserver("--no-augment", "--controllers", ",".join(c.controllers))
        c.procs["dataserver0"].wait_http(f"http://{ds}/healthz", 60)
        # The trainer's environment still holds the cluster token: --token-file replaces it.
        p = c.start_process(
            "train-gamma", "train", "--torch", "examples.torch_mnist:Net", "--run", "gamma",
            "--token-file", str(token_file), "--controllers", ",".join(c.controllers),
            "--dataservers", f"http://{ds}", "--epochs", "1", "--metrics-port", "-1",
            *TRAIN_ARGS,
        )  # fmt: skip
        assert p.popen.wait(300) == 0, p.tail(60)
        ctl = c.controllers[0]
        with urllib.request.urlopen(f"http://{ctl}/progress?epoch=1", timeout=10) as resp:
            replicas = json.loads(resp.read())["replicas"]
        assert replicas["gamma/torch/0"]["done"], replicas
        with urllib.request.urlopen(f"http://{c.servers[0]}/status", timeout=10) as resp:
            tensors = json.loads(resp.read())["tensors"]
        mine = [n for n in tensors if n.startswith("gamma..")]
        assert mine and "gamma..{0}9.weight" in mine, tensors
        assert set(tensors) == set(mine), tensors  # nothing outside the run's namespace
    finally:
        c.stop()
