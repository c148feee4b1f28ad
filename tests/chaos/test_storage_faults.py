"""Storage faults (issue 29) under exactness load against real processes: 3 controllers and 3
parameter servers on loopback, clients pushing unique +1.0 deltas (SGD lr -1, so every value is
0 or 1), faults injected into the real LMDB files and file systems.

- a full disk (a tmpfs the test mounts, filled while pushes run): the server stops
  acknowledging within max_unflushed, names the full disk, its buckets move; a whole-cluster
  SIGKILL loses nothing acknowledged outside the documented window;
- corruption: every server SIGKILLed, the lowest mantissa bit of every stored 1.0 flipped in ONE
  server's ``data.mdb`` (1.0 -> 1.0000001), all restarted: no value other than 0 or 1 is ever
  served, the corrupted copy is not offered (its records fail their checksum: logged and
  counted) and comes back by state transfer, and every copy's digest agrees at the end with the
  good copies' values.

Reference: issue 29 ("A corrupted copy is served, and then overwrites the good ones").
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from adamps.client.rpc import RpcError, SyncRpc
from adamps.layout import TensorSpec
from adamps.testing.exactness import read_shards
from adamps.up.cluster import LocalCluster
from tests.chaos.nemesis import (
    CONTROLLER_OPTS,
    FLUSH_INTERVAL,
    LOSS_MARGIN,
    N_BUCKETS,
    PS_OPTS,
    SHARD,
    TENSOR,
    TOKEN,
    flip_ones,
    loss_window,
    lost_buckets,
    make_client,
    probe,
    read_and_check,
    settle,
    start_load,
    wait_digests_agree,
)
from tests.chaos.wire_proxy import proxied_cluster, restart

pytestmark = [pytest.mark.slow, pytest.mark.timeout(170)]


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
    """Issue 29, failure 1, and its state transfer damaged on the wire: every server advertises
    a proxy (tests/chaos/wire_proxy.py) that damages the replies to the first 3 snapshot
    requests. The corrupted copy's server rejoins by state transfer through them: it refuses
    each damaged snapshot (logged `CORRUPT snapshot`, counted with where="transfer"), fetches
    it again, and ends bit-identical to the good copies."""
    with proxied_cluster(tmp_path, damage=3) as (c, proxy):
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
                restart(c, proxy, i)
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
            print(f"outcomes: {counts}; settled: {why or 'yes'}; proxy: {proxy.damaged} of "
                  f"{proxy.snapshots} snapshots damaged")  # fmt: skip
            assert counts["acked"] - counts["acked_in_loss_windows"] > 50, counts
            wait_digests_agree(c, timeout=30.0)
            assert not lost_buckets(c), f"/cluster marks buckets lost: {lost_buckets(c)}"
            addr = c.servers[0]
            assert metric(addr, 'adamps_ps_corrupt_records_total{where="load"}') > 0
            assert metric(addr, 'adamps_ps_state_transfers_total{direction="received"}') > 0
            log = c.procs[victim].log_path.read_text(errors="replace")
            assert "CORRUPT record" in log and "not offered" in log, log[-2000:]
            # The snapshots damaged on the wire: each refused where it entered, and fetched again.
            assert proxy.damaged == 3, "the load stored 1.0 values to damage"
            logs = [c.procs[s].log_path.read_text(errors="replace") for s in c.server_ids]
            assert sum(lg.count("CORRUPT snapshot") for lg in logs) == proxy.damaged
            transfer = 'adamps_ps_corrupt_records_total{where="transfer"}'
            assert sum(metric(a, transfer) for a in c.servers) == proxy.damaged
        finally:
            load.stop()
            client.close()


# -- a full disk ---------------------------------------------------------------------------------

MAX_UNFLUSHED = 2.0


def can_mount() -> str | None:
    """Why the disk-fault tests cannot run here, or None."""
    if os.geteuid() != 0:
        return "needs root to mount a tmpfs / loop device"
    with tempfile.TemporaryDirectory() as d:
        r = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", d], capture_output=True
        )
        if r.returncode != 0:
            return f"cannot mount a tmpfs: {r.stderr.decode(errors='replace').strip()}"
        subprocess.run(["umount", d], check=True)
    return None


def fill(mount: Path) -> int:
    """Fills the file system at `mount` (a filler file, written until ENOSPC); returns bytes."""
    n = 0
    chunk = b"\0" * (1 << 16)
    with open(mount / "filler", "wb", buffering=0) as f:
        try:
            while True:
                n += f.write(chunk)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
    return n


def healthz(address: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"http://{address}/healthz", timeout=3) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def wait_until(what: str, timeout: float, fn) -> float:
    """Polls fn() until true; returns the seconds it took. Every wait is bounded."""
    t0 = time.monotonic()
    while not fn():
        assert time.monotonic() - t0 < timeout, f"not within {timeout} s: {what}"
        time.sleep(0.1)
    return time.monotonic() - t0


def mount_tmpfs(root: Path, m: Path) -> None:
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32m", "tmpfs", str(m)], check=True)


def mount_ext4_image(root: Path, m: Path) -> None:
    """An ext4 file system in an image file, loop-mounted at `m` (fsfreeze needs a real one)."""
    for tool in ("mkfs.ext4", "fsfreeze"):
        if shutil.which(tool) is None:
            pytest.skip(f"needs {tool} (util-linux, e2fsprogs)")
    img = root / f"{m.name}.img"
    with open(img, "wb") as f:
        f.truncate(96 << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(img)], check=True, capture_output=True)
    r = subprocess.run(["mount", "-o", "loop", str(img), str(m)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot loop-mount an image: {r.stderr.decode(errors='replace').strip()}")


@contextmanager
def disk_cluster(root: Path, mount=mount_tmpfs, frozen: list[Path] | None = None):
    """A running cluster whose servers' data directories are each a file system of their own
    (`mount`); every mount in `frozen` is thawed before the cluster stops (whatever happened)."""
    why = can_mount()
    if why:
        pytest.skip(why)
    c = LocalCluster(
        root, token=TOKEN, n_controllers=3, n_servers=3, n_buckets=N_BUCKETS,
        controller_opts=CONTROLLER_OPTS, ps_opts={**PS_OPTS, "max-unflushed": MAX_UNFLUSHED},
    )  # fmt: skip
    mounts = [root / sid for sid in c.server_ids]
    mounted = []
    try:
        for m in mounts:
            m.mkdir(parents=True)
            mount(root, m)
            mounted.append(m)
        c.start(timeout=60)
        yield c, mounts
    finally:
        for m in frozen or []:
            subprocess.run(["fsfreeze", "--unfreeze", str(m)], capture_output=True, timeout=30)
        c.stop()
        for m in mounted:
            subprocess.run(["umount", "-l", str(m)], capture_output=True, timeout=30)


def test_every_disk_full_then_a_whole_cluster_crash_loses_only_the_window(tmp_path: Path) -> None:
    """Issue 29, failure 2: one server's disk fills, then every server's (see `full_disk`).
    The one-disk case is this test's first half (it ran alone before: the same cluster)."""
    full_disk(tmp_path)


def big_tensor(client, name: str) -> TensorSpec:
    """Creates a 4 MB tensor, before a disk fills. LMDB writes it into the free pages inside
    its file first: afterwards few are left (see `dirty_all`)."""
    spec = TensorSpec(name, (1_000_000,))
    client.create(spec, init={"kind": "zeros"}, optimizer={"kind": "sgd", "lr": -1.0})
    return spec


def dirty_all(client, spec: TensorSpec) -> None:
    """Dirties every shard of `spec` on every copy (one push), after the disk filled: the next
    flush needs 4 MB of new pages, more than LMDB has free inside its file, so it must grow
    the file, and fails. A full file system alone does not stop LMDB: in steady state each
    flush commits into the pages the previous ones freed, which needs no new space."""
    try:
        client.push_dense(spec.name, np.ones(spec.shape, np.float32))
    except (RpcError, TimeoutError) as exc:  # refused (not durable already): nothing dirtied
        print(f"push of {spec.name}: {exc}")


def cover(times: list[float], width: float) -> list[tuple[float, float]]:
    """The fewest windows of `width` seconds that hold every time of `times` (sorted): greedy,
    each window starting at the first time not yet held."""
    windows: list[tuple[float, float]] = []
    for t in times:
        if not windows or t > windows[-1][1]:
            windows.append((t, t + width))
    return windows


def full_disk(tmp_path: Path) -> None:
    """Issue 29, failure 2. One server's disk fills: within max_unflushed it answers 503
    not_durable and /healthz 503 naming the full disk, the controllers move its primaries
    away while the others keep acknowledging, and it recovers by itself once space is freed.
    Then every server's disk fills: each stops acknowledging (max_unflushed after its oldest
    update it could not flush), and none acknowledges while it is not durable; a SIGKILL of
    every server 3 s after all stopped, disks freed, a restart: every bucket is served again
    (a copy that joined by state transfer is on its server's disk), every push acknowledged
    before the fill is present exactly once, and those lost fit in at most one window of
    max_unflushed (+ margin) per server besides the crash's own window (docs/operations.md,
    "Storage faults"). Each fill is followed by a push of a new 4 MB tensor on every copy, so
    that the next flush must grow LMDB's file (see `dirty_all`)."""
    with disk_cluster(tmp_path) as (c, mounts):
        client, load = start_load(c)
        big = make_client(c, retry_for=5.0)
        try:
            time.sleep(3.0)
            # -- one server's disk fills ---------------------------------------------------------
            victim, addr = c.server_ids[0], c.servers[0]
            spec = big_tensor(big, "big1")
            fill(mounts[0])
            dirty_all(big, spec)
            took = wait_until(
                f"{victim} reports its full disk",
                MAX_UNFLUSHED + 3.0,
                lambda: healthz(addr)[0] == 503,
            )
            code, body = healthz(addr)
            print(f"{victim} unhealthy after {took:.1f} s: {body}")
            assert (
                code == 503 and "disk full" in body["reason"] and str(mounts[0]) in body["reason"]
            )
            assert metric(addr, "adamps_ps_durable") == 0
            # A push straight to it, to a bucket it still leads (if its primaries have not
            # moved yet): refused as not durable, nothing applied.
            led = {b["bucket"] for b in c.cluster()["buckets"] if b["primary"] == victim}
            sid = next((s for s, b in client.layout.bucket_of.items() if b in led), None)
            if sid is not None:
                zeros = np.zeros(SHARD, np.float32)
                with SyncRpc(addr, TOKEN, timeout=5.0) as rpc:
                    with pytest.raises(RpcError) as refused:
                        rpc.call("push_dense", shards={sid: zeros}, client="probe", seq=1)
                assert refused.value.code == "not_durable", refused.value
                assert "disk full" in str(refused.value)
            c.wait_for(
                lambda v: (
                    all(b["primary"] != victim for b in v["buckets"])
                    and v["servers"][victim].get("not_durable")
                ),
                f"primaries moved off {victim}",
                20.0,
            )
            acked = len(load.out.ack_times)
            time.sleep(2.0)
            assert len(load.out.ack_times) > acked + 20, "the others keep acknowledging"
            (mounts[0] / "filler").unlink()
            wait_until(f"{victim} healthy again", 10.0, lambda: healthz(addr)[0] == 200)
            assert metric(addr, "adamps_ps_durable") == 1
            # Every bucket back on three copies, each flushed, before the next fault: else a
            # bucket whose only up-to-date copy joined the recovered server and was never
            # flushed there has no copy on any disk after the crash, and stays unavailable
            # until an operator acts (the documented rule; a different scenario from the
            # issue's, in which every server's disk fills under load).
            why = settle(c, 30.0)
            assert why is None, why
            for a in c.servers:
                with SyncRpc(a, TOKEN, timeout=30.0) as rpc:
                    rpc.call("flush")
            # -- every server's disk fills -------------------------------------------------------
            spec = big_tensor(big, "big2")
            for m in mounts:
                fill(m)
            t_fill = time.monotonic()
            dirty_all(big, spec)
            # Each stops once its oldest unflushed update is max_unflushed old; one that had
            # nothing to flush may take pushes (its buckets moved to it) until that holds too.
            # A full file system does not always stop LMDB: a flush commits into the free pages
            # inside its file (pages freed by earlier flushes need no new space), so a server
            # may stay durable, or become durable again, and acknowledge: then its flushes
            # commit, and what it acknowledges is on its disk. The crash comes 3 s after every
            # server stopped (or 13 s after the fill); the bound checked below holds either way.
            seen: dict[float, list[str]] = {}  # when some server was seen durable: which
            t_all = None  # when every server was first seen not durable
            while time.monotonic() - (t_fill + 10.0 if t_all is None else t_all) < 3.0:
                t = time.monotonic()
                up = [
                    s for s, a in zip(c.server_ids, c.servers, strict=True) if healthz(a)[0] == 200
                ]
                if up:
                    seen[t] = up
                elif t_all is None:
                    t_all = t
                time.sleep(0.05)
            if t_all is None:
                print(
                    f"not every server stopped: {sorted({s for up in seen.values() for s in up})} "
                    "flushed into LMDB's free pages"
                )
            else:
                print(f"every server not durable {t_all - t_fill:.1f} s after the disks filled")
                # A server that is not durable never acknowledges: each acknowledgement after
                # every server stopped comes from a server seen durable again around then.
                again = [d for d in seen if d > t_all]
                late = [t for t, _ in load.out.ack_times if t > t_all + 0.5]
                unexplained = [
                    t for t in late if not any(-1.0 <= t - d <= MAX_UNFLUSHED + 1.0 for d in again)
                ]
                print(
                    f"{len(late)} acknowledged after every server stopped; some server durable "
                    f"again at {[round(d - t_all, 2) for d in again][:20]}"
                )
                assert not unexplained, (
                    f"{len(unexplained)} pushes acknowledged while no server could persist, "
                    f"{[round(t - t_all, 2) for t in unexplained[:10]]} s after all stopped"
                )
            for sid in c.server_ids:
                c.kill(sid)
            t_crash = time.monotonic()
            for m in mounts:
                (m / "filler").unlink()
            for i, sid in enumerate(c.server_ids):
                c.start_server(i)
                c.procs[sid].wait_http(f"http://{c.servers[i]}/healthz", 30)
            fill_window = (t_fill - FLUSH_INTERVAL - LOSS_MARGIN, t_crash)
            crash = loss_window(t_crash, time.monotonic())
            why = settle(c, 30.0)
            print(f"settled after the restart: {why or 'yes'}")
            load.stop()
            counts = read_and_check(c, client, load, [fill_window, crash], timeout=40.0)
            print(f"outcomes: {counts}")
            assert counts["acked"] - counts["acked_in_loss_windows"] > 50, counts
            # The bound of docs/operations.md, exactly: what is lost was acknowledged within
            # one window of max_unflushed (+ a round) per primary, or in the crash's window.
            values, _ = read_shards(client, TENSOR.name, 30.0)
            flat = values.reshape(-1)
            lost = sorted(t for t, e in load.out.ack_times if flat[e] != 1.0 and not crash[0] <= t)
            windows = cover(lost, MAX_UNFLUSHED + LOSS_MARGIN)
            print(f"{len(lost)} lost before the crash's window, in windows {windows} "
                  f"(s after the fill: {[(round(a - t_fill, 1), round(b - t_fill, 1)) for a, b in windows]})")  # fmt: skip
            assert len(windows) <= len(c.servers), windows
            wait_digests_agree(c, timeout=30.0)
        finally:
            load.stop()
            client.close()
            big.close()


def test_a_copy_transferred_to_a_stalled_disk_is_no_member_until_it_is_persisted(
    tmp_path: Path,
) -> None:
    """Issue 29, the root cause of the every-disk known failure: a copy installed by state
    transfer that never reached the disk counted as a member, and when every copy then crashed
    its server came back offering nothing (the bucket waited for an operator). One server is
    SIGKILLed under load, its file system frozen while it is down (fsfreeze: no write reaches
    the disk; a full tmpfs is no such fault, LMDB reuses the free pages inside its file), and
    it is restarted: it must not enter any bucket's replica set while its disk cannot write
    (a transferred copy it cannot persist does not join; then it reports itself not durable
    and the controllers want no copy on it), the others keep acknowledging, and once thawed it joins every bucket, each
    joined copy on its disk with its position: SIGKILLed at once and restarted, it offers
    every bucket."""
    frozen: list[Path] = []
    with disk_cluster(tmp_path, mount_ext4_image, frozen) as (c, mounts):
        client, load = start_load(c)
        try:
            time.sleep(2.0)
            victim, addr = c.server_ids[0], c.servers[0]

            def members(v: dict) -> list[int]:
                return [
                    b["bucket"]
                    for b in v["buckets"]
                    if b["primary"] == victim or victim in b["secondaries"]
                ]

            c.kill(victim)
            c.wait_for(lambda v: not members(v), f"{victim} out of every replica set", 20.0)
            frozen.append(mounts[0])
            subprocess.run(["fsfreeze", "--freeze", str(mounts[0])], check=True, timeout=30)
            c.start_server(0)
            c.procs[victim].wait_http(f"http://{addr}/healthz", 30)
            # Long enough for a join (a transfer takes well under a second here) and for the
            # server to report itself not durable on main (max_unflushed after its install).
            t0 = time.monotonic()
            while time.monotonic() - t0 < 2 * MAX_UNFLUSHED + 2.0:
                joined = members(c.cluster())
                assert not joined, f"{victim} became a member of {joined} on a frozen disk"
                time.sleep(0.1)
            log_path = c.procs[victim].log_path
            acked = len(load.out.ack_times)
            time.sleep(1.0)
            assert len(load.out.ack_times) > acked + 10, "the others keep acknowledging"
            subprocess.run(["fsfreeze", "--unfreeze", str(mounts[0])], check=True, timeout=30)
            frozen.clear()
            c.wait_for(lambda v: len(members(v)) == N_BUCKETS, f"{victim} joined", 30.0)
            c.kill(victim)  # at once: only what the joins themselves persisted is on its disk
            pattern = r"registered as \S+ at \S+, offering (\d+) copies"
            before = len(re.findall(pattern, log_path.read_text(errors="replace")))
            c.start_server(0)
            c.procs[victim].wait_http(f"http://{addr}/healthz", 30)
            wait_until(
                f"{victim} registered again",
                20.0,
                lambda: len(re.findall(pattern, log_path.read_text(errors="replace"))) > before,
            )
            offered = re.findall(pattern, log_path.read_text(errors="replace"))[before]
            assert int(offered) == N_BUCKETS, f"{victim} came back offering {offered} copies"
            why = settle(c, 30.0)
            load.stop()
            counts = read_and_check(c, client, load, [], timeout=40.0)
            print(f"outcomes: {counts}; settled: {why or 'yes'}")
            wait_digests_agree(c, timeout=30.0)
        finally:
            load.stop()
            client.close()


def test_a_stalled_disk_stops_acknowledgements_until_it_moves_on(tmp_path: Path) -> None:
    """Issue 29: one server's file system frozen (fsfreeze on a loop-mounted ext4 image) under
    load: its flush hangs, and within max_unflushed it answers 503 not_durable, /healthz 503
    saying the disk stalls, its primaries move while the others keep acknowledging. Thawed, it
    recovers by itself; nothing acknowledged is lost and every copy agrees."""
    frozen: list[Path] = []
    with disk_cluster(tmp_path, mount_ext4_image, frozen) as (c, mounts):
        client, load = start_load(c)
        try:
            time.sleep(3.0)
            victim, addr = c.server_ids[0], c.servers[0]
            frozen.append(mounts[0])
            subprocess.run(["fsfreeze", "--freeze", str(mounts[0])], check=True, timeout=30)
            took = wait_until(
                f"{victim} reports its stalled disk",
                MAX_UNFLUSHED + 3.0,
                lambda: healthz(addr)[0] == 503,
            )
            code, body = healthz(addr)
            print(f"{victim} unhealthy after {took:.1f} s: {body}")
            assert code == 503 and "stalls" in body["reason"], body
            c.wait_for(
                lambda v: all(b["primary"] != victim for b in v["buckets"]),
                f"primaries moved off {victim}",
                20.0,
            )
            acked = len(load.out.ack_times)
            time.sleep(2.0)
            assert len(load.out.ack_times) > acked + 20, "the others keep acknowledging"
            subprocess.run(["fsfreeze", "--unfreeze", str(mounts[0])], check=True, timeout=30)
            frozen.clear()
            wait_until(f"{victim} healthy again", 10.0, lambda: healthz(addr)[0] == 200)
            why = settle(c, 30.0)
            load.stop()
            counts = read_and_check(c, client, load, [], timeout=40.0)
            print(f"outcomes: {counts}; settled: {why or 'yes'}")
            wait_digests_agree(c, timeout=30.0)
        finally:
            load.stop()
            client.close()
