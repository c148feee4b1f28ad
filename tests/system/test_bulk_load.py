"""A bulk load of an embedding table at the default flush settings (issue 38, item 3), with
real processes: 3 controllers and 3 parameter servers on loopback, replication factor 3.

2,000,000 rows of dim 8 (Adagrad) pushed in pushes of 100,000 once made every server answer
``not_durable`` ~10 s in, and the idle cluster then re-copied buckets for minutes: a flush wrote
one LMDB record per row (seconds of CPU for a bucket that a state transfer had just replaced
whole), and a transferred copy whose persist waited past max_unflushed behind such a flush was
dropped and asked for again. Now:

- no push is refused (no ``not_durable`` answer on any server), and every row is there, once
  (each pulled row is its initial value after exactly one Adagrad step);
- the settled cluster makes no state transfer for 30 s (``adamps_ps_state_transfers``), and
  the whole run few (a joiner's snapshot fetch timed out at the member timeout, 0.5 s here, so
  a loaded primary's answer of a bucket of rows came too late each time: fetched again and
  again).
"""

from __future__ import annotations

import os
import re
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from adamps.client import ControllerRouting, PSClient
from adamps.client.rpc import SyncRpc
from adamps.layout import Layout
from adamps.tables import initial_rows, normalize_row_init
from adamps.up.cluster import FAST_CONTROLLER_OPTS, LocalCluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

TOKEN = "bulk-load-token"
N_BUCKETS = 16
ROWS = int(os.environ.get("BULK_ROWS", "2000000"))
PUSH = 100_000
DIM = 8
INIT = {"kind": "normal", "std": 0.01, "seed": 1}
LR = 0.1
#: seconds the settled cluster is watched for state transfers
SETTLED_FOR = 30.0  # issue 38's Done when names 30 s


def counts(c: LocalCluster) -> dict[str, tuple[float, float]]:
    """Per server: (pushes answered not_durable, state transfers sent + received)."""
    out = {}
    for name, addr in zip(c.server_ids, c.servers, strict=True):
        txt = urllib.request.urlopen(f"http://{addr}/metrics", timeout=10).read().decode()
        refused = re.findall(
            r'adamps_ps_requests_total\{op="[^"]*",outcome="not_durable"\} (\S+)', txt
        )
        moved = re.findall(r"adamps_ps_state_transfers_total\{direction=\"\w+\"\} (\S+)", txt)
        assert len(moved) == 2, txt[:500]
        out[name] = (sum(map(float, refused)), sum(map(float, moved)))
    return out


def test_a_bulk_load_at_default_flush_settings_is_never_refused_and_settles(
    tmp_path: Path,
) -> None:
    c = LocalCluster(
        tmp_path,
        token=TOKEN,
        n_servers=3,
        n_buckets=N_BUCKETS,
        controller_opts={**FAST_CONTROLLER_OPTS, "replication": 3},
        # the flush settings are the defaults (flush_interval 1 s, max_unflushed 5 s)
        ps_opts={"member-timeout": 0.5, "ping-interval": 0.2, "failover-after": 1.5},
    )
    c.start(timeout=60)
    client = PSClient(ControllerRouting(c.controllers), Layout([], N_BUCKETS), TOKEN, timeout=60.0)
    try:
        c.wait_placed(timeout=60)
        client.create_table("bulk", DIM, init=INIT, optimizer={"kind": "adagrad", "lr": LR})
        ids = np.random.default_rng(0).permutation(ROWS).astype(np.int64) * 7919 - 10**9
        grads = np.full((PUSH, DIM), 1e-3, np.float32)
        t0 = time.monotonic()
        for s in range(0, ROWS, PUSH):
            part = ids[s : s + PUSH]
            client.push_rows("bulk", part, grads[: len(part)])
        took = time.monotonic() - t0
        print(f"bulk load: {ROWS:,} rows in {took:.1f} s: {ROWS / took:,.0f} rows/s at RF 3")
        after_load = counts(c)
        assert all(r == 0 for r, _ in after_load.values()), f"pushes refused: {after_load}"
        # every row once: its initial value after one Adagrad step (torch's rule, state 0:
        # w - lr * g / (sqrt(g * g) + eps), so about w - lr)
        init = normalize_row_init(INIT)
        for s in range(0, ROWS, 250_000):
            part = ids[s : s + 250_000]
            got = client.pull_rows("bulk", part)
            np.testing.assert_allclose(got, initial_rows(init, part, DIM) - LR, atol=1e-5)
        for addr in c.servers:  # RF 3 on 3 servers: each holds every row, none twice
            with SyncRpc(f"http://{addr}", TOKEN) as rpc:
                tables = rpc.call("list_tables")["tables"]
            assert [t["rows_held"] for t in tables] == [ROWS], (addr, tables)
        # settled: every copy placed, then nothing is copied again
        c.wait_placed(timeout=120)
        time.sleep(3)
        before = counts(c)
        # The loop this guards against dropped a transferred copy once its persist waited past
        # max_unflushed (5 s) behind a flush, and asked for it again: a transfer every 5-7 s.
        # 30 s, as issue 38 asks, sees four of them.
        time.sleep(SETTLED_FOR)
        end = counts(c)
        print(f"refused, state transfers: after the load {after_load}, settled {before}, {end}")
        assert {k: v[1] for k, v in end.items()} == {k: v[1] for k, v in before.items()}
        assert all(r == 0 for r, _ in end.values()), f"pushes refused: {end}"
        # and no loop before: a copy dropped under load (the machine's) comes back with one
        # transfer or a few, not one per reconcile (main: over 1,500 during such a load)
        assert sum(m for _, m in end.values()) <= 4 * N_BUCKETS, end
    finally:
        client.close()
        c.stop()
