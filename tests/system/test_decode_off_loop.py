"""A large valid compressed push does not block the server's event loop (issues 28 and 39).

Reference: docs/protocol-ps.md, push_compressed and round; docs/operations.md, "Security" and
"The event loop". A push of many full shards in Golomb-Rice form expands millions of codes;
decoded on the event loop it held every connection of the server for a second or more (the PS
missed heartbeats and its buckets failed over). Now it is decoded on a worker thread, over HTTP
and over the data plane, alone (push_compressed) or inside a replica's ``round``: the server's
event loop is never held past 100 ms (its own probe, adamps/wire/looplag.py, which does not count the
time its thread waited for a CPU: a loaded machine does not fail this test, a blocked loop
does), /healthz answers all along, and the push is applied exactly (every element moved by tau
once). On the data port a pull pipelined behind such a push or round still sees it (the order
of one connection), and a round's other large work (the finite bounds of its dense deltas) is
off the loop too.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from adamps.client import PSClient, StaticRouting
from adamps.client.dataplane import DataPlaneClient, DataPlaneError
from adamps.client.rpc import SyncRpc
from adamps.compression import codec
from adamps.layout import Layout, TensorSpec
from adamps.server.updates import bounds
from adamps.up.procs import Proc, adamps_argv, free_port
from tests import looplag_probe

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

pytestmark = pytest.mark.slow

TOKEN = "decode-token"
SHARD = 262_144  # the largest shard: 1 MB
N_SHARDS = 64
#: the largest push this test sizes (1 GiB of float32: the server is started to allow it): a
#: quiet machine decoded 256 shards in 0.077 s, under the bound the push must exceed
MAX_SHARDS = 1024
#: /healthz must answer within this while the push decodes (the issue's bound)
HEALTH_BOUND = 0.1


@pytest.fixture
def server(tmp_path: Path):
    port, dport = free_port(), free_port()
    argv = adamps_argv("ps", "--port", str(port), "--data-port", str(dport),
                       "--data-dir", str(tmp_path / "lmdb"), "--flush-interval", "30",
                       "--max-tensor-elems", str(MAX_SHARDS * SHARD),
                       "--max-body", str(1 << 30))  # fmt: skip
    proc = Proc(argv, tmp_path / "ps.log", env={"ADAMPS_TOKEN": TOKEN,
                "OPENBLAS_NUM_THREADS": "1", **looplag_probe.ENV}, name="ps")  # fmt: skip
    try:
        proc.wait_http(f"http://127.0.0.1:{port}/healthz", timeout=30)
        yield port, proc
    finally:
        proc.stop()


def every_element(layout: Layout, tau: float) -> dict[str, dict]:
    """Each shard's update moving every element by +tau, Golomb-Rice coded (the most codes a
    shard can take)."""
    out = {}
    for s in layout.shards_of["g"]:
        idx = np.arange(s.size, dtype=np.int64)
        data, k = codec.rice_encode(idx, np.zeros(s.size, bool), size=s.size)
        out[s.id] = {"tau": tau, "n": s.size, "k": k, "rice": np.frombuffer(data, np.uint8)}
    return out


def shards_to_decode_for(seconds: float) -> int:
    """How many 1 MB shards take about `seconds` to decode on this machine now (at least
    N_SHARDS, at most MAX_SHARDS): a fast machine needs a larger push to show a blocked loop."""
    layout = Layout([TensorSpec("g", (SHARD,))], n_buckets=1, max_shard_elems=SHARD)
    (u,) = every_element(layout, 0.5).values()
    t0 = time.perf_counter()
    for _ in range(4):
        codec.rice_decode(u["rice"], u["n"], u["k"], SHARD)
    one = (time.perf_counter() - t0) / 4
    return int(min(MAX_SHARDS, max(N_SHARDS, seconds / max(one, 1e-6))))


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("data_plane", "op"),
    [
        (False, "push_compressed"),
        (True, "push_compressed"),
        (True, "round"),
    ],
    ids=["http", "data-plane", "data-plane-round"],
)
def test_healthz_answers_while_a_large_compressed_push_decodes(
    server, data_plane: bool, op: str
) -> None:
    port, proc = server
    base = f"http://127.0.0.1:{port}"
    n_shards = shards_to_decode_for(3 * HEALTH_BOUND)
    while True:
        spec = TensorSpec("g", (n_shards * SHARD,))
        layout = Layout([spec], n_buckets=64, max_shard_elems=SHARD)
        updates = every_element(layout, 0.5)
        # what decoding alone costs in this process, on this machine now: the loop would be
        # held about this long if the server decoded on it; the one-shard estimate above can be
        # off by the machine's noise, so a push that decodes too fast is doubled
        t0 = time.perf_counter()
        for u in updates.values():
            codec.rice_decode(u["rice"], u["n"], u["k"], SHARD)
        decode_s = time.perf_counter() - t0
        if decode_s > 2 * HEALTH_BOUND or n_shards >= MAX_SHARDS:
            break
        n_shards = min(MAX_SHARDS, 2 * n_shards)
    assert len(layout.shards_of["g"]) == n_shards
    client = PSClient(StaticRouting([base], 64), layout, TOKEN, data_plane=data_plane)
    client.create(spec, init={"kind": "zeros"},
                  optimizer={"kind": "sgd", "lr": -1.0})  # fmt: skip

    worst = [0.0]
    addr = f"127.0.0.1:{port}"
    # As tests/looplag_probe.probe: a push that holds the loop does so each time; a machine
    # loaded by other work may delay a loop's thread once (its wait for the GIL while the
    # worker that holds it waits for a CPU is not counted as waiting for a CPU: one CI run saw
    # 0.25-0.5 s once, where a worker's decode, measured alone, let the loop in every 25 ms).
    # A hold counts when two pushes in a row show one.
    tries = 0
    for tries in (1, 2):  # noqa: B007 - the pushes sent are counted below
        held, push_s = _push_and_probe(client, base, addr, updates, op, worst)
        if not held:
            break
    values, _ = client.pull(["g"])
    client.close()
    print(f"decode alone {decode_s:.3f} s, push {push_s:.3f} s, worst /healthz {worst[0]:.3f} s"
          f", loop held past {HEALTH_BOUND} s: {held} ({tries} tries)")  # fmt: skip
    np.testing.assert_array_equal(values["g"], np.full(n_shards * SHARD, 0.5 * tries, np.float32))
    assert decode_s > HEALTH_BOUND, "the push is too small to show a blocked loop here"
    # The server's own measure of how long its loop was held (less the time its thread waited
    # for a CPU): /healthz's answer time, taken in this process beside the pushing client, also
    # counts this process's and the server's waits for a CPU on a loaded machine (one CI run
    # saw 0.25 s with no hold on the server's loop). /healthz must still answer within the
    # time a decode on the loop would hold it.
    assert not held, (
        f"the server's event loop was held past {HEALTH_BOUND} s while the push decoded "
        f"({decode_s:.3f} s of decoding): observations by bucket {held}"
    )
    assert worst[0] < max(decode_s, 2 * HEALTH_BOUND), (
        f"/healthz took {worst[0]:.3f} s while the push decoded ({decode_s:.3f} s of decoding)"
    )
    assert proc.alive


def _push_and_probe(
    client: PSClient, base: str, addr: str, updates: dict, op: str, worst: list[float]
) -> tuple[dict[float, int], float]:
    """Sends the push (or round) while a thread asks /healthz every 10 ms (its worst answer
    time into `worst`); returns the server's new loop holds past the bound and the push's time."""
    stop = threading.Event()
    before = looplag_probe.over_bound(addr)

    def probe() -> None:
        with SyncRpc(base, TOKEN, timeout=10) as rpc:
            while not stop.is_set():
                t = time.perf_counter()
                assert rpc.get_json("/healthz")["ok"]
                worst[0] = max(worst[0], time.perf_counter() - t)
                time.sleep(0.01)

    th = threading.Thread(target=probe)
    th.start()
    try:
        time.sleep(0.2)
        t_push = time.perf_counter()
        if op == "round":  # as a replica's round carries them (adamps/client/round.py)
            client.round(compressed=updates)
        else:
            client.push_compressed(updates)
        push_s = time.perf_counter() - t_push
        time.sleep(0.1)  # the probe's next ticks
    finally:
        stop.set()
        th.join(10)
    held = {
        hi: n - before.get(hi, 0)
        for hi, n in looplag_probe.over_bound(addr).items()
        if n > before.get(hi, 0)
    }
    return held, push_s


@pytest.mark.timeout(120)
def test_a_pull_pipelined_behind_a_large_compressed_push_sees_it(server) -> None:
    """docs/protocol-ps.md: on one data-plane connection requests are applied in the order sent
    and a pull sees the pushes sent before it. A large compressed push is decoded on a worker
    thread; the connection reads no later frame until it is queued, so a pull sent right behind
    it (in the same write, before any reply) still sees every element moved."""
    port, _proc = server
    base = f"http://127.0.0.1:{port}"
    spec = TensorSpec("g", (N_SHARDS * SHARD,))
    layout = Layout([spec], n_buckets=64, max_shard_elems=SHARD)
    client = PSClient(StaticRouting([base], 64), layout, TOKEN, data_plane=False)
    client.create(spec, init={"kind": "zeros"}, optimizer={"kind": "sgd", "lr": -1.0})
    client.close()
    with SyncRpc(base, TOKEN) as rpc:
        dport = int(rpc.get_json("/status")["data_port"])
    ids = [s.id for s in layout.shards_of["g"]]
    outs = [np.empty(SHARD, np.float32) for _ in ids]
    with DataPlaneClient("127.0.0.1", dport, TOKEN, timeout=60) as dp:
        for round_ in (1, 2):
            assert dp.send_message("push_compressed", shards=every_element(layout, 0.5))
            dp.send_pull_shards(ids)  # sent before the push's reply: pipelined behind it
            dp.read_push_reply()
            dp.read_pull_reply(outs)
            for o in outs:
                np.testing.assert_array_equal(o, np.full(SHARD, 0.5 * round_, np.float32))


@pytest.mark.timeout(120)
def test_a_pull_pipelined_behind_a_large_round_sees_it(server) -> None:
    """docs/protocol-ps.md, ``round``: on one data-plane connection requests are applied in
    the order sent. A round's large compressed updates are decoded on a worker thread; the
    connection reads no later frame until the round's writes are queued, so a pull sent right
    behind it (in the same write, before any reply) sees every element moved. Before, only
    push_compressed held the connection: the pull overtook the round and read old values."""
    port, _proc = server
    base = f"http://127.0.0.1:{port}"
    spec = TensorSpec("g", (N_SHARDS * SHARD,))
    layout = Layout([spec], n_buckets=64, max_shard_elems=SHARD)
    client = PSClient(StaticRouting([base], 64), layout, TOKEN, data_plane=False)
    client.create(spec, init={"kind": "zeros"}, optimizer={"kind": "sgd", "lr": -1.0})
    client.close()
    with SyncRpc(base, TOKEN) as rpc:
        dport = int(rpc.get_json("/status")["data_port"])
    ids = [s.id for s in layout.shards_of["g"]]
    outs = [np.empty(SHARD, np.float32) for _ in ids]
    with DataPlaneClient("127.0.0.1", dport, TOKEN, timeout=60) as dp:
        for round_ in (1, 2):
            comp = every_element(layout, 0.5)
            assert dp.send_message("round", compressed=comp, client="c", seq=round_)
            dp.send_pull_shards(ids)  # sent before the round's reply: pipelined behind it
            dp.read_message_reply()
            dp.read_pull_reply(outs)
            for o in outs:
                np.testing.assert_array_equal(o, np.full(SHARD, 0.5 * round_, np.float32))


#: shards of the dense round below: 512 MiB of float32, within the server's max_body
DENSE_SHARDS = 512


@pytest.mark.timeout(240)
def test_a_rounds_large_dense_deltas_are_bounded_off_the_loop(server) -> None:
    """A round's dense deltas are checked against the finite bounds (a min and a max pass over
    every value, bounds.check_dense) before anything is queued: for a round of 512 MiB that
    is a tenth of a second or more, run on a worker thread, not on the event loop. The
    server's loop is never held past the bound, the round is applied, and a NaN among a
    round's deltas still refuses it whole."""
    port, proc = server
    base = f"http://127.0.0.1:{port}"
    addr = f"127.0.0.1:{port}"
    n = DENSE_SHARDS * SHARD
    spec = TensorSpec("d", (n,))
    layout = Layout([spec], n_buckets=64, max_shard_elems=SHARD)
    client = PSClient(StaticRouting([base], 64), layout, TOKEN, data_plane=True, timeout=120)
    client.create(spec, init={"kind": "zeros"}, optimizer={"kind": "sgd", "lr": -1.0})
    delta = np.full(n, 0.25, np.float32)
    t0 = time.perf_counter()  # what the checks alone cost here: the hold if run on the loop
    bounds.check_dense("dense", delta)
    check_s = time.perf_counter() - t0
    if check_s <= HEALTH_BOUND:  # a round within max_body cannot be made larger here
        pytest.skip(f"this machine checks 512 MiB in {check_s:.3f} s, within the {HEALTH_BOUND} s "
                    "bound: a hold on the loop could not be told from none")  # fmt: skip
    with SyncRpc(base, TOKEN) as rpc:
        dport = int(rpc.get_json("/status")["data_port"])
    ids = [s.id for s in layout.shards_of["d"]]
    before = looplag_probe.over_bound(addr)
    with DataPlaneClient("127.0.0.1", dport, TOKEN, timeout=120) as dp:
        assert dp.send_message("round", dense_shards=ids, dense=delta, client="d", seq=1)
        dp.read_message_reply()
    time.sleep(0.2)  # the probe's next ticks
    held = {hi: k - before.get(hi, 0) for hi, k in looplag_probe.over_bound(addr).items()
            if k > before.get(hi, 0)}  # fmt: skip
    del delta
    bad = np.full(SHARD, 0.25, np.float32)
    bad[7] = np.nan
    with DataPlaneClient("127.0.0.1", dport, TOKEN, timeout=60) as dp:
        assert dp.send_message("round", dense_shards=ids[:1], dense=bad, client="d", seq=2)
        with pytest.raises(DataPlaneError) as err:
            dp.read_message_reply()
    assert err.value.code == "non_finite"
    values, _ = client.pull(["d"])
    client.close()
    print(f"bounds alone {check_s:.3f} s; loop held past {HEALTH_BOUND} s: {held}")
    np.testing.assert_array_equal(values["d"], np.full(n, 0.25, np.float32))
    assert not held, f"the server's event loop was held past {HEALTH_BOUND} s: {held}"
    assert proc.alive
