"""Train embeddings plus a small MLP on the planted click-through workload (adamps/data/ctr_data.py)
with model replicas against a parameter-server cluster, and compare the AUC reached with the
planted truth's (issue 23).

The model: one table of ``dim``-wide rows for every field's ids (Adagrad on the servers, per
row), the rows of an example's fields concatenated, then ``relu(x @ w1 + b1) @ w2 + b2`` and a
logistic loss. The MLP's weights are dense tensors (Adagrad) pulled every step. Each replica is a
process (Downpour: no synchronisation between replicas); per step it pulls the rows of the
batch's distinct ids and the MLP, computes the gradients in numpy, and pushes one row gradient
per distinct id (trainer/embedding.py) and the MLP's gradients.

    python -m trainer.ctr --local --replicas 2 --examples 200000
    python -m trainer.ctr --controllers 127.0.0.1:7000,... --replicas 2

Human-readable lines, then one JSON object of the figures as the last line.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from adamps.client import ControllerRouting, PSClient, push_checks
from adamps.client.prefetch import DEPTH, RowPipeline
from adamps.data.ctr_data import CtrData, CtrSpec, auc
from adamps.layout import Layout, TensorSpec
from trainer.embedding import lookup, row_grads

TABLE = "ctr_emb"
N_BUCKETS = 64


@dataclass(frozen=True)
class CtrConfig:
    dim: int = 8
    hidden: int = 32
    batch: int = 512
    #: examples each replica trains on
    examples: int = 200_000
    row_lr: float = 0.05
    mlp_lr: float = 0.02
    test: int = 100_000
    #: first data seed of replica r is seed + r * 1_000_000 (disjoint draws)
    seed: int = 1
    #: the cluster's bucket count (a client routes ids and shards by it)
    n_buckets: int = N_BUCKETS
    #: rounds in flight while a batch computes (adamps.client.prefetch: the rows a batch uses
    #: lack at most this many of the replica's own rounds; 0: none, no overlap)
    depth: int = DEPTH

    def n_steps(self) -> int:
        return max(1, self.examples // self.batch)


def mlp_specs(spec: CtrSpec, cfg: CtrConfig) -> list[TensorSpec]:
    d_in = spec.n_fields * cfg.dim
    return [
        TensorSpec("ctr.w1", (d_in, cfg.hidden)),
        TensorSpec("ctr.b1", (cfg.hidden,)),
        TensorSpec("ctr.w2", (cfg.hidden,)),
        TensorSpec("ctr.b2", (1,)),
    ]


def client_for(controllers: list[str], token: str, spec: CtrSpec, cfg: CtrConfig) -> PSClient:
    layout = Layout(mlp_specs(spec, cfg), n_buckets=cfg.n_buckets)
    return PSClient(ControllerRouting(controllers), layout, token, retry_for=30.0)


def create_model(client: PSClient, spec: CtrSpec, cfg: CtrConfig) -> None:
    client.create_table(
        TABLE,
        cfg.dim,
        init={"kind": "normal", "std": 0.05, "seed": 1},
        optimizer={"kind": "adagrad", "lr": cfg.row_lr, "initial_accumulator_value": 1e-4},
    )
    opt = {"kind": "adagrad", "lr": cfg.mlp_lr, "initial_accumulator_value": 1e-4}
    for t in mlp_specs(spec, cfg):
        init = {"kind": "xavier", "seed": 2} if t.name == "ctr.w1" else {"kind": "zeros"}
        if t.name == "ctr.w2":
            init = {"kind": "normal", "std": 0.1, "seed": 3}
        client.create(t, init=init, optimizer=opt)


def forward(x: np.ndarray, p: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(logit, hidden pre-activation, hidden activation) of inputs x [batch, fields * dim]."""
    z1 = x @ p["ctr.w1"] + p["ctr.b1"]
    h = np.maximum(z1, 0)
    return h @ p["ctr.w2"] + p["ctr.b2"][0], z1, h


def gradients(
    x: np.ndarray, y: np.ndarray, p: dict[str, np.ndarray]
) -> tuple[float, dict[str, np.ndarray], np.ndarray]:
    """(mean logistic loss, MLP gradients, gradient of x) of one batch."""
    logit, z1, h = forward(x, p)
    prob = 1.0 / (1.0 + np.exp(-logit))
    loss = float(np.mean(np.logaddexp(0, logit) - y * logit))
    dl = ((prob - y) / len(y)).astype(np.float32)
    dh = np.outer(dl, p["ctr.w2"]) * (z1 > 0)
    grads = {
        "ctr.w2": h.T @ dl,
        "ctr.b2": np.array([dl.sum()], np.float32),
        "ctr.w1": x.T @ dh,
        "ctr.b1": dh.sum(axis=0),
    }
    return loss, grads, dh @ p["ctr.w1"].T


def train_replica(
    controllers: list[str], token: str, spec: CtrSpec, cfg: CtrConfig, r: int
) -> dict[str, Any]:
    """One model replica's training loop; returns its counts and timings."""
    data = CtrData(spec)
    names = [t.name for t in mlp_specs(spec, cfg)]
    t0, c0 = time.perf_counter(), time.process_time()
    losses = []
    cache: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def batch(step: int) -> tuple[np.ndarray, np.ndarray]:
        """Batch `step`'s (ids, labels), drawn once (its ids are fetched ahead of it)."""
        if step not in cache:
            ids, y, _ = data.examples(cfg.batch, cfg.seed + r * 1_000_000 + step)
            cache[step] = (ids, y)
        return cache[step]

    row_bytes = 0
    n = cfg.n_steps()
    with (
        client_for(controllers, token, spec, cfg) as client,
        RowPipeline(client, cfg.depth) as pipe,
    ):
        client.tables[TABLE] = cfg.dim
        dense_bytes = 0
        for step in range(min(n, cfg.depth + 1)):
            pipe.prime({TABLE: lookup(batch(step)[0])[0]})
        for step in range(n):
            ids, y = cache.pop(step)
            uniq, inv = lookup(ids)
            x = pipe.next()[TABLE][inv].reshape(len(y), -1)
            params, _ = client.pull(names)
            loss, grads, dx = gradients(x, y, params)
            # the step whole first (issue 39): a NaN in the MLP's gradients must not follow rows
            # already pushed
            for name, g in {"dx": dx, **grads}.items():
                push_checks.bounded(name, g)
            g_rows = row_grads(inv, dx.reshape(len(y), spec.n_fields, cfg.dim), len(uniq))
            ahead = step + 1 + cfg.depth
            fetch = {TABLE: lookup(batch(ahead)[0])[0]} if ahead < n else None
            # one round per step: rows and the MLP's gradients pushed, rows fetched ahead
            pipe.round(dense=grads, rows={TABLE: (uniq, g_rows)}, fetch_rows=fetch)
            row_bytes += 2 * uniq.nbytes + 2 * g_rows.nbytes
            dense_bytes += 2 * sum(v.nbytes for v in grads.values())
            losses.append(loss)
        pipe.flush()  # the last rounds' acknowledgements (and errors)
    return {
        "replica": r,
        "examples": cfg.n_steps() * cfg.batch,
        "seconds": time.perf_counter() - t0,
        "cpu_seconds": time.process_time() - c0,
        "row_bytes_per_step": row_bytes / cfg.n_steps(),
        "dense_bytes_per_step": dense_bytes / cfg.n_steps(),
        "first_loss": float(np.mean(losses[:20])),
        "last_loss": float(np.mean(losses[-20:])),
    }


def _replica_main(args: tuple, out: Any) -> None:
    try:
        out.put(train_replica(*args))
    except BaseException as exc:  # reported to the parent, which raises
        out.put({"error": f"{type(exc).__name__}: {exc}"})


def evaluate(controllers: list[str], token: str, spec: CtrSpec, cfg: CtrConfig) -> dict[str, float]:
    """AUC of the trained model and of the planted truth on a held-out draw."""
    data = CtrData(spec)
    ids, y, logit_true = data.examples(cfg.test, -1 % (1 << 32))
    with client_for(controllers, token, spec, cfg) as client:
        client.tables[TABLE] = cfg.dim
        uniq, inv = np.unique(ids.reshape(-1), return_inverse=True)
        rows = np.concatenate(
            [client.pull_rows(TABLE, uniq[s : s + 200_000]) for s in range(0, len(uniq), 200_000)]
        )
        params, _ = client.pull([t.name for t in mlp_specs(spec, cfg)])
    x = rows[inv].reshape(len(y), -1)
    logit, _, _ = forward(x, params)
    return {"auc": auc(y, logit), "best_auc": auc(y, logit_true), "test_examples": len(y)}


def run(
    controllers: list[str], token: str, spec: CtrSpec, cfg: CtrConfig, replicas: int
) -> dict[str, Any]:
    with client_for(controllers, token, spec, cfg) as setup:
        create_model(setup, spec, cfg)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_replica_main, args=((controllers, token, spec, cfg, r), out))
        for r in range(replicas)
    ]
    t0 = time.perf_counter()
    for p in procs:
        p.start()
    results = [out.get() for _ in procs]
    for p in procs:
        p.join()
    wall = time.perf_counter() - t0
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        raise RuntimeError(f"a replica failed: {errors[0]}")
    ev = evaluate(controllers, token, spec, cfg)
    examples = sum(r["examples"] for r in results)
    return {
        "replicas": replicas,
        "examples": examples,
        "wall_seconds": wall,
        "examples_per_second": examples / wall,
        "examples_per_cpu_second_replicas": examples / sum(r["cpu_seconds"] for r in results),
        "row_bytes_per_step": float(np.mean([r["row_bytes_per_step"] for r in results])),
        "dense_bytes_per_step": float(np.mean([r["dense_bytes_per_step"] for r in results])),
        "loss_first": float(np.mean([r["first_loss"] for r in results])),
        "loss_last": float(np.mean([r["last_loss"] for r in results])),
        **ev,
        "auc_gap": ev["best_auc"] - ev["auc"],
        "config": asdict(cfg),
        "n_ids": spec.n_ids,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m trainer.ctr", description=__doc__.split("\n\n")[0])
    ap.add_argument("--controllers", default="", help="controller addresses, comma separated")
    ap.add_argument("--local", action="store_true", help="start a local cluster for the run")
    ap.add_argument("--servers", type=int, default=3, help="parameter servers of --local")
    ap.add_argument("--replication", type=int, default=3, help="copies per bucket of --local")
    ap.add_argument("--replicas", type=int, default=2, help="model replicas (processes)")
    ap.add_argument("--examples", type=int, default=CtrConfig.examples, help="per replica")
    ap.add_argument("--batch", type=int, default=CtrConfig.batch)
    ap.add_argument("--dim", type=int, default=CtrConfig.dim)
    ap.add_argument("--test", type=int, default=CtrConfig.test, help="held-out examples")
    ap.add_argument("--n-buckets", type=int, default=N_BUCKETS, help="the cluster's buckets")
    args = ap.parse_args(argv)
    token = os.environ.get("ADAMPS_TOKEN", "ctr-token")
    cfg = CtrConfig(
        dim=args.dim, batch=args.batch, examples=args.examples, test=args.test,
        n_buckets=args.n_buckets,
    )  # fmt: skip
    spec = CtrSpec()
    if args.replicas < 1 or args.examples < args.batch:
        ap.error("--replicas must be >= 1 and --examples >= --batch")
    if not args.local and not args.controllers:
        ap.error("give --controllers or --local")
    if args.local:
        from adamps.up.cluster import LocalCluster

        root = Path(tempfile.mkdtemp(prefix="adamps-ctr-"))
        c = LocalCluster(
            root, token=token, n_servers=args.servers, n_buckets=args.n_buckets,
            controller_opts={"replication": args.replication},
            ps_opts={"log-level": "WARNING"},
        )  # fmt: skip
        c.start(timeout=60)
        try:
            res = run(c.controllers, token, spec, cfg, args.replicas)
        finally:
            c.stop()
    else:
        res = run(args.controllers.split(","), token, spec, cfg, args.replicas)
    print(
        f"{res['examples']} examples on {res['replicas']} replicas in {res['wall_seconds']:.1f} s "
        f"({res['examples_per_second']:.0f}/s); loss {res['loss_first']:.4f} -> {res['loss_last']:.4f}"
    )
    print(
        f"AUC {res['auc']:.4f}, planted truth {res['best_auc']:.4f} (gap {res['auc_gap']:.4f}) "
        f"on {res['test_examples']} held-out examples; {spec.n_ids} ids in {spec.n_fields} fields"
    )
    print(
        f"bytes per step and replica: rows {res['row_bytes_per_step']:.0f}, "
        f"MLP {res['dense_bytes_per_step']:.0f}"
    )
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
