"""Elastic replicas (issue 25) with real processes: a parameter server, a data server and three
`adamps train --run elastic` trainers without --replica. At epoch 2 one trainer is SIGKILLed for
good; at epoch 3 a new one joins (the
survivors paused until it holds a slice). The run reaches the accuracy target, and the data server's
counters (/runs and /metrics) show every example of every epoch trained, with the dead
trainer's slices handed to the others after its lease."""

from __future__ import annotations

import json
import os
import re
import signal
import time
import urllib.request

import pytest

from adamps.up.procs import free_port

pytestmark = pytest.mark.slow

EPOCHS = 6  # the late joiner (started at epoch 3) has epochs left to train under load
N_TRAIN = 4000  # the built-in data set


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return resp.read().decode()


def run_of(ds_url: str) -> dict:
    return json.loads(get(ds_url + "/runs")).get("elastic", {})


def wait_for(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


@pytest.mark.timeout(300)
def test_a_replica_dies_for_good_and_another_joins(procs, tmp_path) -> None:
    ps_port, ds_port, m_port = free_port(), free_port(), free_port()
    ps = procs.start("ps", "ps", "--port", str(ps_port), "--data-dir", str(tmp_path / "ps"),
                     "--no-lmdb-sync")  # fmt: skip
    ds = procs.start("ds", "dataserver", "--port", str(ds_port), "--no-augment",
                     "--slice-size", "250", "--slice-lease", "3")  # fmt: skip
    ps_url, ds_url = f"http://127.0.0.1:{ps_port}", f"http://127.0.0.1:{ds_port}"
    ps.wait_http(ps_url + "/healthz", 60)
    ds.wait_http(ds_url + "/healthz", 60)
    common = ["train", "--ps", ps_url, "--dataservers", ds_url, "--run", "elastic",
              "--epochs", str(EPOCHS), "--metrics-port", "-1"]  # fmt: skip
    history = tmp_path / "history.jsonl"
    a = procs.start("a", *common[:-2], "--metrics-port", str(m_port), "--history", str(history))
    b = procs.start("b", *common)
    doomed = procs.start("doomed", *common)

    a.wait_http(f"http://127.0.0.1:{m_port}/healthz", 60)

    def status_name() -> str | None:  # null until the replica joined the run
        return json.loads(get(f"http://127.0.0.1:{m_port}/status"))["elastic_replica"]

    wait_for(lambda: status_name() is not None, 60, "a's name in its /status")
    name = status_name()
    assert re.fullmatch(r"[\w.-]+-\d+-[0-9a-f]{6}", name), name  # host-pid-random

    def serving(epoch: int) -> bool:
        return str(epoch) in run_of(ds_url).get("counters", {})

    def all_hold_a_slice() -> bool:  # so the one killed next holds a slice for the others
        run = run_of(ds_url)
        return len(run.get("live", ())) == 3 and sorted(run["held"]) == run["live"]

    wait_for(lambda: serving(2) and all_hold_a_slice(), 150, "epoch 2")
    assert name in run_of(ds_url)["live"]
    doomed.kill()
    wait_for(lambda: serving(3), 150, "epoch 3")
    # The survivors are paused (SIGSTOP: a slow moment of theirs) while the new trainer starts:
    # unpaused, two trainers finished the three epochs left in less time than a new process
    # takes to import and join (a CI run saw it train 0 images). It joins and takes a slice of
    # its own; the paused ones' slices stay theirs until their leases lapse.
    for p in (a, b):
        os.kill(p.popen.pid, signal.SIGSTOP)
    try:
        known = set(run_of(ds_url)["live"]) | set(run_of(ds_url)["held"])
        late = procs.start("late", *common)
        wait_for(lambda: set(run_of(ds_url)["held"]) - known, 120, "the new trainer's slice")
    finally:
        for p in (a, b):
            os.kill(p.popen.pid, signal.SIGCONT)
    for p in (a, b, late):
        assert p.popen.wait(200) == 0, p.tail()

    run = run_of(ds_url)
    assert run["completed"] == EPOCHS
    n_slices = N_TRAIN // 250
    for epoch in map(str, range(1, EPOCHS + 1)):
        c = run["counters"][epoch]
        assert c["trained"] == N_TRAIN and c["slices_done"] == n_slices, (epoch, c)
        assert c["served"] >= N_TRAIN
    # The dead trainer held slices of epoch 2 (it read ahead): they went to the others.
    reissued = sum(c["reissued"] for c in run["counters"].values())
    assert reissued >= 1, run["counters"]
    text = get(ds_url + "/metrics")
    for epoch in range(1, EPOCHS + 1):
        m = re.search(
            rf'^adamps_dataserver_run_examples_trained_total{{epoch="{epoch}",run="elastic"}} (\S+)$',
            text,
            re.M,
        )
        assert m and float(m.group(1)) == N_TRAIN, epoch

    # The run reached the target; every survivor and the late joiner trained some of it.
    # Each line is evaluated on the servers' weights when an epoch completes, while the other
    # trainers push on (asynchronous SGD, a member lost and one joining): one epoch's figure
    # may dip (0.947 after 0.968 was seen once), so the target is reached, then held.
    lines = [json.loads(x) for x in history.read_text().splitlines()]
    assert lines[-1]["epoch"] == EPOCHS, lines
    assert max(x["accuracy"] for x in lines) >= 0.95 and lines[-1]["accuracy"] >= 0.93, lines
    images = [p.summary()["images"] for p in (a, b, late)]
    assert all(n > 0 for n in images), images
    assert "joins run 'elastic'" in late.tail(400)
