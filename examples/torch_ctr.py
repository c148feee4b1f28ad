"""A PyTorch click-through model trained by adamps (issue 23): ``adamps.torch.Embedding`` (one
server table for every field's ids, per-row Adagrad on the servers) and a small MLP, on the
planted-truth click-through workload (adamps/data/ctr_data.py: 1,000,100 ids in 4 fields, drawn
Zipf), with model replicas as processes, each a ``DownpourOptimizer`` loop; then the AUC on
held-out examples beside the planted truth's.

    python examples/torch_ctr.py --local --replicas 2 --examples 200000   # starts a cluster
    python examples/torch_ctr.py --controllers 127.0.0.1:7101,127.0.0.1:7102,127.0.0.1:7103

or through the command line, with the data sets of ``task()`` instead of the data servers:

    adamps up --torch examples.torch_ctr:task --target-accuracy 0.6 --epochs 2 \
        --train-arg batch_size=256 --train-arg lr=0.02 --train-arg optimizer=adagrad

(the held-out "accuracy" the views and --target-accuracy read is then the task's metric: AUC).

The model is ``CtrNet`` (also usable in a loop of one's own). Human-readable lines, then one JSON
object of the figures as the last line.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from a checkout: trainer/ and adamps/ beside it
    sys.path.insert(0, str(ROOT))

import adamps.torch as at  # noqa: E402
from adamps.data.ctr_data import CtrData, CtrSpec, auc  # noqa: E402

RUN = "torch-ctr"


class CtrNet(nn.Module):
    """ids [batch, fields] -> logit [batch]: the fields' rows concatenated, then a ReLU MLP."""

    def __init__(self, n_fields: int = 4, dim: int = 8, hidden: int = 32, row_lr: float = 0.05):
        super().__init__()
        self.emb = at.Embedding(
            None, dim, table="ctr", optimizer="adagrad", lr=row_lr, adagrad_initial=1e-4,
            init={"kind": "normal", "std": 0.05, "seed": 1},
        )  # fmt: skip
        self.mlp = nn.Sequential(nn.Linear(n_fields * dim, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.emb(ids).reshape(len(ids), -1)).squeeze(1)


def say(msg: str) -> None:
    print(msg, flush=True)  # progress while it runs (the replicas are processes of their own)


def ctr_auc(outputs: torch.Tensor, targets: torch.Tensor) -> float:
    """The Task's held-out metric: AUC of the logits."""
    return auc(targets.numpy(), outputs.numpy())


def task(examples: int = 100_000, test: int = 20_000, seed: int = 1) -> at.Task:
    """``adamps up --torch examples.torch_ctr:task``: CtrNet, its loss (binary cross-entropy on
    the logit), its own data sets (the planted-truth workload) and AUC as the held-out metric."""
    data = CtrData(CtrSpec())
    ids, y, _ = data.examples(examples, seed)
    tids, ty, _ = data.examples(test, -1 % (1 << 32))
    TD = torch.utils.data.TensorDataset
    return at.Task(
        model=CtrNet(CtrSpec().n_fields),
        loss=nn.BCEWithLogitsLoss(),
        train=TD(torch.from_numpy(ids), torch.from_numpy(y)),
        test=TD(torch.from_numpy(tids), torch.from_numpy(ty)),
        metric=ctr_auc,
    )


def make_model(args: Any) -> CtrNet:
    torch.manual_seed(0)  # every replica builds the same MLP: replica 0's values are created
    return CtrNet(CtrSpec().n_fields, args["dim"], args["hidden"], args["row_lr"])


def connect(model: nn.Module, args: Any, create: bool) -> at.DownpourOptimizer:
    return at.DownpourOptimizer(
        model, controllers=args["controllers"], run=RUN, token=args["token"], lr=args["mlp_lr"],
        optimizer="adagrad", adagrad_initial=1e-4, create=create,
        n_push=args.get("n_push", 1), n_fetch=args.get("n_fetch", 1),
    )  # fmt: skip


def train_replica(args: dict[str, Any], r: int) -> dict[str, Any]:
    """One replica's loop: the user's own ``zero_grad / backward / step``."""
    torch.set_num_threads(1)
    data = CtrData(CtrSpec())
    model = make_model(args)
    opt = connect(model, args, create=False)
    loss_fn = nn.BCEWithLogitsLoss()
    t0, c0, losses = time.perf_counter(), time.process_time(), []
    steps = args["examples"] // args["batch"]
    every = max(1, steps // 10)  # about ten progress lines per replica
    for step in range(steps):
        ids, y, _ = data.examples(args["batch"], args["seed"] + r * 1_000_000 + step)
        opt.zero_grad()
        loss = loss_fn(model(torch.from_numpy(ids)), torch.from_numpy(y))
        loss.backward()  # pushes the rows' gradients (one push_rows)
        opt.step()  # pushes the MLP's
        losses.append(float(loss.detach()))
        if (step + 1) % every == 0 or step + 1 == steps:
            say(f"  replica {r}: step {step + 1}/{steps}, loss {np.mean(losses[-every:]):.4f}, "
                f"{(step + 1) * args['batch'] / (time.perf_counter() - t0):.0f} examples/s")  # fmt: skip
    opt.close()
    return {
        "examples": steps * args["batch"],
        "seconds": time.perf_counter() - t0,
        "cpu_seconds": time.process_time() - c0,
        "row_bytes_per_step": model.emb.bytes_moved / steps,
        "first_loss": float(np.mean(losses[:20])),
        "last_loss": float(np.mean(losses[-20:])),
    }


def _replica_main(args: dict[str, Any], r: int, out: Any) -> None:
    try:
        out.put(train_replica(args, r))
    except BaseException as exc:  # reported to the parent, which raises
        out.put({"error": f"{type(exc).__name__}: {exc}"})


@torch.no_grad()
def evaluate(args: dict[str, Any]) -> dict[str, float]:
    """AUC of the servers' model and of the planted truth on a held-out draw."""
    ids, y, logit_true = CtrData(CtrSpec()).examples(args["test"], -1 % (1 << 32))
    model = make_model(args)
    opt = connect(model, args, create=False)  # pulls the servers' MLP into the model
    model.eval()
    x = torch.from_numpy(ids)
    score = torch.cat([model(x[s : s + 20_000]) for s in range(0, len(x), 20_000)]).numpy()
    opt.close()
    return {"auc": auc(y, score), "best_auc": auc(y, logit_true), "test_examples": len(y)}


def run(args: dict[str, Any]) -> dict[str, Any]:
    """Creates the run's tensors and table (replica 0's values), trains the replicas, evaluates."""
    say("creating the run's tensors and table ...")
    connect(make_model(args), args, create=True).close()
    say(f"training {args['replicas']} replicas, {args['examples']} examples each ...")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_replica_main, args=(args, r, out)) for r in range(args["replicas"])
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
    say(f"evaluating on {args['test']} held-out examples ...")
    ev = evaluate(args)
    examples = sum(r["examples"] for r in results)
    return {
        "replicas": args["replicas"],
        "examples": examples,
        "wall_seconds": wall,
        "examples_per_second": examples / wall,
        "examples_per_cpu_second_replicas": examples / sum(r["cpu_seconds"] for r in results),
        "row_bytes_per_step": float(np.mean([r["row_bytes_per_step"] for r in results])),
        "loss_first": float(np.mean([r["first_loss"] for r in results])),
        "loss_last": float(np.mean([r["last_loss"] for r in results])),
        **ev,
        "auc_gap": ev["best_auc"] - ev["auc"],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--controllers", default="", help="controller addresses, comma separated")
    ap.add_argument("--local", action="store_true", help="start a local cluster for the run")
    ap.add_argument("--replicas", type=int, default=2, help="model replicas (processes)")
    ap.add_argument("--examples", type=int, default=200_000, help="per replica")
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--dim", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=32)
    ap.add_argument("--row-lr", type=float, default=0.05)
    ap.add_argument("--mlp-lr", type=float, default=0.02)
    ap.add_argument("--test", type=int, default=100_000, help="held-out examples")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--n-push", type=int, default=1, help="push the MLP every n steps")
    ap.add_argument("--n-fetch", type=int, default=1, help="fetch the MLP every n steps")
    ap.add_argument("--token", default=None, help="cluster token (default: $ADAMPS_TOKEN)")
    a = ap.parse_args(argv)
    if a.replicas < 1 or a.examples < a.batch:
        ap.error("--replicas must be >= 1 and --examples >= --batch")
    if not a.local and not a.controllers:
        ap.error("give --controllers or --local")
    args = {k: v for k, v in vars(a).items() if k not in ("local", "controllers")}
    args["token"] = a.token or os.environ.get("ADAMPS_TOKEN") or ("torch-ctr" if a.local else None)
    if a.local:
        from adamps.up.cluster import LocalCluster

        # the controllers' documented default timeouts (a busy machine must not look dead), and
        # the cluster's directory removed at the end
        root = Path(tempfile.mkdtemp(prefix="adamps-torch-ctr-"))
        try:
            say(f"starting a local cluster (3 controllers, 3 parameter servers) in {root} ...")
            c = LocalCluster(
                root, token=args["token"], n_servers=3, n_buckets=64,
                ps_opts={"log-level": "WARNING"},
            )  # fmt: skip
            try:
                c.start(timeout=120)
                say("cluster ready")
                res = run({**args, "controllers": c.controllers})
            finally:
                c.stop()
        finally:
            shutil.rmtree(root, ignore_errors=True)
    else:
        res = run({**args, "controllers": a.controllers.split(",")})
    print(
        f"{res['examples']} examples on {res['replicas']} replicas in {res['wall_seconds']:.1f} s "
        f"({res['examples_per_second']:.0f}/s); loss {res['loss_first']:.4f} -> {res['loss_last']:.4f}"
    )
    print(
        f"AUC {res['auc']:.4f}, planted truth {res['best_auc']:.4f} (gap {res['auc_gap']:.4f}) "
        f"on {res['test_examples']} held-out examples"
    )
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
