"""Issue 15's system tests: model parallelism combined with Downpour (Adam 4.4.2: a replica of
several machines, each talking only to its own partition's parameters).

- `adamps train --partitions 2` reaches the held-out accuracy of an unpartitioned replica on
  the built-in data (within 0.015: the spread of repeated unpartitioned runs);
- 2 replicas of 2 partitions each train against replicated servers (3 controllers, 3 parameter
  servers) to >= 96% held-out accuracy although one partition process is SIGKILLed mid-run:
  its replica's other partition stops, no process is left behind, the replica restarts from
  the servers' parameters, and the other replica trains on meanwhile.
"""

from __future__ import annotations

import json
import os
import re
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from adamps.client.rpc import get_json
from adamps.up.procs import free_port
from tests.polling import wait_for
from trainer import export
from trainer.local import builtin_data

pytestmark = pytest.mark.slow


def descendants(pid: int) -> set[int]:
    """Every live process below pid (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                stat = fh.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    out: set[int] = set()
    todo = [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            if c not in out:
                out.add(c)
                todo.append(c)
    return out


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def last_json(text: str) -> dict[str, Any]:
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise AssertionError(f"no JSON summary in:\n{text[-3000:]}")


@pytest.mark.timeout(400)
def test_two_partitions_reach_the_accuracy_of_one(procs, tmp_path: Path) -> None:
    ps_port, ds_port = free_port(), free_port()
    ps = procs.start("ps", "ps", "--port", str(ps_port), "--data-dir", str(tmp_path / "ps"))
    ds = procs.start("ds", "dataserver", "--port", str(ds_port), "--no-augment")
    ps.wait_http(f"http://127.0.0.1:{ps_port}/healthz", 60)
    ds.wait_http(f"http://127.0.0.1:{ds_port}/healthz", 60)
    common = ["train", "--ps", f"http://127.0.0.1:{ps_port}",
              "--dataservers", f"http://127.0.0.1:{ds_port}", "--epochs", "3"]  # fmt: skip
    acc = {}
    for k in (1, 2):
        mport = free_port()
        p = procs.start(f"train-k{k}", *common, "--partitions", str(k), "--run", f"k{k}",
                        "--metrics-port", str(mport))  # fmt: skip
        if k == 2:  # /status and /metrics per partition while it trains
            lead = f"127.0.0.1:{mport}"

            def exchanging(lead: str = lead) -> Any:
                st = get_json(lead, "/status")["partition"]
                return st if st["rounds"] > 0 and st["followers"].get("1") else None

            st = wait_for(exchanging, 120, "the partitions exchanging")
            assert st["partition"] == 0 and st["partitions"] == 2 and st["transport"] == "shm"
            follower = get_json(st["followers"]["1"], "/status")["partition"]
            # the run's namespace first (issue 25), then the partition's tensor
            assert follower["partition"] == 1 and follower["tensors"][0] == "k2..conv1-p1of2.w"
            with urllib.request.urlopen(f"http://{st['followers']['1']}/metrics") as resp:
                metrics = resp.read().decode()
            assert 'adamps_trainer_partition_bytes_exchanged_total{partition="1"}' in metrics
            assert 'adamps_trainer_partition_wait_seconds_total{partition="1"}' in metrics
        assert p.popen.wait(300) == 0, p.tail(60)
        summary = last_json(p.log_path.read_text())
        acc[k] = summary["heldout_accuracy"]["3"]
        if k == 2:
            parts = summary["partitions"]
            assert set(parts) == {"0", "1"}
            for info in parts.values():
                assert info["partition"]["bytes_exchanged"] > 0
                assert info["partition"]["transport"] == "shm"
            assert summary["restarts"] == 0
    assert acc[1] >= 0.95 and acc[2] >= 0.95, acc
    assert abs(acc[2] - acc[1]) <= 0.015, acc


@pytest.mark.timeout(600)
def test_partitioned_replicas_survive_a_partition_kill(procs, tmp_path: Path) -> None:
    ports = [(free_port(), free_port()) for _ in range(3)]
    members = ",".join(f"127.0.0.1:{rp}:{hp}" for rp, hp in ports)
    controllers = [f"127.0.0.1:{hp}" for _, hp in ports]
    for i in range(3):
        procs.start(f"controller{i}", "controller", "--members", members, "--member", str(i),
                    "--data-dir", str(tmp_path / f"c{i}"), "--min-servers", "3")  # fmt: skip
    for c in controllers:
        wait_for(lambda c=c: get_json(c, "/status")["raft"]["has_quorum"], 60, f"{c} quorum")
    for i in range(3):
        port = free_port()
        sid = f"ps{i}"
        p = procs.start(sid, "ps", "--port", str(port), "--data-dir", str(tmp_path / sid),
                        "--controllers", ",".join(controllers), "--server-id", sid,
                        "--no-lmdb-sync")  # fmt: skip
        p.wait_http(f"http://127.0.0.1:{port}/healthz", 60)

    def placed() -> bool:
        table = get_json(controllers[0], "/routing")
        cluster = get_json(controllers[0], "/cluster")
        return (
            bool(table["buckets"])
            and all(b.get("address") for b in table["buckets"])
            and cluster["under_replicated"] == 0
        )

    wait_for(placed, 120, "every bucket placed")
    ds_port = free_port()
    ds = procs.start("ds", "dataserver", "--port", str(ds_port), "--no-augment")
    ds.wait_http(f"http://127.0.0.1:{ds_port}/healthz", 60)

    epochs = 10
    out, history = tmp_path / "model.npz", tmp_path / "history.jsonl"
    common = ["train", "--controllers", ",".join(controllers),
              "--dataservers", f"http://127.0.0.1:{ds_port}", "--n-replicas", "2",
              "--epochs", str(epochs), "--partitions", "2", "--metrics-port", "-1"]  # fmt: skip
    r0 = procs.start("train0", *common, "--replica", "0", "--out", str(out),
                     "--history", str(history))  # fmt: skip
    r1 = procs.start("train1", *common, "--replica", "1")

    # Once replica 1 trains (epoch 1 complete), SIGKILL its partition 1.
    wait_for(lambda: history.exists() and history.read_text().strip(), 300, "epoch 1's end")
    started = re.findall(r"2 partitions at \S+ \(pids \[(\d+), (\d+)\]\)", r1.tail(400))
    assert started, r1.tail(60)
    leader, victim = (int(x) for x in started[-1])
    before = descendants(r1.pid)
    assert leader in before and victim in before
    os.kill(victim, 9)
    # the replica's other partition and every worker of the first attempt go away
    wait_for(lambda: not any(alive(p) for p in before), 60, "the failed replica's processes gone")
    wait_for(lambda: "restarting replica 1" in r1.tail(400), 30, "replica 1 restarting")
    assert r0.alive, r0.tail(60)  # the other replica trains on

    seen = before | descendants(r0.pid) | descendants(r1.pid)
    assert r0.popen.wait(500) == 0, r0.tail(80)
    assert r1.popen.wait(120) == 0, r1.tail(80)
    assert last_json(r1.log_path.read_text())["restarts"] == 1
    lines = [json.loads(x) for x in history.read_text().splitlines()]
    assert lines[-1]["epoch"] == epochs
    assert lines[-1]["accuracy"] >= 0.96, lines
    model, _meta = export.load(out)
    _, _, test_x, test_y = builtin_data()
    assert model.accuracy(model.prepare(test_x), test_y) >= 0.96
    # no orphans: every partition and Hogwild worker seen is gone with its launcher
    wait_for(lambda: not any(alive(p) for p in seen), 10, "no process left behind")


@pytest.mark.timeout(400)
def test_a_killed_leader_restarts_its_replica(procs, tmp_path: Path) -> None:
    """SIGKILL of partition 0 (the leader: data, board, evaluation): its follower notices the
    closed control link and exchanges, exits, and the launcher restarts both; the run ends."""
    ps_port, ds_port = free_port(), free_port()
    ps = procs.start("ps", "ps", "--port", str(ps_port), "--data-dir", str(tmp_path / "ps"))
    ds = procs.start("ds", "dataserver", "--port", str(ds_port), "--no-augment")
    ps.wait_http(f"http://127.0.0.1:{ps_port}/healthz", 60)
    ds.wait_http(f"http://127.0.0.1:{ds_port}/healthz", 60)
    mport = free_port()
    r = procs.start("train", "train", "--ps", f"http://127.0.0.1:{ps_port}",
                    "--dataservers", f"http://127.0.0.1:{ds_port}", "--epochs", "3",
                    "--partitions", "2", "--workers", "2",
                    "--metrics-port", str(mport))  # fmt: skip
    wait_for(lambda: get_json(f"127.0.0.1:{mport}", "/status")["steps"] > 200, 180, "training")
    started = re.findall(r"2 partitions at \S+ \(pids \[(\d+), (\d+)\]\)", r.tail(400))
    leader, _follower = started[-1]  # the attempt running now
    before = descendants(r.pid)
    assert len(before) >= 2 + 2 * 2  # 2 partitions, 2 Hogwild workers each
    os.kill(int(leader), 9)
    wait_for(lambda: not any(alive(p) for p in before), 60, "the first attempt's processes gone")
    seen = descendants(r.pid)
    assert r.popen.wait(300) == 0, r.tail(80)
    summary = last_json(r.log_path.read_text())
    assert summary["restarts"] == 1
    assert summary["heldout_accuracy"]["3"] >= 0.93, summary
    wait_for(lambda: not any(alive(p) for p in seen), 10, "no process left behind")
