"""CPU starvation is not a stalled disk (issue 39, finding 4), against real processes: 3
controllers and 3 parameter servers on loopback under the exactness load, then every server
starved of CPU at once by a cgroup CPU quota (each server process in a group of its own,
30 ms of CPU per 1 s period: as three machines overloaded together). Their flushes get
slow, and the loss windows pass max_unflushed; before, each server then reported "a flush has
been writing for N s (the disk stalls)", stopped acknowledging, and the controllers moved
their buckets. Now: every server says its flush is starved (logged, /status `flush_starved`),
stays durable, the controllers see no storage fault, no bucket is ever without a primary,
pushes are acknowledged throughout, and nothing acknowledged is lost.

A real stalled disk of one server still moves its buckets: see
tests/chaos/test_storage_faults.py::test_a_stalled_disk_stops_acknowledgements_until_it_moves_on
(fsfreeze of its file system), unchanged.

Needs root and a cgroup CPU controller (v1 `cpu` or v2 `cpu.max`); skipped otherwise."""

from __future__ import annotations

import json
import os
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from adamps.up.cluster import LocalCluster
from tests.chaos.nemesis import N_BUCKETS, SHARD, TOKEN, read_and_check, settle, start_load

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

#: what each starved server gets: QUOTA_US of CPU per PERIOD_US
PERIOD_US, QUOTA_US = 1_000_000, 30_000
MAX_UNFLUSHED = 0.6
STARVED_FOR = 12.0
V1 = Path("/sys/fs/cgroup/cpu")
V2 = Path("/sys/fs/cgroup")


def cgroup_root() -> Path:
    """Where a CPU-limited group can be made here, or a skip."""
    if os.geteuid() != 0:
        pytest.skip("needs root to make cgroups")
    if (V1 / "cpu.cfs_quota_us").exists():
        return V1
    if (
        "cpu" in (V2 / "cgroup.controllers").read_text(errors="replace").split()
        if (V2 / "cgroup.controllers").exists()
        else False
    ):
        try:
            (V2 / "cgroup.subtree_control").write_text("+cpu")
        except OSError as exc:
            pytest.skip(f"cannot enable the cgroup v2 cpu controller: {exc}")
        return V2
    pytest.skip("no cgroup CPU controller here")


@contextmanager
def starved(pids: list[int]) -> Iterator[None]:
    """Each pid (all its threads) in a cgroup of its own with QUOTA_US per PERIOD_US; moved
    back and the groups removed on exit."""
    root = cgroup_root()
    groups = []
    try:
        for pid in pids:
            g = root / f"adamps-starved-{os.getpid()}-{pid}"
            g.mkdir(exist_ok=True)
            groups.append(g)
            if root == V1:
                (g / "cpu.cfs_period_us").write_text(str(PERIOD_US))
                (g / "cpu.cfs_quota_us").write_text(str(QUOTA_US))
            else:
                (g / "cpu.max").write_text(f"{QUOTA_US} {PERIOD_US}")
            (g / "cgroup.procs").write_text(str(pid))
        yield
    finally:
        for g in groups:
            stat = (g / "cpu.stat").read_text().split()
            print(f"{g.name}: {dict(zip(stat[::2], stat[1::2], strict=False))}")
            for pid in (g / "cgroup.procs").read_text().split():
                try:
                    (root / "cgroup.procs").write_text(pid)
                except OSError:
                    pass  # exited meanwhile
            for _ in range(50):
                try:
                    g.rmdir()
                    break
                except OSError:
                    time.sleep(0.1)


def status(address: str) -> dict:
    req = urllib.request.Request(
        f"http://{address}/status", headers={"Authorization": f"Bearer {TOKEN}"}
    )
    with urllib.request.urlopen(req, timeout=5) as r:
        return json.loads(r.read())


def test_every_server_starved_of_cpu_keeps_its_buckets_and_acknowledges(tmp_path: Path) -> None:
    cgroup_root()
    # The documented default timeouts (a server dead after 3 s of silence, 5 s leases): the
    # fault tests' 1 s would declare the starved servers dead, another finding of the issue.
    c = LocalCluster(
        tmp_path, token=TOKEN, n_controllers=3, n_servers=3, n_buckets=N_BUCKETS,
        ps_opts={"flush-interval": 0.2, "max-unflushed": MAX_UNFLUSHED, "max-shard-elems": SHARD},
    )  # fmt: skip
    try:
        c.start(timeout=90)
        client, load = start_load(c)
        try:
            time.sleep(3.0)
            pids = [c.procs[s].pid for s in c.server_ids]
            seen_starved: set[str] = set()
            unserved: list[str] = []
            storage_faults: list[str] = []
            windows: dict[str, float] = {}
            acked_before = len(load.out.ack_times)
            with starved(pids):
                t0 = time.monotonic()
                while time.monotonic() - t0 < STARVED_FOR:
                    view = c.cluster()
                    if view is not None:
                        unserved += [
                            f"{time.monotonic() - t0:.1f} s: bucket {b['bucket']}"
                            for b in view["buckets"]
                            if not b.get("primary") or b.get("state") == "unavailable"
                        ]
                        storage_faults += [
                            f"{sid}: {rec['not_durable']}"
                            for sid, rec in view["servers"].items()
                            if rec.get("not_durable")
                        ]
                    for sid, addr in zip(c.server_ids, c.servers, strict=True):
                        try:
                            st = status(addr)
                        except OSError:
                            continue  # a starved server may answer late: asked again
                        windows[sid] = max(windows.get(sid, 0.0), st["loss_window_seconds"])
                        if st.get("flush_starved"):
                            seen_starved.add(sid)
                        assert st["durable"], f"{sid} not durable: {st['not_durable']}"
                    time.sleep(0.3)
                acked_starved = len(load.out.ack_times) - acked_before
            print(f"largest loss windows {windows}; starved seen on {sorted(seen_starved)}; "
                  f"{acked_starved} acknowledged while starved")  # fmt: skip
            assert max(windows.values()) > MAX_UNFLUSHED, (
                f"the quota did not make any flush slow enough to matter: {windows}"
            )
            logs = {s: c.procs[s].log_path.read_text(errors="replace") for s in c.server_ids}
            said = [s for s, text in logs.items() if "starved of CPU, not stalled" in text]
            assert said, "no server said its flush was starved"
            stalls = [s for s, text in logs.items() if "the disk stalls" in text]
            assert not stalls, f"starvation reported as a stalled disk by {stalls}"
            assert not storage_faults, f"the controllers saw storage faults: {storage_faults[:5]}"
            assert not unserved, f"buckets without a primary: {unserved[:10]}"
            assert acked_starved > 20, "pushes were still acknowledged while starved"
            why = settle(c, 40.0)
            load.stop()
            counts = read_and_check(c, client, load, [], timeout=40.0)
            print(f"outcomes: {counts}; settled: {why or 'yes'}")
        finally:
            load.stop()
            client.close()
    finally:
        c.stop()
