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

from adamps.localcluster import LocalCluster
from adamps.rpc import RpcError, SyncRpc
from tests.chaos.nemesis import (
    CONTROLLER_OPTS,
    FLUSH_INTERVAL,
    LOSS_MARGIN,
    N_BUCKETS,
    PS_OPTS,
    SHARD,
    TOKEN,
    flip_ones,
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


def test_a_full_disk_stops_acknowledgements_and_recovers(tmp_path: Path) -> None:
    """Issue 29, failure 2, one server: see `full_disk`; ends with every acknowledged push
    present exactly once and the copies agreeing."""
    full_disk(tmp_path, every_disk=False)


@pytest.mark.skipif(
    not os.environ.get("ADAMPS_RUN_KNOWN_FAILURES"),
    reason="a known failure (issue 29 note, the xfail's reason); 110 s of CI for no news: "
    "ADAMPS_RUN_KNOWN_FAILURES=1 runs it",
)
@pytest.mark.xfail(
    strict=False,
    reason="known (issue 29 note): a server that rejoined by state transfer after its own disk "
    "recovered and whose disk then filled again comes back from the whole-cluster crash "
    "offering no copy, and the buckets it led wait for an operator",
)
def test_every_disk_full_then_a_whole_cluster_crash_loses_only_the_window(tmp_path: Path) -> None:
    full_disk(tmp_path, every_disk=True)


def full_disk(tmp_path: Path, every_disk: bool) -> None:
    """Issue 29, failure 2. One server's disk fills: within max_unflushed it answers 503
    not_durable and /healthz 503 naming the full disk, the controllers move its primaries
    away while the others keep acknowledging, and it recovers by itself once space is freed.
    Then every server's disk fills: each stops acknowledging (max_unflushed after its oldest
    update it could not flush), and nothing is acknowledged once all have; a SIGKILL of every
    server 5 s later, disks freed, a restart: every push acknowledged outside the fill window
    (from the last flush before the fill until every server had stopped) and the usual crash
    window is present exactly once."""
    with disk_cluster(tmp_path) as (c, mounts):
        client, load = start_load(c)
        try:
            time.sleep(3.0)
            # -- one server's disk fills ---------------------------------------------------------
            victim, addr = c.server_ids[0], c.servers[0]
            fill(mounts[0])
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
            if not every_disk:
                load.stop()
                counts = read_and_check(c, client, load, [], timeout=40.0)
                print(f"outcomes: {counts}")
                wait_digests_agree(c, timeout=30.0)
                return
            # -- every server's disk fills -------------------------------------------------------
            for m in mounts:
                fill(m)
            t_fill = time.monotonic()
            # Each stops once its oldest unflushed update is max_unflushed old; one that had
            # nothing to flush may take pushes (its buckets moved to it) until that holds too.
            took = wait_until(
                "every server not durable",
                20.0,
                lambda: all(healthz(a)[0] == 503 for a in c.servers),
            )
            t_all = time.monotonic()
            print(f"every server not durable {took:.1f} s after the disks filled")
            time.sleep(5.0)  # the crash came ~10 s after the disks filled
            late = [t for t, _ in load.out.ack_times if t > t_all + 0.5]
            assert not late, f"{len(late)} pushes acknowledged while no server could persist"
            for sid in c.server_ids:
                c.kill(sid)
            t_crash = time.monotonic()
            for m in mounts:
                (m / "filler").unlink()
            for i, sid in enumerate(c.server_ids):
                c.start_server(i)
                c.procs[sid].wait_http(f"http://{c.servers[i]}/healthz", 30)
            fill_window = (t_fill - FLUSH_INTERVAL - LOSS_MARGIN, t_all + 0.5)
            lossy = [fill_window, loss_window(t_crash, time.monotonic())]
            why = settle(c, 30.0)
            load.stop()
            counts = read_and_check(c, client, load, lossy, timeout=40.0)
            print(f"outcomes: {counts}; settled: {why or 'yes'}")
            assert counts["acked"] - counts["acked_in_loss_windows"] > 50, counts
            wait_digests_agree(c, timeout=30.0)
        finally:
            load.stop()
            client.close()


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
