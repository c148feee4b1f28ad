"""Runs (issue 25): what a run's token costs on the push path, and how closely the servers hold a
run to its push-bytes-per-second quota, each beside the limit it is measured against.

A real cluster on loopback (1 controller, 1 parameter server, LMDB, `adamps` processes), one
client in this process pushing one tensor's dense deltas over HTTP in a loop:

  - the limit: pushes/s with the cluster token (no run: no namespace or quota check);
  - a run's token without quotas: pushes/s, and the ratio to the limit (goal >= 0.95: the token
    lookup is one SHA-256 of the token and a dict lookup, the namespace check one prefix test per
    name);
  - a run's token with push_bytes_per_s = a quarter of the measured unrestricted byte rate: the
    bytes/s admitted (pushes retried by the client after 429 with back-off), beside the quota,
    and their ratio (goal in [0.8, 1.05]: held to the quota, not far below it), measured after
    2 s of pushes that spend the one second of allowance a run starts with.

Run: python benchmarks/runs.py [--seconds 8] [--elems 65536]   (the last line is one JSON object)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from adamps.client import ControllerRouting, PSClient
from adamps.client.controller import ControllerClient
from adamps.layout import Layout, TensorSpec
from adamps.up.cluster import FAST_CONTROLLER_OPTS, FAST_PS_OPTS, LocalCluster

TOKEN = "benchmark-runs-cluster-token-" + "0" * 16
#: interleaved rounds of the cluster-token and run-token measurements
ROUNDS = 8


def pushes_per_s(
    client: PSClient, name: str, elems: int, seconds: float, warm: float = 0.0
) -> tuple[float, float]:
    """(pushes/s, body bytes/s) of dense pushes of `name` for `seconds`, after `warm` seconds of
    pushes not counted (a quota's first second of allowance is spent there)."""
    delta = np.full(elems, 1e-3, np.float32)
    client.push_dense(name, delta)  # warm: connections, routing
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < warm:
        client.push_dense(name, delta)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        client.push_dense(name, delta)
        n += 1
    dt = time.perf_counter() - t0
    return n / dt, n * 4 * elems / dt


def check_cost(tmp: Path, elems: int, n: int = 20_000) -> float:
    """Seconds per request of a run token's checks on a server (token lookup, namespace, rate),
    measured on the real Tenancy of a parameter server in this process."""
    import asyncio

    from adamps import metrics, runs
    from adamps.server.api.tenancy import Tenancy
    from adamps.server.storage.persist import Persister
    from adamps.server.store.store import Store

    store = Store(n_buckets=8)
    persister = Persister(tmp / "check-cost", 1 << 24, sync=False)
    try:
        t = Tenancy(TOKEN, store, persister, metrics.new_registry())
        token = runs.new_token("free")
        t.learn({"runs": {"free": {"token_hash": runs.token_hash(token), "quotas": {}}}})
        msg = {"op": "push_dense", "shards": {f"free..w/{i}": None for i in range(1)}}

        async def loop() -> float:
            t0 = time.perf_counter()
            for _ in range(n):
                who = await t.authenticate(f"Bearer {token}")
                t.check(who, "push_dense", msg, 4 * elems)
            return (time.perf_counter() - t0) / n

        return asyncio.run(loop())
    finally:
        store.close()
        persister.close()


def client_of(c: LocalCluster, spec: TensorSpec, token: str) -> PSClient:
    client = PSClient(
        ControllerRouting(c.controllers),
        Layout([spec], c.n_buckets),
        token,
        retry_for=60.0,
        data_plane=False,  # HTTP: the body bytes are what the quota counts
    )
    client.create(spec, init={"kind": "zeros"}, optimizer={"kind": "sgd", "lr": 0.0})
    return client


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=8.0, help="seconds per measurement")
    ap.add_argument("--elems", type=int, default=65536, help="float32 elements per push")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="adamps-bench-runs-") as tmp:
        c = LocalCluster(
            Path(tmp),
            token=TOKEN,
            n_controllers=1,
            n_servers=1,
            n_buckets=8,
            controller_opts={**FAST_CONTROLLER_OPTS, "min-servers": 1, "replication": 1},
            ps_opts=FAST_PS_OPTS,
        )
        per_check = check_cost(Path(tmp), args.elems)
        c.start(timeout=60)
        try:
            ctl = ControllerClient(c.controllers, TOKEN)
            free = ctl.create_run("free")["token"]
            op = client_of(c, TensorSpec("base", (args.elems,)), TOKEN)
            rc = client_of(c, TensorSpec("free..w", (args.elems,)), free)
            # Interleaved rounds: the machine's load drifts; both see the same drift.
            op_runs, rc_runs = [], []
            for _ in range(ROUNDS):
                op_runs.append(pushes_per_s(op, "base", args.elems, args.seconds / ROUNDS))
                rc_runs.append(pushes_per_s(rc, "free..w", args.elems, args.seconds / ROUNDS))
            op.close()
            rc.close()
            limit_ps = sum(r[0] for r in op_runs) / ROUNDS
            limit_bps = sum(r[1] for r in op_runs) / ROUNDS
            run_ps = sum(r[0] for r in rc_runs) / ROUNDS
            quota = limit_bps / 4
            held = ctl.create_run("held", {"push_bytes_per_s": quota})["token"]
            with client_of(c, TensorSpec("held..w", (args.elems,)), held) as hc:
                # the first 2 s spend the one second of allowance a run starts with
                _, held_bps = pushes_per_s(hc, "held..w", args.elems, args.seconds, warm=2.0)
                retries = hc.retries
            ctl.close()
        finally:
            c.stop()
    token_ratio = run_ps / limit_ps
    quota_ratio = held_bps / quota
    print(
        f"cluster token: {limit_ps:.0f} pushes/s of {4 * args.elems} B ({limit_bps / 1e6:.1f} MB/s)"
    )
    print(
        f"run token:     {run_ps:.0f} pushes/s; ratio to the cluster token {token_ratio:.3f} "
        "(goal >= 0.95)"
    )
    print(
        f"run checks:    {per_check * 1e6:.1f} us per request (in process) = "
        f"{per_check * limit_ps:.4f} of a push's time at the cluster token's rate"
    )
    print(
        f"run quota:     {held_bps / 1e6:.2f} MB/s admitted, quota {quota / 1e6:.2f} MB/s; ratio "
        f"{quota_ratio:.3f} (goal 0.8 .. 1.05); {retries} client retries after 429"
    )
    print(
        json.dumps(
            {
                "push_bytes": 4 * args.elems,
                "cluster_token_pushes_s": limit_ps,
                "run_token_pushes_s": run_ps,
                "run_token_ratio": token_ratio,
                "run_check_seconds": per_check,
                "run_check_fraction_of_push": per_check * limit_ps,
                "quota_bytes_s": quota,
                "admitted_bytes_s": held_bps,
                "quota_ratio": quota_ratio,
                "retries_after_429": retries,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
