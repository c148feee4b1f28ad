"""Why async replicas learn worse, and what fixes it (issue 36 item 5): the transformer of
benchmarks/practitioner.py with 1, 2 and 4 Downpour replicas, at equal total examples.

    python benchmarks/staleness.py                    # the study (about 15 minutes on 2 cores)
    python benchmarks/staleness.py --quick            # a smoke run: 1 epoch, few variants
    python benchmarks/staleness.py --epochs 2 --seeds 1 --only 2:off,2:auto,4:off

Every variant trains examples/torch_transformer.py (Adagrad lr 0.02, batch 32, 3 epochs of the
built-in MNIST's 4,000 images, shared by the replicas: replica r of N takes every N-th batch) in
its own run of one local cluster (3 controllers, 3 parameter servers, RF 1: replication is exact,
it does not change what is learnt), each replica a process with one thread, in its own loop
(``zero_grad(); loss.backward(); opt.step()``). Held-out accuracy on 1,000 images is replica 0's
after every replica flushed, at the servers' values. The variants:

- ``1 seed s``: one replica (model init and data order from s): the noise floor;
- ``N:off``: n_push = n_fetch = 1, local_lr = lr, every push at lr (the defaults before);
- ``N:auto``: ``staleness="auto"`` (the default): each push's lr divided by ``1 + tau``
  (``$WORLD_SIZE - 1`` until measured; the replicas here set it as adamps launch does), tau the updates the
  other replicas applied to the replica's tensors between two of its fetches (the shards'
  versions the fetches return; adamps/core/staleness.py);
- ``N:zhang``: ``lr / max(1, tau)`` (Zhang et al., IJCAI 2016), set as the group's lr;
- ``N:replicas``: lr / N, the rule of thumb;
- ``N:push2``: pushes of summed gradients, n_push = 2;
- ``N:fetch2`` / ``N:fetch2_nolocal``: n_fetch = 2 (the local step, plain SGD at local_lr =
  lr, carries the replica between fetches; _nolocal: local_lr = 0);
- SSP is not a variant: ``--consistency ssp:S`` is the numpy trainer's (trainer/
  consistency.py); adamps.torch replicas are async.

The last line printed is one JSON object: variant -> accuracy, and the 1-replica mean and spread.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import secrets
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


@dataclass(frozen=True)
class Variant:
    name: str
    replicas: int
    lr: float = 0.02
    rule: str = "none"  #: none | replicas | zhang: the group's lr set before each step
    staleness: str = "off"  #: the optimizer's staleness= (auto: lr / (1 + tau) per push)
    n_push: int = 1
    n_fetch: int = 1
    local_lr: float | None = None
    seed: int = 0
    epochs: int = 3
    batch: int = 32

    @property
    def label(self) -> str:
        return self.name if self.replicas == 1 else f"{self.replicas}:{self.name}"


def data(seed: int) -> Any:
    from benchmarks.practitioner import image_data

    return image_data()


def batches(v: Variant, r: int) -> Any:
    import torch

    x, y, _, _ = data(v.seed)
    for epoch in range(v.epochs):
        g = torch.Generator().manual_seed(1000 * v.seed + epoch)
        order = torch.randperm(len(y), generator=g)
        for i in list(range(0, len(y), v.batch))[r :: v.replicas]:
            idx = order[i : i + v.batch]
            yield x[idx], y[idx]


def model(v: Variant) -> Any:
    import torch

    from examples.torch_transformer import Net

    torch.manual_seed(v.seed)
    return Net()


def replica(v: Variant, r: int, conn: dict[str, Any], barrier: Any, out: Any) -> None:
    try:
        out.put(_replica(v, r, conn, barrier))
    except BaseException as exc:  # reported to the parent, which raises
        barrier.abort()
        out.put({"error": f"replica {r}: {type(exc).__name__}: {exc}"})


def _replica(v: Variant, r: int, conn: dict[str, Any], barrier: Any) -> dict[str, Any]:
    import torch
    from torch import nn

    import adamps.torch as at

    torch.set_num_threads(1)
    os.environ["WORLD_SIZE"] = str(v.replicas)  # as adamps launch (and torchrun) set it
    net = model(v)
    opt = at.DownpourOptimizer(
        net, controllers=conn["controllers"], run=conn["run"], token=conn["token"], lr=v.lr,
        optimizer="adagrad", create=False, n_push=v.n_push, n_fetch=v.n_fetch,
        local_lr=v.local_lr, staleness=v.staleness,
    )  # fmt: skip
    meter = opt.worker.meter  # the staleness the fetches measured (adamps/core/staleness.py)
    taus: list[float] = []
    lossf = nn.CrossEntropyLoss()
    net.train()
    steps = 0
    for xb, yb in batches(v, r):
        tau = meter.tau
        taus.append(tau)
        if v.rule != "none":
            lr = {"replicas": v.lr / v.replicas, "zhang": v.lr / max(1.0, tau)}[v.rule]
            opt.param_groups[0]["lr"] = lr
        opt.zero_grad()
        lossf(net(xb), yb).backward()
        opt.step()
        steps += 1
    opt.flush()
    res: dict[str, Any] = {"steps": steps, "tau": statistics.fmean(taus[1:] or [0.0])}
    barrier.wait(timeout=1800)  # every replica's pushes are in before replica 0 evaluates
    if r == 0:
        net.load_state_dict(opt.model_state_dict())
        from benchmarks.practitioner import image_data

        _, _, tx, ty = image_data()
        net.eval()
        with torch.no_grad():
            res["acc"] = float((net(tx).argmax(1) == ty).float().mean())
    opt.close()
    return res


def run_variant(v: Variant, cluster: Any, token: str, i: int) -> dict[str, Any]:
    import adamps.torch as at

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    conn = {"controllers": cluster.controllers, "run": f"study{i}", "token": token}
    at.DownpourOptimizer(
        model(v), controllers=conn["controllers"], run=conn["run"], token=token, lr=v.lr,
        optimizer="adagrad", create=True,
    ).close()  # fmt: skip
    barrier = ctx.Barrier(v.replicas)
    procs = [
        ctx.Process(target=replica, args=(v, r, conn, barrier, out)) for r in range(v.replicas)
    ]
    for p in procs:
        p.start()
    results = [out.get(timeout=1800) for _ in procs]
    for p in procs:
        p.join(60)
    errors = [x["error"] for x in results if "error" in x]
    if errors:
        raise RuntimeError(errors[0])
    return {
        "acc": next(x["acc"] for x in results if "acc" in x),
        "tau": statistics.fmean(x["tau"] for x in results),
        "steps": sum(x["steps"] for x in results),
    }


VARIANTS = {
    "off": {},
    "auto": {"staleness": "auto"},
    "replicas": {"rule": "replicas"},
    "zhang": {"rule": "zhang"},
    "push2": {"n_push": 2},
    "fetch2": {"n_fetch": 2},
    "fetch2_nolocal": {"n_fetch": 2, "local_lr": 0.0},
}


def plan(a: argparse.Namespace) -> list[Variant]:
    epochs = 1 if a.quick else a.epochs
    base = Variant("1", 1, epochs=epochs, staleness="auto")
    out = [replace(base, name=f"1 seed {s}", seed=s) for s in range(a.seeds)]
    names = a.only.split(",") if a.only else [
        f"{n}:{k}" for n in (2, 4) for k in (["off", "auto"] if a.quick else VARIANTS)
    ]  # fmt: skip
    for item in names:
        n, _, k = item.partition(":")
        if k not in VARIANTS or n not in ("2", "4"):
            raise SystemExit(f"--only: {item!r}: expected N:VARIANT, N 2 or 4, VARIANT one of "
                             f"{sorted(VARIANTS)}")  # fmt: skip
        out.append(replace(base, name=k, replicas=int(n), **{"staleness": "off", **VARIANTS[k]}))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 epoch, off and auto only")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--seeds", type=int, default=3, help="seeds of the 1-replica baseline")
    ap.add_argument("--only", default="", help="N:VARIANT,... (default: every variant)")
    a = ap.parse_args()
    from benchmarks.practitioner import start_cluster

    token = secrets.token_hex(16)
    tmp = Path(tempfile.mkdtemp(prefix="adamps-staleness-"))
    print(f"load average at start: {os.getloadavg()[0]:.2f}", flush=True)
    cluster = start_cluster(1, tmp / "cluster", token)
    figures: dict[str, Any] = {}
    try:
        for i, v in enumerate(plan(a)):
            t0 = time.perf_counter()
            r = run_variant(v, cluster, token, i)
            figures[v.label] = round(100 * r["acc"], 2)
            print(f"{v.label:22s} replicas {v.replicas}  steps {r['steps']:5d}  measured tau "
                  f"{r['tau']:5.2f}  held-out accuracy {100 * r['acc']:6.2f} %  "
                  f"[{time.perf_counter() - t0:.0f} s]", flush=True)  # fmt: skip
    finally:
        cluster.stop()
    ones = [x for k, x in figures.items() if k.startswith("1 seed")]
    summary: dict[str, Any] = {"epochs": 1 if a.quick else a.epochs, "accuracy_pct": figures}
    if ones:
        summary["one_replica_mean"] = round(statistics.fmean(ones), 2)
        summary["one_replica_spread_pp"] = round(max(ones) - min(ones), 2)
        for k, x in figures.items():
            if ":" in k:
                summary.setdefault("gap_pp", {})[k] = round(x - summary["one_replica_mean"], 2)
        print(f"1 replica: mean {summary['one_replica_mean']:.2f} %, spread (max - min over "
              f"{len(ones)} seeds) {summary['one_replica_spread_pp']:.2f} points")  # fmt: skip
    summary["load_average_end"] = round(os.getloadavg()[0], 2)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
