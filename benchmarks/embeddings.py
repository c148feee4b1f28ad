"""Embedding tables (issue 23), from one run on this machine.

1. Rows per second pulled and pushed, dim 16 and 64, batches of 4,096 ids drawn Zipf (exponent
   1.1) from 1,000,000 ids, by one client thread (adamps.client.ps.PSClient, data plane: message
   frames) against a cluster of 3 controllers + 3 parameter servers with replication factor 1
   (benchmarks/replication.cluster), beside the in-process numpy limit on the same batches: a
   dict lookup of each id's slot and ``values[slots]`` (pull) or ``np.add.at(values, slots,
   -lr * grads)`` (push), measured in the same run. Goal: >= 0.5 of the limit.
2. Bytes moved per training step (the ids, rows and row gradients of one 4,096-id batch, as
   arrays on the wire) for tables of 1,000,000 and 10,000,000 ids: they follow the rows
   touched, not the table size.
3. The AUC that 2 model replicas reach on the planted click-through workload
   (adamps/data/ctr_data.py), against the planted truth's AUC on the same held-out examples (goal:
   within 0.01), and their examples per CPU-second (the replicas, the servers and the
   controllers, from /proc) against one PyTorch process training the same model on the same
   batches with ``nn.Embedding(sparse=True)`` and ``torch.optim.Adagrad`` (sparse row updates),
   one intra-op thread (goal >= 0.7). The replicas are ``examples/torch_ctr.py``'s
   (``adamps.torch.Embedding`` + the MLP under ``DownpourOptimizer``) and ``trainer.ctr``'s (the
   numpy engine), in the same run (``--ctr-side``).

4. A bulk load (issue 38): --rows rows of --dim (Adagrad) pushed in pushes of 100,000 ids
   into a cluster of 3 servers at replication factor 3 with `adamps up`'s defaults: rows
   per second, pushes refused (``not_durable``), and per server, flushed, the RSS and the LMDB
   bytes per row against the raw bytes (values + optimizer state: 2 x dim x 4). Goals: RSS
   <= 1.5 x raw + 64 bytes per row + 256 MiB; LMDB <= 1.5 x raw. Then the same rows by value
   (``put_rows``, the path of ``adamps table load``) into a fresh cluster: ``bulk_put_rows_per_s``
   and ``bulk_put_refused``. Between the two, the idle cluster holding the rows:
   ``idle_cluster_cpu_s_per_s`` (goal <= 0.05). Issue 38's full run is
   ``--rows 20000000 --dim 16``; the Zipf figures of item 1 at dim 16 are also printed as
   ``zipf_push_rows_per_s``, ``zipf_pull_rows_per_s`` and their ``zipf_*_ratio``.

    python benchmarks/embeddings.py [--seconds 5] [--examples 300000] [--skip-auc]
        [--ctr-side torch|numpy|both] [--batch 512] [--mlp-every 1] [--rows 1000000] [--dim 8]
        [--only-load]

Human-readable lines, then one JSON object of the figures as the last line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.append(
    str(ROOT / "benchmarks")
)  # after ROOT: benchmarks/trainer.py must not hide trainer/

from replication import N_BUCKETS, TOKEN  # noqa: E402
from replication import cluster as start_cluster  # noqa: E402

from adamps.client.ps import ControllerRouting, PartialPushError, PSClient  # noqa: E402
from adamps.data.ctr_data import CtrData, CtrSpec, auc  # noqa: E402
from adamps.layout import Layout  # noqa: E402
from adamps.up.cluster import LocalCluster  # noqa: E402
from trainer.ctr import CtrConfig, run  # noqa: E402

BATCH = 4096
N_IDS = 1_000_000
LR = 0.01


def zipf_batches(n_batches: int, n_ids: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, n_ids + 1, dtype=np.float64) ** 1.1
    cdf = np.cumsum(p)
    cdf /= cdf[-1]
    # Ranks scattered over the id space, as real ids are (not 0, 1, 2, ...).
    perm = rng.permutation(n_ids).astype(np.int64) * 7919 + 13
    return [
        perm[np.minimum(np.searchsorted(cdf, rng.random(BATCH)), n_ids - 1)]
        for _ in range(n_batches)
    ]


def timed(fn: Any, batches: list[np.ndarray], seconds: float) -> float:
    """Rows per second of fn(batch) over the batches, cycled for about `seconds`."""
    n, t0 = 0, time.perf_counter()
    while True:
        for b in batches:
            fn(b)
            n += len(b)
        el = time.perf_counter() - t0
        if el >= seconds:
            return n / el


def numpy_limit(batches: list[np.ndarray], dim: int, seconds: float) -> dict[str, float]:
    """The in-process limit: a hash lookup per id, then a gather or np.add.at on the same rows."""
    uniq = np.unique(np.concatenate(batches))
    index = {int(i): k for k, i in enumerate(uniq.tolist())}
    values = np.zeros((len(uniq), dim), np.float32)
    grads = np.full((BATCH, dim), 1e-3, np.float32)

    def slots(ids: np.ndarray) -> np.ndarray:
        get = index.get
        return np.fromiter((get(i) for i in ids.tolist()), np.int64, len(ids))

    def pull(ids: np.ndarray) -> None:
        values[slots(ids)]

    def push(ids: np.ndarray) -> None:
        np.add.at(values, slots(ids), -LR * grads)

    return {"pull": timed(pull, batches, seconds), "push": timed(push, batches, seconds)}


def adamps_rows(c: Any, batches: list[np.ndarray], dim: int, seconds: float) -> dict[str, float]:
    layout = Layout([], n_buckets=N_BUCKETS)
    with PSClient(ControllerRouting(c.controllers), layout, TOKEN) as client:
        table = f"bench{dim}"
        client.create_table(table, dim, init={"kind": "normal", "std": 0.01, "seed": 1},
                            optimizer={"kind": "sgd", "lr": LR})  # fmt: skip
        grads = np.full((BATCH, dim), 1e-3, np.float32)
        for b in batches:  # every row created before the measurement
            client.push_rows(table, b, grads)
        push = timed(lambda b: client.push_rows(table, b, grads), batches, seconds)
        pull = timed(lambda b: client.pull_rows(table, b), batches, seconds)
        assert client.http_requests == 0, "every request should go over the data plane"
    return {"pull": pull, "push": push}


def step_bytes(batches: list[np.ndarray], dim: int) -> float:
    """Array bytes on the wire of one step (pull the distinct ids' rows, push their gradients)."""
    per = []
    for b in batches:
        u = len(np.unique(b))
        per.append(2 * u * 8 + 2 * u * dim * 4)  # ids twice, rows and gradients
    return float(np.mean(per))


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a live process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cluster_cpu(c: Any) -> float:
    return sum(cpu_seconds(p.pid) for p in c.procs.values() if p.alive)


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS"):
            return int(line.split()[1]) * 1024
    return 0


def load_rows(c: Any, table: str, op: str, rows: int, dim: int, push: int, dtype: str,
              optimizer: str) -> float:  # fmt: skip
    """Seconds to load `rows` rows into a new table with `op` (push_rows or put_rows)."""
    layout = Layout([], n_buckets=c.n_buckets)
    with PSClient(ControllerRouting(c.controllers), layout, TOKEN, timeout=120.0) as client:
        client.create_table(table, dim, init={"kind": "normal", "std": 0.01, "seed": 1},
                            optimizer={"kind": optimizer, "lr": 0.1}, dtype=dtype)  # fmt: skip
        ids = np.random.default_rng(0).permutation(rows).astype(np.int64) * 7919 + 13
        grads = np.full((push, dim), 1e-3, np.float32)
        send = getattr(client, op)
        t0 = time.perf_counter()
        for s in range(0, rows, push):
            part = (table, ids[s : s + push], grads[: len(ids[s : s + push])])
            seq = None
            for resend in range(10):
                try:
                    send(*part, seq=seq)
                    break
                except PartialPushError as exc:
                    # A failover outlasted the client's retries (a loaded machine): as the docs
                    # say, the same push again with its seq completes it exactly once.
                    print(f"resending {op} seq {exc.seq} ({resend + 1}): {exc}", file=sys.stderr)
                    seq = exc.seq
            else:
                raise RuntimeError(f"{op}: a push applied in part after 10 resends")
        return time.perf_counter() - t0


def refusals(c: Any) -> float:
    """not_durable answers of the cluster's servers so far, the servers flushed first."""
    import re
    import urllib.request

    out = 0.0
    for i, addr in enumerate(c.servers):
        c.flush_server(i, timeout=600)
        txt = urllib.request.urlopen(f"http://{addr}/metrics", timeout=10).read().decode()
        pat = r'adamps_ps_requests_total\{op="[^"]*",outcome="not_durable"\} (\S+)'
        out += sum(float(x) for x in re.findall(pat, txt))
    return out


def default_cluster(root: Path) -> LocalCluster:
    """3 controllers and 3 servers at RF 3 with `adamps up`'s defaults (timers, flushes, the
    scrub): what a user loading a table has. benchmarks/replication.cluster's fast failover
    timers (heartbeats and pings every 0.2 s, the leader loop every 0.1 s) and no scrub made the
    idle figure 0.086-0.096 CPU-s per s empty (session 19), not the rows' cost."""
    c = LocalCluster(
        str(root), token=TOKEN, n_servers=3,  # 64 buckets, as `adamps up`
        controller_opts={"replication": 3}, ps_opts={"log-level": "WARNING"},
    )  # fmt: skip
    c.start(timeout=120)
    return c


def bulk_load(
    root: Path,
    rows: int,
    dim: int,
    push: int = 100_000,
    dtype: str = "float32",
    optimizer: str = "adagrad",
    idle_seconds: float = 20.0,
) -> dict[str, float]:
    """Item 4 of the module docstring; `dtype` the table's value type (issue 38: 16 bits halve
    the values, not the optimizer's float32 state: compare with ``rowwise_adagrad`` or sgd).

    The rows by value (``put_rows``) go to a second, fresh cluster: two tables of 20 M rows at
    RF 3 would not fit this machine's memory, and a fresh cluster loads under the same
    conditions as the first."""
    c = default_cluster(root / "rf3")
    try:
        pids = {n: p.popen.pid for n, p in c.procs.items() if n.startswith("ps")}
        rss0 = {n: rss_bytes(pid) for n, pid in pids.items()}
        took = load_rows(c, "load", "push_rows", rows, dim, push, dtype, optimizer)
        refused = refusals(c)
        rss = max((rss_bytes(pid) - rss0[n]) / rows for n, pid in pids.items())
        disk = (
            max(
                sum(f.stat().st_blocks * 512 for f in (root / "rf3" / n).rglob("*") if f.is_file())
                for n in pids
            )
            / rows
        )
        # The idle cluster holding the rows: the scrubber's budget, the flushers with nothing
        # to write, heartbeats and pings (issue 38: <= 0.05 CPU-s per s with 20 M rows).
        time.sleep(5.0)
        cpu0, t0 = cluster_cpu(c), time.perf_counter()
        time.sleep(idle_seconds)
        idle = (cluster_cpu(c) - cpu0) / (time.perf_counter() - t0)
    finally:
        c.stop()
    c = default_cluster(root / "rf3put")
    try:
        put_took = load_rows(c, "loadput", "put_rows", rows, dim, push, dtype, optimizer)
        put_refused = refusals(c)
    finally:
        c.stop()
    state = {"adagrad": dim, "rowwise_adagrad": 1, "sgd": 0}[optimizer]
    raw = dim * (2 if dtype != "float32" else 4) + 4 * state
    return {
        "bulk_load_dtype": dtype, "bulk_load_optimizer": optimizer,  # type: ignore[dict-item]
        "bulk_load_rows": rows, "bulk_load_dim": dim, "bulk_load_rows_per_s": rows / took,
        "bulk_load_refused": refused, "bulk_put_rows_per_s": rows / put_took,
        "bulk_put_refused": put_refused, "raw_bytes_per_row": raw, "rss_bytes_per_row": rss,
        "rss_bytes_per_row_over_raw": rss / raw,
        "rss_goal_bytes_per_row": 1.5 * raw + 64 + (256 << 20) / rows,
        "lmdb_bytes_per_row": disk, "lmdb_bytes_per_row_over_raw": disk / raw,
        "idle_cluster_cpu_s_per_s": idle,
    }  # fmt: skip


def torch_ctr(spec: CtrSpec, cfg: CtrConfig, replicas: int) -> dict[str, float]:
    """One PyTorch process, the same model, batches and optimizers (per-row Adagrad)."""
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    data = CtrData(spec)
    emb = torch.nn.Embedding(spec.n_ids, cfg.dim, sparse=True)
    torch.nn.init.normal_(emb.weight, std=0.05)
    mlp = torch.nn.Sequential(
        torch.nn.Linear(spec.n_fields * cfg.dim, cfg.hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(cfg.hidden, 1),
    )
    opt_rows = torch.optim.Adagrad(emb.parameters(), lr=cfg.row_lr, initial_accumulator_value=1e-4)
    opt_mlp = torch.optim.Adagrad(mlp.parameters(), lr=cfg.mlp_lr, initial_accumulator_value=1e-4)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    c0, t0, n = time.process_time(), time.perf_counter(), 0
    # torch's sparse Adagrad builds COO tensors: say that the invariant checks are off (else a
    # warning per step)
    checks = torch.sparse.check_sparse_tensor_invariants(enable=False)
    checks.__enter__()
    for step in range(cfg.n_steps()):
        for r in range(replicas):  # the replicas' batches, interleaved
            ids, y, _ = data.examples(cfg.batch, cfg.seed + r * 1_000_000 + step)
            x = emb(torch.from_numpy(ids)).reshape(len(y), -1)
            loss = loss_fn(mlp(x).squeeze(1), torch.from_numpy(y))
            opt_rows.zero_grad()
            opt_mlp.zero_grad()
            loss.backward()
            opt_rows.step()
            opt_mlp.step()
            n += len(y)
    cpu, wall = time.process_time() - c0, time.perf_counter() - t0
    checks.__exit__(None, None, None)
    ids, y, logit_true = data.examples(cfg.test, -1 % (1 << 32))
    with torch.no_grad():
        score = mlp(emb(torch.from_numpy(ids)).reshape(len(y), -1)).squeeze(1).numpy()
    return {
        "examples": n,
        "cpu_seconds": cpu,
        "examples_per_cpu_second": n / cpu,
        "examples_per_second": n / wall,
        "auc": auc(y, score),
        "best_auc": auc(y, logit_true),
    }


def ctr_side(c: Any, side: str, cfg: CtrConfig, mlp_every: int = 1) -> dict[str, Any]:
    """The CTR run with 2 adamps replicas of one kind, and its CPU: the replicas' own (while
    training) and the servers' and controllers' (from /proc, over the run and its evaluation)."""
    before = cluster_cpu(c)
    if side == "numpy":
        res = run(c.controllers, TOKEN, CtrSpec(), cfg, replicas=2)
    else:
        from examples.torch_ctr import run as run_torch

        res = run_torch(
            {"controllers": c.controllers, "token": TOKEN, "replicas": 2, "examples": cfg.examples,
             "batch": cfg.batch, "dim": cfg.dim, "hidden": cfg.hidden, "row_lr": cfg.row_lr,
             "mlp_lr": cfg.mlp_lr, "test": cfg.test, "seed": cfg.seed, "n_push": mlp_every,
             "n_fetch": mlp_every}
        )  # fmt: skip
    servers = cluster_cpu(c) - before  # includes the evaluation's pulls (small)
    replicas_cpu = res["examples"] / res["examples_per_cpu_second_replicas"]
    res["servers_cpu_seconds"] = servers
    res["replicas_cpu_seconds"] = replicas_cpu
    res["cluster_cpu_seconds"] = servers + replicas_cpu
    res["examples_per_cpu_second"] = res["examples"] / (servers + replicas_cpu)
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=5.0, help="per measurement")
    ap.add_argument("--examples", type=int, default=300_000, help="CTR examples per replica")
    ap.add_argument("--skip-auc", action="store_true")
    ap.add_argument("--batch", type=int, default=CtrConfig.batch, help="CTR examples per step")
    ap.add_argument(
        "--mlp-every", type=int, default=1,
        help="torch replicas: push and fetch the MLP every n steps (Downpour's n_push, n_fetch)",
    )  # fmt: skip
    ap.add_argument(
        "--ctr-side", choices=("torch", "numpy", "both"), default="both",
        help="the adamps replicas of the CTR run: adamps.torch.Embedding (examples/torch_ctr.py), "
        "the numpy engine (trainer.ctr), or both",
    )  # fmt: skip
    ap.add_argument("--rows", type=int, default=1_000_000, help="rows of the bulk load")
    ap.add_argument("--dim", type=int, default=8, help="dim of the bulk load's table")
    ap.add_argument("--only-load", action="store_true", help="the bulk load alone (item 4)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"],
                    help="the bulk load's table's value type")  # fmt: skip
    ap.add_argument("--optimizer", default="adagrad", choices=["adagrad", "rowwise_adagrad", "sgd"],
                    help="the bulk load's table's optimizer")  # fmt: skip
    args = ap.parse_args()
    batches = zipf_batches(40, N_IDS)
    out: dict[str, Any] = {"batch": BATCH, "n_ids": N_IDS}
    root = Path(tempfile.mkdtemp(prefix="adamps-bench-emb-"))
    load = bulk_load(root, args.rows, args.dim, dtype=args.dtype, optimizer=args.optimizer)
    out.update(load)
    print(
        f"bulk load of {args.rows:,} rows of dim {args.dim} ({args.optimizer}, {args.dtype}) "
        "at RF 3: "
        f"{load['bulk_load_rows_per_s']:,.0f} rows/s, {load['bulk_load_refused']:.0f} refused; "
        f"per server and row: RSS {load['rss_bytes_per_row']:.0f} B "
        f"({load['rss_bytes_per_row_over_raw']:.2f} x raw; goal <= "
        f"{load['rss_goal_bytes_per_row']:.0f} B), LMDB {load['lmdb_bytes_per_row']:.0f} B "
        f"({load['lmdb_bytes_per_row_over_raw']:.2f} x raw; goal <= 1.5); the same rows by "
        f"value (put_rows): {load['bulk_put_rows_per_s']:,.0f} rows/s, "
        f"{load['bulk_put_refused']:.0f} refused; the idle cluster holding them: "
        f"{load['idle_cluster_cpu_s_per_s']:.3f} CPU-s per s (goal <= 0.05)"
    )
    if args.only_load:
        print(json.dumps(out))
        return 0
    c = start_cluster(str(root / "rf1"), 1, 262_144)
    try:
        for dim in (16, 64):
            lim = numpy_limit(batches, dim, args.seconds)
            got = adamps_rows(c, batches, dim, args.seconds)
            for op in ("pull", "push"):
                ratio = got[op] / lim[op]
                out[f"{op}_rows_per_s_dim{dim}"] = got[op]
                out[f"{op}_limit_rows_per_s_dim{dim}"] = lim[op]
                out[f"{op}_ratio_dim{dim}"] = ratio
                print(
                    f"dim {dim:2d} {op:4s}: adamps RF 1 data plane {got[op]:>10,.0f} rows/s, "
                    f"numpy limit {lim[op]:>10,.0f} rows/s, ratio {ratio:.2f} (goal >= 0.5)"
                )
                if dim == 16:  # issue 38's names: batch 4096, Zipf ids, dim 16
                    out[f"zipf_{op}_rows_per_s"] = got[op]
                    out[f"zipf_{op}_ratio"] = ratio
        for n_ids in (N_IDS, 10 * N_IDS):
            b = zipf_batches(20, n_ids, seed=1)
            for dim in (16, 64):
                nb = step_bytes(b, dim)
                out[f"step_bytes_dim{dim}_ids{n_ids}"] = nb
                table_mb = n_ids * dim * 4 / 1e6
                print(
                    f"bytes per step, dim {dim}, table of {n_ids:,} ids ({table_mb:,.0f} MB): "
                    f"{nb:,.0f} ({nb / (n_ids * dim * 4):.2e} of the table)"
                )
        if not args.skip_auc:
            cfg = CtrConfig(examples=args.examples, batch=args.batch, n_buckets=N_BUCKETS)
            sides = ("torch", "numpy") if args.ctr_side == "both" else (args.ctr_side,)
            for side in sides:
                res = ctr_side(c, side, cfg, args.mlp_every)
                out["ctr" if side == "numpy" else "ctr_torch"] = res
                print(
                    f"CTR ({side} replicas), 2 replicas, {res['examples']:,} examples: AUC "
                    f"{res['auc']:.4f}, planted truth {res['best_auc']:.4f}, gap "
                    f"{res['auc_gap']:.4f} (goal <= 0.01); {res['examples_per_second']:,.0f} "
                    f"examples/s, {res['row_bytes_per_step']:,.0f} row bytes per step and replica"
                )
                print(
                    f"CTR ({side}) CPU: {res['examples_per_cpu_second']:,.0f} examples per "
                    f"CPU-second (replicas {res['replicas_cpu_seconds']:.1f} s + servers and "
                    f"controllers {res['servers_cpu_seconds']:.1f} s)"
                )
            try:
                tr = torch_ctr(CtrSpec(), cfg, replicas=2)
            except ImportError:
                print("torch not installed: no PyTorch baseline")
            else:
                out["torch"] = tr
                print(
                    f"PyTorch, one process, same batches: {tr['examples_per_cpu_second']:,.0f} "
                    f"examples per CPU-second, AUC {tr['auc']:.4f}"
                )
                for side in sides:
                    res = out["ctr" if side == "numpy" else "ctr_torch"]
                    ratio = res["examples_per_cpu_second"] / tr["examples_per_cpu_second"]
                    out[f"ctr_cpu_ratio_vs_torch_{side}"] = ratio
                    print(
                        f"adamps ({side} replicas, whole cluster) / PyTorch = {ratio:.2f} "
                        f"(goal >= 0.7)"
                    )
    finally:
        c.stop()
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
