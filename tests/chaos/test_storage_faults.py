"""Storage faults (issue 29) under exactness load against real processes: 3 controllers and 3
parameter servers on loopback, clients pushing unique +1.0 deltas (SGD lr -1, so every value is
0 or 1), faults injected into the real LMDB files and file systems.

- corruption: every server SIGKILLed, the lowest mantissa bit of every stored 1.0 flipped in ONE
  server's ``data.mdb`` (1.0 -> 1.0000001), all restarted: no value other than 0 or 1 is ever
  served, the corrupted copy is not offered (its records fail their checksum: logged and
  counted) and comes back by state transfer, and every copy's digest agrees at the end with the
  good copies' values.

Reference: issue 29 ("A corrupted copy is served, and then overwrites the good ones").
"""

from __future__ import annotations

import re
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from tests.chaos.nemesis import (
    loss_window,
    lost_buckets,
    probe,
    read_and_check,
    running_cluster,
    settle,
    start_load,
    wait_digests_agree,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(170)]

ONE = np.float32(1.0).tobytes()
ONE_FLIPPED = bytes([ONE[0] ^ 1]) + ONE[1:]  # 1.0000001: the lowest mantissa bit


def flip_ones(path: Path) -> int:
    """Flips the lowest mantissa bit of every float32 1.0 in the file; returns how many."""
    data = path.read_bytes()
    n = data.count(ONE)
    path.write_bytes(data.replace(ONE, ONE_FLIPPED))
    return n


def metric(address: str, name: str) -> float:
    """The sum of every series of metric `name` a process exposes."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as r:
        text = r.read().decode()
    return sum(
        float(m[1]) for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    )


def test_a_corrupted_copy_is_never_served_and_is_replaced_by_state_transfer(
    tmp_path: Path,
) -> None:
    with running_cluster(tmp_path) as c:
        client, load = start_load(c)
        try:
            time.sleep(4.0)
            for sid in c.server_ids:
                c.kill(sid)
            t_crash = time.monotonic()
            victim = c.server_ids[0]
            flipped = flip_ones(tmp_path / victim / "data.mdb")
            assert flipped > 100, f"only {flipped} stored 1.0 values in {victim}'s data.mdb"
            for i in range(len(c.server_ids)):
                c.start_server(i)
            for i, sid in enumerate(c.server_ids):
                c.procs[sid].wait_http(f"http://{c.servers[i]}/healthz", 30)
            lossy = [loss_window(t_crash, time.monotonic())]
            bad: list[str] = []
            seen = probe(client, load, lossy, 10.0, bad)
            print(f"after the restart ({flipped} values flipped in {victim}): {seen}")
            assert not bad, f"served corrupted or lost values: {bad[:3]}"
            why = settle(c, 30.0)
            load.stop()
            counts = read_and_check(c, client, load, lossy, timeout=40.0)
            print(f"outcomes: {counts}; settled: {why or 'yes'}")
            assert counts["acked"] - counts["acked_in_loss_windows"] > 50, counts
            wait_digests_agree(c, timeout=30.0)
            assert not lost_buckets(c), f"/cluster marks buckets lost: {lost_buckets(c)}"
            addr = c.servers[0]
            assert metric(addr, "adamps_ps_corrupt_records_total") > 0
            assert metric(addr, 'adamps_ps_state_transfers_total{direction="received"}') > 0
            log = c.procs[victim].log_path.read_text(errors="replace")
            assert "CORRUPT record" in log and "not offered" in log, log[-2000:]
        finally:
            load.stop()
            client.close()
