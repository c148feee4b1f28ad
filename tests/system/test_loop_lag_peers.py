"""No replication traffic holds a replicated parameter server's event loop for more than 100 ms
(issue 39: "the loop-lag probe covers every request kind"; test_loop_lag.py probes a standalone
server, which has no peers).

Reference: docs/operations.md, "The event loop"; adamps/wire/looplag.py; tests/looplag_probe.py.

A real cluster (3 controllers, 3 servers, peer identity on, every bucket on all 3) holds a
tensor of 128 MiB in 2 buckets. Probed, on every server's loop (its blocked-time histogram):

- large replication traffic: pushes of the whole tensor, whose two-phase commit carries 64 MiB
  of each bucket to both secondaries over their data ports in frames MACed segment by segment
  (the primary hashes every array once, each secondary hashes every byte it receives: SHA-256
  of 64 MiB held a loop 30-140 ms on each side before it moved to a worker thread);
- a state transfer of a big bucket: a secondary restarted with its disk wiped fetches each
  bucket's snapshot (64 MiB of values with their checksums) from the primary, which reads,
  checksums and sends it, and it decodes, checks and installs it.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable

import numpy as np
import pytest

from adamps.client import ControllerRouting, PSClient
from adamps.layout import Layout, TensorSpec
from adamps.up.cluster import FAST_CONTROLLER_OPTS, FAST_PS_OPTS, LocalCluster
from tests import looplag_probe
from tests.looplag_probe import BOUND, request

pytestmark = pytest.mark.slow

TOKEN = "lag-token"
N_BUCKETS = 2
#: 128 MiB of float32: 64 MiB per bucket
ELEMS = 1 << 25
SHARD = 1 << 18


def _received_transfers(addr: str) -> float:
    code, body = request(addr, "GET", "/metrics")
    assert code == 200
    got = re.search(r'adamps_ps_state_transfers_total\{direction="received"\} (\S+)', body.decode())
    return float(got.group(1)) if got else 0.0


def _held(addrs: list[str], before: dict[str, dict[float, int]]) -> dict[str, int]:
    out = {}
    for a in addrs:
        for hi, n in looplag_probe.over_bound(a).items():
            if n > before[a].get(hi, 0):
                out[f"{a} <= {hi:g} s"] = n - before[a].get(hi, 0)
    return out


def _phase(addrs: list[str], action: Callable[[], set[str]]) -> dict[str, int]:
    """Runs `action` (it returns the addresses of servers it restarted: their histograms start
    again from nothing) and returns the holds past BOUND it caused on any server's loop. As
    looplag_probe.probe: a machine loaded by other work may delay a loop's thread once (a GIL
    hand-over is not counted as waiting for a CPU), so a hold must show in two tries in a row."""
    held: dict[str, int] = {}
    for _ in range(2):
        before = {a: looplag_probe.over_bound(a) for a in addrs}
        restarted = action()
        time.sleep(0.6)  # the probe's next ticks, and the work the action started
        held = _held(addrs, {a: {} if a in restarted else before[a] for a in addrs})
        if not held:
            break
    return held


@pytest.mark.timeout(600)
@pytest.mark.xfail(
    strict=False,
    reason="a known, open hold (issue 39): replicating a 128 MiB push held a server's loop 0.1-0.5 s "
    "in both tries in 1 CI run and in 3 of 7 runs at load 30-45 on 2 cores (4 passed); the "
    "loop's stacks (ADAMPS_LOOP_STACKS) show it waiting at idle points (select, a small "
    "np.empty) while worker threads ran msgpack packb/unpackb of the 64 MiB batch (msgpack "
    "copies bins holding the GIL), and it copying 1 MiB writes into the transport's buffer "
    "(repl_peers._exchange); the state transfer's bytearray(n) on the loop is fixed (AsyncRpc)",
)
def test_replication_and_state_transfer_do_not_hold_a_servers_loop(tmp_path) -> None:
    c = LocalCluster(tmp_path, token=TOKEN, n_servers=3, n_buckets=N_BUCKETS,
                     controller_opts=FAST_CONTROLLER_OPTS,
                     ps_opts={**FAST_PS_OPTS, "max-shard-elems": SHARD, "flush-interval": 2.0},
                     env=looplag_probe.ENV)  # fmt: skip
    try:
        c.start(timeout=90)
        c.wait_placed(timeout=60)
        spec = TensorSpec("big", (ELEMS,))
        layout = Layout([spec], n_buckets=N_BUCKETS, max_shard_elems=SHARD)
        client = PSClient(ControllerRouting(c.controllers), layout, TOKEN, retry_for=60.0,
                          timeout=120.0)  # fmt: skip
        client.create(spec, init={"kind": "zeros"}, optimizer={"kind": "sgd", "lr": -1.0})
        delta = np.full(ELEMS, 0.25, np.float32)
        addrs = list(c.servers)
        pushes = [0]
        time.sleep(1.0)

        def push() -> set[str]:  # the two-phase commit of a 128 MiB push to both secondaries
            client.push_dense("big", delta)
            pushes[0] += 1
            return set()

        def transfer() -> set[str]:  # each bucket's snapshot to a secondary with an empty disk
            view = c.cluster()
            assert view is not None
            primaries = {b["primary"] for b in view["buckets"]}
            i = c.index_of(next(s for s in c.server_ids if s not in primaries))
            c.kill(c.server_ids[i])
            c.start_server(i, wipe=True)
            deadline = time.monotonic() + 120
            while True:
                try:
                    if _received_transfers(c.servers[i]) >= N_BUCKETS:
                        return {c.servers[i]}
                except (ConnectionError, OSError):
                    pass
                assert time.monotonic() < deadline, (
                    f"server {i} received no snapshot of each bucket"
                )
                time.sleep(0.3)

        replication = _phase(addrs, push)
        transfer_held = _phase(addrs, transfer)
        values, _ = client.pull(["big"])
        client.close()
        np.testing.assert_array_equal(values["big"], np.full(ELEMS, 0.25 * pushes[0], np.float32))
        assert not replication, (
            f"replicating a 128 MiB push held a server's loop past {BOUND} s: {replication}"
        )
        assert not transfer_held, (
            f"a state transfer of 64 MiB buckets held a server's loop past {BOUND} s: "
            f"{transfer_held}"
        )
    finally:
        c.stop()
