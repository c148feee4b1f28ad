"""Replication cost and failover time, from one run on this machine.

Two real clusters on loopback (3 controllers + 3 parameter servers each), one with replication
factor 1 and one with replication factor 3. The same client load (threads pushing dense deltas of
whole shards through adamps.client.ps.PSClient) runs against each; the figure is RF 3 throughput as a
ratio to RF 1 (goal >= 0.5), with pushes acknowledged at the decision point of two-phase commit
(the default), and beside it the stricter ``ack = "committed"``. Then, on the RF 3 cluster, the primary of the most buckets is killed
with SIGKILL under load, and the failover time is measured: from the kill to the first
acknowledged push sent after the kill to a bucket that server led. Every acknowledged push is checked to be present
exactly once at the end (the exactness checker of the tests). RF 3 also runs with peer
identity off (issue 28: no MAC of replication messages), which prices the peer authentication,
beside this machine's HMAC-SHA256 throughput, and with TLS on every port (a CA made by the run),
which prices the encryption.

    python benchmarks/replication.py [--seconds 8] [--threads 4] [--shard-kb 256]

With ``--scrub`` it measures instead what the background scrub costs (issue 29): the same RF 3
load with the scrub off (the limit), at the default rate, and at a rate high enough that it never
sleeps, each beside the bytes it verified per second (from the servers' metrics).

Last line: one JSON object of the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
import urllib.request

import numpy as np

from adamps.client import ControllerRouting, PSClient
from adamps.layout import Layout, TensorSpec
from adamps.testing.exactness import ExactnessLoad
from adamps.up.cluster import LocalCluster

TOKEN = "bench-token"
N_BUCKETS = 16
LEASE = 2.0
FAILOVER_SHARD = 500  # 32 shards of x over the 16 buckets


def cluster(
    root: str,
    replication: int,
    shard_elems: int,
    ack: str = "prepared",
    peer_auth: bool = True,
    scrub_rate: int = 0,
    tls: bool = False,
) -> LocalCluster:
    c = LocalCluster(
        root,
        token=TOKEN,
        tls=tls,  # every port, this process's clients included, with a CA made for the run
        peer_token=None if peer_auth else "",  # None: a generated one (adamps up's default)
        n_servers=3,
        n_buckets=N_BUCKETS,
        controller_opts={
            "replication": replication, "lease-duration": LEASE, "lease-skew": 0.1, "lease-margin": 0.2,
            "heartbeat-interval": 0.2, "server-timeout": 1.0, "reconcile-interval": 0.1,
        },
        ps_opts={"member-timeout": 0.5, "ping-interval": 0.2, "failover-after": 1.5, "log-level": "WARNING",
                 "max-shard-elems": shard_elems, "ack": ack, "scrub-rate": scrub_rate},
    )  # fmt: skip
    c.start(timeout=60)
    return c


def throughput(c: LocalCluster, threads: int, seconds: float, shard_elems: int) -> dict[str, float]:
    """Pushes/s and GB/s of `threads` clients each pushing one whole shard per request."""
    n_shards = 4 * N_BUCKETS
    spec = TensorSpec("w", (n_shards * shard_elems,))
    layout = Layout([spec], n_buckets=N_BUCKETS, max_shard_elems=shard_elems)
    setup = PSClient(ControllerRouting(c.controllers), layout, TOKEN)
    setup.create(spec, init={"kind": "zeros"}, optimizer={"kind": "sgd", "lr": -1.0})
    setup.close()
    counts = [0] * threads
    stop = threading.Event()

    def run(i: int) -> None:
        client = PSClient(ControllerRouting(c.controllers), layout, TOKEN)
        delta = np.ones(shard_elems, np.float32)
        shards = layout.shards_of["w"]
        k = i
        while not stop.is_set():
            client.push_shards({shards[k % n_shards].id: delta})
            counts[i] += 1
            k += threads
        client.close()

    workers = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    time.sleep(1.0)  # warm-up: connections, routing tables
    pids = {name: p.popen.pid for name, p in c.procs.items()}
    cpu0 = {name: cpu_seconds(pid) for name, pid in pids.items()}
    me0 = time.process_time()
    start, before = time.perf_counter(), sum(counts)
    time.sleep(seconds)
    done, elapsed = sum(counts) - before, time.perf_counter() - start
    servers = sum(cpu_seconds(pid) - cpu0[n] for n, pid in pids.items() if n.startswith("ps"))
    controllers = sum(
        cpu_seconds(pid) - cpu0[n] for n, pid in pids.items() if n.startswith("contr")
    )
    clients = time.process_time() - me0
    stop.set()
    for w in workers:
        w.join(30)
    rate = done / elapsed
    return {
        "pushes_per_s": rate,
        "GB_per_s": rate * shard_elems * 4 / 1e9,
        # CPU milliseconds per push, by role, over the same window (from /proc)
        "cpu_ms_servers": 1e3 * servers / done,
        "cpu_ms_clients": 1e3 * clients / done,
        "cpu_ms_controllers": 1e3 * controllers / done,
    }


def cpu_seconds(pid: int) -> float:
    """utime + stime of every thread of process `pid`, from /proc/<pid>/stat."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def failover(c: LocalCluster) -> dict[str, float]:
    spec = TensorSpec("x", (16_000,))
    layout = Layout([spec], n_buckets=N_BUCKETS, max_shard_elems=FAILOVER_SHARD)
    client = PSClient(ControllerRouting(c.controllers), layout, TOKEN, retry_for=20.0)
    client.create(spec, init={"kind": "zeros"}, optimizer={"kind": "sgd", "lr": -1.0})
    load = ExactnessLoad(client, layout, "x", threads=4)
    load.start()
    time.sleep(1.5)
    view = c.cluster()
    victim = max(c.server_ids, key=lambda s: sum(b["primary"] == s for b in view["buckets"]))
    led = {b["bucket"] for b in view["buckets"] if b["primary"] == victim}
    killed = time.monotonic()
    c.kill(victim)
    time.sleep(2 * LEASE + 3)
    load.stop()
    values, _ = client.pull(["x"])
    counts = load.check(values["x"])
    bucket_of_element = {}
    for s in layout.shards_of["x"]:
        for e in range(s.start, s.stop):
            bucket_of_element[e] = layout.bucket_of[s.id]
    # Pushes sent after the kill: an acknowledgement on its way when the kill landed (decided
    # by the victim before it died) once measured a failover of 0.00 s.
    after = [
        t
        for t, e in load.out.ack_times
        if load.sent_at.get(e, killed) > killed and bucket_of_element[e] in led
    ]
    client.close()
    return {
        "failover_s": (min(after) - killed) if after else float("nan"),
        "acked": counts["acked"],
        "unknown": counts["unknown"],
        "failed": counts["failed"],
    }


def hmac_gb_per_s(nbytes: int, seconds: float = 0.5, blake2: bool = False) -> float:
    """HMAC-SHA256 throughput of this machine over buffers of `nbytes` (the limit of a peer's
    MAC of a replicated batch); with `blake2`, keyed BLAKE2b's (the standard library's other
    keyed MAC: which of the two is faster depends on the CPU's SHA extensions)."""
    import hashlib
    import hmac

    buf = np.random.default_rng(0).integers(0, 255, nbytes, np.uint8)
    key = b"k" * 32
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        if blake2:
            hashlib.blake2b(buf, key=key, digest_size=32).digest()
        else:
            hmac.new(key, buf, hashlib.sha256).digest()
        n += 1
    return n * nbytes / (time.perf_counter() - t0) / 1e9


def scrubbed_bytes(c: LocalCluster) -> float:
    """adamps_ps_scrubbed_bytes_total summed over the cluster's servers."""
    total = 0.0
    for addr in c.servers:
        with urllib.request.urlopen(f"http://{addr}/metrics", timeout=5) as r:
            for line in r.read().decode().splitlines():
                if line.startswith("adamps_ps_scrubbed_bytes_total "):
                    total += float(line.split()[1])
    return total


def scrub_cost(
    root: str, threads: int, seconds: float, shard_elems: int, repeats: int
) -> dict[str, float]:
    """RF 3 push throughput with the scrub off (the limit) and on at two rates, interleaved
    `repeats` times (a shared machine drifts: each figure is the median of its runs)."""
    rates = {"off": 0, "default": 4 << 20, "unbounded": 1 << 40}
    runs: dict[str, list[tuple[float, float, float]]] = {name: [] for name in rates}
    for i in range(repeats):
        for name, rate in rates.items():
            c = cluster(os.path.join(root, f"scrub_{name}_{i}"), 3, shard_elems, scrub_rate=rate)
            try:
                b0, t0 = scrubbed_bytes(c), time.monotonic()
                r = throughput(c, threads, seconds, shard_elems)
                verified = (scrubbed_bytes(c) - b0) / (time.monotonic() - t0)
            finally:
                c.stop()
            runs[name].append((r["pushes_per_s"], verified, r["cpu_ms_servers"]))
            print(
                f"  run {i + 1}: scrub {name:9s}: {r['pushes_per_s']:8.1f} pushes/s, "
                f"{verified / 1e6:7.2f} MB/s verified on 3 servers, server CPU "
                f"{r['cpu_ms_servers']:.2f} ms/push"
            )
    out: dict[str, float] = {}
    for name, rate in rates.items():
        pushes = statistics.median(r[0] for r in runs[name])
        out[f"scrub_{name}_pushes_per_s"] = round(pushes, 1)
        out[f"scrub_{name}_pushes_per_s_runs"] = [round(r[0], 1) for r in runs[name]]  # type: ignore[assignment]
        out[f"scrub_{name}_verified_MB_per_s"] = round(
            statistics.median(r[1] for r in runs[name]) / 1e6, 2
        )
        out[f"scrub_{name}_cpu_ms_servers_per_push"] = round(
            statistics.median(r[2] for r in runs[name]), 3
        )
        shown = "unbounded" if rate >= 1 << 40 else f"{rate} B/s per server"
        print(
            f"  median scrub {name:9s} ({shown}): {pushes:8.1f} pushes/s, "
            f"{out[f'scrub_{name}_verified_MB_per_s']:.2f} MB/s verified"
        )
    for name in ("default", "unbounded"):
        ratio = out[f"scrub_{name}_pushes_per_s"] / out["scrub_off_pushes_per_s"]
        out[f"scrub_{name}_over_off"] = round(ratio, 3)
        print(f"  scrub {name} / scrub off (the limit) = {ratio:.3f}")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=8.0, help="measured seconds per configuration")
    p.add_argument("--threads", type=int, default=4, help="client threads")
    p.add_argument("--shard-kb", type=int, default=256, help="size of each pushed shard (KiB)")
    p.add_argument(
        "--scrub", action="store_true", help="measure the background scrub's cost instead"
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="interleaved runs per compared configuration (rf3, peer auth off, TLS; --scrub: "
        "per rate)",
    )
    args = p.parse_args()
    shard_elems = args.shard_kb * 256
    if args.scrub:
        print(
            f"adamps benchmarks/replication.py --scrub ({os.cpu_count()} CPUs): RF 3, "
            f"{args.threads} client threads pushing {args.shard_kb} KiB deltas, "
            f"{args.seconds:.0f} s each"
        )
        with tempfile.TemporaryDirectory(prefix="adamps-bench-") as root:
            results = scrub_cost(root, args.threads, args.seconds, shard_elems, args.repeats)
        results["shard_KiB"] = args.shard_kb
        results["client_threads"] = args.threads
        print(json.dumps(results))
        return
    print(
        f"adamps benchmarks/replication.py ({os.cpu_count()} CPUs): 3 controllers + 3 parameter servers per cluster,"
    )
    print(
        f"{args.threads} client threads pushing {args.shard_kb} KiB dense deltas (one shard each), {args.seconds:.0f} s each"
    )
    results: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="adamps-bench-") as root:
        # rf3 acknowledges at the decision point (the default); rf3_committed once every member
        # committed too (ack = "committed"): what the stricter mode costs.
        # rf3_no_peer_auth: the same as rf3 with peer identity off (no MAC of replication
        # messages, issue 28): what authenticating the peers costs.
        # rf3_tls: the same as rf3 with TLS on every port (issue 28): what encrypting costs.
        # These three are compared with each other: they run in alternation, `repeats` times
        # each (a shared machine drifts), and each figure is the median of its runs.
        plan = [("rf1", 1, "prepared", True, False), ("rf3_committed", 3, "committed", True, False)]
        plan += [
            ("rf3", 3, "prepared", True, False),
            ("rf3_no_peer_auth", 3, "prepared", False, False),
            ("rf3_tls", 3, "prepared", True, True),
        ] * args.repeats
        runs: dict[str, list[dict[str, float]]] = {}
        for i, (name, rf, ack, auth, tls) in enumerate(plan):
            c = cluster(os.path.join(root, f"{name}-{i}"), rf, shard_elems, ack, auth, tls=tls)
            try:
                r = throughput(c, args.threads, args.seconds, shard_elems)
            finally:
                c.stop()
            runs.setdefault(name, []).append(r)
            print(
                f"  replication factor {rf}, ack = {ack:9s}{'' if auth else ', peer auth off'}"
                f"{', TLS' if tls else ''}: {r['pushes_per_s']:8.1f} pushes/s  "
                f"{r['GB_per_s']:.3f} GB/s; CPU ms per push: servers {r['cpu_ms_servers']:.2f},"
                f" clients {r['cpu_ms_clients']:.2f}, controllers {r['cpu_ms_controllers']:.2f}"
            )
        for name, rs in runs.items():
            med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
            results[f"{name}_pushes_per_s"] = round(med["pushes_per_s"], 1)
            results[f"{name}_GB_per_s"] = round(med["GB_per_s"], 4)
            for k in ("cpu_ms_servers", "cpu_ms_clients", "cpu_ms_controllers"):
                results[f"{name}_{k}_per_push"] = round(med[k], 3)
        print(f"  medians of {args.repeats} alternating runs of rf3, rf3_no_peer_auth, rf3_tls:")
        for name in ("rf3", "rf3_no_peer_auth", "rf3_tls"):
            print(
                f"    {name:17s} {results[f'{name}_pushes_per_s']:8.1f} pushes/s, server CPU"
                f" {results[f'{name}_cpu_ms_servers_per_push']:.2f} ms per push"
            )
        ratio = results["rf3_pushes_per_s"] / results["rf1_pushes_per_s"]
        results["rf3_over_rf1"] = round(ratio, 3)
        strict = results["rf3_committed_pushes_per_s"] / results["rf1_pushes_per_s"]
        results["rf3_committed_over_rf1"] = round(strict, 3)
        verdict = "met" if ratio >= 0.5 else "MISSED"
        print(
            f"  RF 3 / RF 1 = {ratio:.2f}  (goal >= 0.5: {verdict}); with ack = committed {strict:.2f}"
        )
        auth_ratio = results["rf3_pushes_per_s"] / results["rf3_no_peer_auth_pushes_per_s"]
        results["rf3_peer_auth_over_off"] = round(auth_ratio, 3)
        mac_gbs = hmac_gb_per_s(shard_elems * 4)
        blake_gbs = hmac_gb_per_s(shard_elems * 4, blake2=True)
        results["hmac_sha256_GB_per_s"] = round(mac_gbs, 3)
        results["blake2b_keyed_GB_per_s"] = round(blake_gbs, 3)
        # each push's shard is hashed once by the primary for both secondaries (the segmented
        # frame MAC, adamps.security.peer_auth.frame_mac) and once by each secondary
        mac_ms = 3 * shard_elems * 4 / (mac_gbs * 1e9) * 1e3
        results["hmac_ms_per_push_rf3"] = round(mac_ms, 3)
        print(
            f"  peer authentication: RF 3 with / without = {auth_ratio:.2f}; HMAC-SHA256 on this"
            f" machine {mac_gbs:.2f} GB/s (keyed BLAKE2b {blake_gbs:.2f}), so {mac_ms:.2f} ms of"
            " CPU per push at RF 3 (hashed once by the primary, once by each of 2 secondaries),"
            f" against {results['rf3_cpu_ms_servers_per_push']:.2f} ms of server CPU per push"
        )
        tls_ratio = results["rf3_tls_pushes_per_s"] / results["rf3_pushes_per_s"]
        results["rf3_tls_over_plain"] = round(tls_ratio, 3)
        tls_cpu = (
            results["rf3_tls_cpu_ms_servers_per_push"] / results["rf3_cpu_ms_servers_per_push"]
        )
        results["rf3_tls_server_cpu_over_plain"] = round(tls_cpu, 3)
        print(
            f"  TLS on every port: RF 3 with / without = {tls_ratio:.2f}; server CPU per push"
            f" {results['rf3_tls_cpu_ms_servers_per_push']:.2f} ms against"
            f" {results['rf3_cpu_ms_servers_per_push']:.2f} ms ({tls_cpu:.2f} x)"
        )
        # On one machine whose cores every process shares, throughput follows CPU per push. RF 3
        # receives and applies each push on three servers: even if a secondary's copy cost no
        # more than the primary's whole part of an RF 1 push, RF 3 would need clients + 3 x
        # servers of RF 1 per push.
        per = {
            k: results[f"rf1_cpu_ms_{k}_per_push"] for k in ("servers", "clients", "controllers")
        }
        bound = sum(per.values()) / (per["clients"] + per["controllers"] + 3 * per["servers"])
        results["rf3_over_rf1_cpu_bound"] = round(bound, 3)
        print(
            "  CPU-bound ceiling on this machine: RF 1 CPU per push / (its clients and controllers"
            f" + 3 x its servers) = {bound:.2f}"
        )
        c = cluster(os.path.join(root, "failover"), 3, FAILOVER_SHARD)
        try:
            f = failover(c)
        finally:
            c.stop()
        results["failover_s"] = round(f["failover_s"], 3)
        results["lease_duration_s"] = LEASE
        print(
            f"  failover after SIGKILL of a primary under load: {f['failover_s']:.2f} s "
            f"(lease {LEASE} s; goal < 2 x lease); pushes acked {f['acked']}, unknown {f['unknown']}, "
            f"failed {f['failed']}, every acknowledged push present exactly once"
        )
    results["shard_KiB"] = args.shard_kb
    results["client_threads"] = args.threads
    print(json.dumps(results))


if __name__ == "__main__":
    main()
