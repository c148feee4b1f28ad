"""`adamps train --controllers`: the routing table, the model's layout and the replicas' epoch
progress come from a real controller (Adam 3.2.5: progress is recorded at the controller).

One controller process, one parameter server, one data server, two replicas. The parameter
server runs on its static bucket map (all buckets); the test registers it at the controller and
heartbeats for it, so the controller places every bucket on it and serves a routing table. (The
full replicated cluster, with servers that register themselves, is
tests/system/test_train_replicated.py.)
"""

from __future__ import annotations

import json
import threading
import urllib.request

import pytest

from adamps.client.controller import ControllerClient
from adamps.layout import Layout
from adamps.up.procs import free_port
from trainer.model import tensor_layout

pytestmark = pytest.mark.slow


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return json.loads(resp.read())


@pytest.mark.timeout(150)
def test_replicas_use_the_controller(procs, tmp_path, token) -> None:
    raft, http, ps_port, ds_port = free_port(), free_port(), free_port(), free_port()
    ctl_addr = f"127.0.0.1:{http}"
    c = procs.start("controller", "controller", "--members", f"127.0.0.1:{raft}:{http}",
                    "--data-dir", str(tmp_path / "c"), "--min-servers", "1",
                    "--server-timeout", "10")  # fmt: skip
    ps = procs.start("ps", "ps", "--port", str(ps_port), "--data-dir", str(tmp_path / "ps"),
                     "--no-lmdb-sync")  # fmt: skip
    ds = procs.start("ds", "dataserver", "--port", str(ds_port), "--no-augment")
    c.wait_http(f"http://{ctl_addr}/healthz", 60)
    ps.wait_http(f"http://127.0.0.1:{ps_port}/healthz", 60)
    ds.wait_http(f"http://127.0.0.1:{ds_port}/healthz", 60)

    ctl = ControllerClient([ctl_addr], token, retry_for=30)
    ctl.register("ps0", f"127.0.0.1:{ps_port}")
    stop = threading.Event()

    def heartbeat() -> None:
        hb = ControllerClient([ctl_addr], token, retry_for=5)
        while not stop.wait(0.5):
            try:
                hb.heartbeat("ps0")
            except (OSError, Exception):  # noqa: BLE001 - keep beating until the test ends
                pass
        hb.close()

    beater = threading.Thread(target=heartbeat, daemon=True)
    beater.start()
    try:
        common = ["train", "--controllers", ctl_addr,
                  "--dataservers", f"http://127.0.0.1:{ds_port}",
                  "--n-replicas", "2", "--epochs", "1", "--warm-start", "20",
                  "--metrics-port", "-1"]  # fmt: skip
        r1 = procs.start("train1", *common, "--replica", "1")
        r0 = procs.start("train0", *common, "--replica", "0",
                         "--history", str(tmp_path / "h.jsonl"))  # fmt: skip
        assert r0.popen.wait(120) == 0, r0.tail()
        assert r1.popen.wait(60) == 0, r1.tail()
    finally:
        stop.set()
        beater.join(5)

    # The layout replica 0 stored: every model tensor, the cluster's bucket count.
    stored = Layout.from_dict(ctl.layout()["layout"])
    assert [(n, t.shape) for n, t in stored.tensors.items()] == tensor_layout("adam-mnist")
    assert stored.n_buckets == get_json(f"http://{ctl_addr}/routing")["n_buckets"]
    # Progress recorded at the controller: the warm-start mark and epoch 1 done by both.
    assert ctl.progress(0)["replicas"]["0"]["done"]
    done = ctl.progress(1)["replicas"]
    assert done["0"]["done"] and done["1"]["done"]
    ctl.close()
    line = json.loads((tmp_path / "h.jsonl").read_text().splitlines()[-1])
    assert line["epoch"] == 1 and line["accuracy"] >= 0.8
