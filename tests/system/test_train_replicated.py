"""Issue 6's system test: 3 controllers, 3 parameter servers (replicated buckets), 1 data server
and 2 `adamps train` replicas train adam-mnist on the built-in data to >= 96% held-out accuracy
(within 20 epochs, at an epoch evaluated after the kill, and with the exported final weights);
a SIGKILL of a parameter server that is primary of model shards during training does not stop
them (Project Adam 3.3.3 fault tolerance under Downpour SGD, DistBelief 4.1).

Needs the parameter servers' replication mode (`adamps ps --controllers ... --server-id ...`);
skipped, saying so, while `adamps ps --help` has no --controllers flag.
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from adamps.client.rpc import get_json
from adamps.layout import Layout
from adamps.up.cluster import FAST_CONTROLLER_OPTS, FAST_PS_OPTS
from adamps.up.procs import adamps_argv, free_port
from tests.polling import wait_for
from trainer import export
from trainer.local import builtin_data

pytestmark = pytest.mark.slow

#: A replica trains an epoch of the built-in data in about 0.4 s, and the whole run can fit in one
#: failover: the pushes stall (about 6 s with the default leases, 2.7 s with the fault tests'
#: timings), every round trained meanwhile is merged into one queued push (back-pressure,
#: docs/training.md "Downpour") and the servers' Adagrad applies it as one step, its square kept in
#: the accumulator. How much of the run collapsed into that step depended on the machine's load,
#: and with 10 epochs so did the accuracy (a CI run ended at 0.93). With the fault tests' timings
#: and 20 epochs, the replicas train on for several epochs after the failover.
EPOCHS = 20
FAILOVER_FLAGS = {
    role: [x for k, v in opts.items() for x in (f"--{k}", str(v))]
    for role, opts in (("controller", FAST_CONTROLLER_OPTS), ("ps", FAST_PS_OPTS))
}


def ps_has_replication() -> bool:
    out = subprocess.run(adamps_argv("ps", "--help"), capture_output=True, text=True, timeout=60)
    return "--controllers" in out.stdout and "--server-id" in out.stdout


@pytest.mark.timeout(420)
def test_replicated_cluster_trains_through_a_primary_kill(procs, tmp_path: Path) -> None:
    if not ps_has_replication():
        pytest.skip("adamps ps has no --controllers/--server-id yet (PS replication not merged)")

    # 3 controllers (Raft)
    ports = [(free_port(), free_port()) for _ in range(3)]
    members = ",".join(f"127.0.0.1:{rp}:{hp}" for rp, hp in ports)
    controllers = [f"127.0.0.1:{hp}" for _, hp in ports]
    for i in range(3):
        procs.start(f"controller{i}", "controller", "--members", members, "--member", str(i),
                    "--data-dir", str(tmp_path / f"c{i}"), "--min-servers", "3",
                    *FAILOVER_FLAGS["controller"])  # fmt: skip
    for c in controllers:
        wait_for(lambda c=c: get_json(c, "/status")["raft"]["has_quorum"], 30, f"{c} quorum")

    # 3 parameter servers registered with the controllers
    # each with a data port: the trainers pull and push dense deltas over it (issue 16)
    ps: dict[str, Any] = {}
    ps_addr: dict[str, str] = {}
    for i in range(3):
        port = free_port()
        sid = f"ps{i}"
        ps_addr[sid] = f"127.0.0.1:{port}"
        ps[sid] = procs.start(sid, "ps", "--port", str(port), "--data-dir", str(tmp_path / sid),
                              "--controllers", ",".join(controllers), "--server-id", sid,
                              "--data-port", str(free_port()), "--no-lmdb-sync",
                              *FAILOVER_FLAGS["ps"])  # fmt: skip
        ps[sid].wait_http(f"http://127.0.0.1:{port}/healthz", 60)

    def placed() -> bool:
        table = get_json(controllers[0], "/routing")
        cluster = get_json(controllers[0], "/cluster")
        return (
            bool(table["buckets"])
            and all(b.get("address") for b in table["buckets"])
            and cluster["under_replicated"] == 0
        )

    wait_for(placed, 90, "every bucket placed on a primary and two caught-up secondaries")

    ds_port = free_port()
    ds = procs.start("ds", "dataserver", "--port", str(ds_port), "--no-augment")
    ds.wait_http(f"http://127.0.0.1:{ds_port}/healthz", 60)

    out, history = tmp_path / "model.npz", tmp_path / "history.jsonl"
    common = ["train", "--controllers", ",".join(controllers),
              "--dataservers", f"http://127.0.0.1:{ds_port}", "--n-replicas", "2",
              "--epochs", str(EPOCHS), "--metrics-port", "-1"]  # fmt: skip
    r0 = procs.start("train0", *common, "--replica", "0", "--out", str(out),
                     "--history", str(history))  # fmt: skip
    r1 = procs.start("train1", *common, "--replica", "1")

    # Once epoch 1 is evaluated, SIGKILL the primary of fc1.w's first shard.
    wait_for(lambda: history.exists() and history.read_text().strip(), 180, "epoch 1's end")
    layout = Layout.from_dict(get_json(controllers[0], "/layout")["layout"])
    bucket = layout.bucket_of["fc1.w/0"]
    table = get_json(controllers[0], "/routing")
    victim = next(b["primary"] for b in table["buckets"] if b["bucket"] == bucket)
    ps[victim].kill()
    killed_at = time.time()

    assert r0.popen.wait(300) == 0, r0.tail(60)
    assert r1.popen.wait(60) == 0, r1.tail(60)
    after = get_json(controllers[0], "/routing")
    new_primary = next(b["primary"] for b in after["buckets"] if b["bucket"] == bucket)
    assert new_primary != victim

    lines = [json.loads(x) for x in history.read_text().splitlines()]
    assert lines[-1]["epoch"] == EPOCHS
    # the run reaches the bar after the kill (an epoch evaluated before it does not count);
    # asynchronous replicas: each epoch is evaluated on the servers' weights while the other
    # replica still pushes (torch's Adagrad, 1 run in 4 ended at 0.958 after 0.961 earlier)
    after_kill = [x["accuracy"] for x in lines if x["time"] > killed_at]
    assert after_kill and max(after_kill) >= 0.96 and lines[-1]["accuracy"] >= 0.95, lines
    model, meta = export.load(out)
    _, _, test_x, test_y = builtin_data()
    assert model.accuracy(model.prepare(test_x), test_y) >= 0.96
    # progress was recorded at the controllers: both replicas finished the last epoch
    progress = get_json(controllers[1], f"/progress?epoch={EPOCHS}")["replicas"]
    assert progress["0"]["done"] and progress["1"]["done"]
    # the trainers used the data plane: the surviving servers served pulls and pushes there
    # (a round's vectors and dense deltas go as one `round` message frame per server, issue 36)
    served = {"dp_pull": 0.0, "dp_round": 0.0}
    for sid, addr in ps_addr.items():
        if sid == victim:
            continue
        with urllib.request.urlopen(f"http://{addr}/metrics", timeout=5) as resp:
            for line in resp.read().decode().splitlines():
                for op in served:
                    if line.startswith("adamps_ps_requests_total{") and f'op="{op}"' in line \
                            and 'outcome="ok"' in line:  # fmt: skip
                        served[op] += float(line.rsplit(" ", 1)[1])
    assert served["dp_pull"] > 0 and served["dp_round"] > 0, served
