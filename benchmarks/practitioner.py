"""What a practitioner pays for training through adamps, against plain PyTorch in the same run.

    python benchmarks/practitioner.py                 # every workload (about 15 minutes on 2 quiet cores)
    python benchmarks/practitioner.py --quick         # a smoke run: small sizes, 1 seed, under 2 minutes
    python benchmarks/practitioner.py --only ctr,idle # some workloads (convnet, transformer, ctr, idle)
    python benchmarks/practitioner.py --only transformer --epochs transformer=3 --seeds 1

Each workload is trained the way a user of ``adamps.torch`` trains it: their own loop
(``zero_grad(); loss.backward(); opt.step()``) with a ``DownpourOptimizer`` at its defaults
(``n_push = n_fetch = 1``, ``staleness="auto"``), one process per replica with ``WORLD_SIZE`` set, each replica taking every N-th batch of each
epoch (as ``DistributedSampler`` would), on a fresh local cluster of 3 controllers and 3
parameter servers started as ``adamps up`` starts them, with the controllers' documented default
timeouts. Plain PyTorch trains the same model with the torch.optim optimizer of the same name, lr
and batch, on the same examples, in one process with one thread, in the same run.

- **convnet**: examples/torch_mnist.py's network on the built-in MNIST (4,000 training, 1,000
  held-out images), SGD lr 0.05, 4 passes;
- **transformer**: examples/torch_transformer.py (2 encoder layers over the 28 rows of an
  image), Adagrad lr 0.02, batch 32 (the issue's setting), 10 passes;
- **ctr**: a factorization machine whose per-id weights and factors are ``adamps.torch``
  tables (``EmbeddingBag`` and ``Embedding``, Adagrad on the servers), on the planted-truth
  click-through data (adamps/data/ctr_data.py), 1 replica at batch 512 and 4096; AUC on held-out
  examples (plain PyTorch: ``nn.EmbeddingBag``/``nn.Embedding`` with sparse gradients and
  ``torch.optim.Adagrad``);
- **idle**: the cluster with nothing to do, its CPU-seconds per second.

Counted honestly: the cluster's CPU is every process's (3 controllers, 3 parameter servers read
from /proc/PID/stat over the training window: from the first replica's loop start to the last
one's end, its final flush included; plus each replica process's CPU over its loop, every
thread), the same window as plain PyTorch's, so neither the replicas' start (torch's import, the
model) nor their evaluation's pulls are counted. The trainers' figure is the replicas' CPU alone. Plain PyTorch's is its training
loop's CPU. Accuracy (AUC) is measured at equal total examples: N replicas share the epochs
that one replica trains alone. The last line printed is one JSON object of the figures.

Accuracy gaps are means over 3 seeds (the model's init and the images' order) of 1 and of N
replicas, after training that has nearly converged (one replica: 94-95 % for the transformer):
one run's held-out accuracy on 1,000 images moves by 1-2 points with its seed and the
replicas' interleaving (binomial noise alone is 0.8 points), as much as the goals' margins, and
after 3 passes a run is still learning fast, so the gap measured there is mostly how far behind
N replicas still are (docs/training.md, "Several replicas"). The CPU figures are seed 0's runs.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import secrets
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# First, even when PYTHONPATH names it too: sys.path[0] is benchmarks/, whose trainer.py would
# shadow the trainer package in the replica processes.
sys.path.insert(0, str(ROOT))

CLK_TCK = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Setting:
    """One measured configuration of a workload."""

    workload: str
    replicas: int = 1  #: 0: plain PyTorch in one process
    rf: int = 3
    batch: int = 32
    epochs: int = 1  #: passes over the training set (images); ctr: see `examples`
    examples: int = 0  #: ctr: total training examples, shared by the replicas
    optimizer: str = "sgd"
    lr: float = 0.05
    #: the model's init and the images' order (accuracy gaps are means over seeds: one run's
    #: held-out accuracy moves by 1-2 points with the seed and the replicas' interleaving)
    seed: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        who = (
            "plain PyTorch" if self.replicas == 0 else f"adamps RF {self.rf}, {self.replicas} rep."
        )
        seed = f", seed {self.seed}" if self.seed else ""
        return f"{self.workload} b{self.batch} {who}{seed}"


# -- CPU of the cluster's processes --------------------------------------------------------------


def proc_cpu_s(pid: int) -> float:
    """utime + stime of a live process, every thread, in seconds (0 if it has gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def cluster_cpu_s(cluster: Any) -> dict[str, float]:
    return {name: proc_cpu_s(p.popen.pid) for name, p in cluster.procs.items()}


#: the clusters' buckets (`--buckets`; 64, adamps up's default): fewer put a small model's
#: tensors in fewer buckets, which measures what fusing them would save (docs/benchmarks.md)
BUCKETS = 64


def start_cluster(rf: int, root: Path, token: str) -> Any:
    from adamps.up.cluster import LocalCluster

    c = LocalCluster(
        root, token=token, n_servers=3, n_buckets=BUCKETS, controller_opts={"replication": rf},
        ps_opts={"log-level": os.environ.get("PS_LOG", "WARNING")},
    )  # fmt: skip
    c.start(timeout=120)
    return c


# -- the workloads' models and data (imported in the replica processes) ---------------------------


def image_data() -> tuple[Any, Any, Any, Any]:
    import torch

    from dataserver.sources import builtin_mnist

    x, y, tx, ty = builtin_mnist()
    f = lambda a: torch.from_numpy(a).float().div(255).unsqueeze(1)  # noqa: E731
    return f(x), torch.from_numpy(y), f(tx), torch.from_numpy(ty)


def fm_model(s: Setting, plain: bool) -> Any:
    import torch
    from torch import nn

    dim = s.extra.get("dim", 8)

    class FM(nn.Module):
        """A factorization machine: bias + sum of per-id weights + pairwise factor products."""

        def __init__(self) -> None:
            super().__init__()
            if plain:
                from adamps.data.ctr_data import CtrSpec

                n = CtrSpec().n_ids
                self.w = nn.EmbeddingBag(n, 1, mode="sum", sparse=True)
                self.v = nn.Embedding(n, dim, sparse=True)
                nn.init.zeros_(self.w.weight)
                nn.init.normal_(self.v.weight, std=0.01)
            else:
                import adamps.torch as at

                opt = {"optimizer": s.optimizer, "lr": s.lr}
                # zeros, as the plain model's w: a table's default is torch's N(0, 1), which
                # drowned the learnt weights (an AUC 0.12 below plain PyTorch's at batch 512)
                zeros = {"kind": "zeros"}
                self.w = at.EmbeddingBag(None, 1, mode="sum", table="fm_w", init=zeros, **opt)
                self.v = at.Embedding(
                    None, dim, table="fm_v", init={"kind": "normal", "std": 0.01, "seed": 1}, **opt
                )
            self.bias = nn.Parameter(torch.zeros(1))

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            v = self.v(ids)
            s_ = v.sum(1)
            pair = 0.5 * ((s_ * s_).sum(1) - (v * v).sum((1, 2)))
            return self.bias + self.w(ids).squeeze(1) + pair

    torch.manual_seed(0)
    return FM()


def build_model(s: Setting, plain: bool) -> Any:
    import torch

    if s.workload == "ctr":
        return fm_model(s, plain)
    torch.manual_seed(s.seed)  # every replica builds the same model: replica 0's values are created
    if s.workload == "convnet":
        from examples.torch_mnist import Net
    else:
        from examples.torch_transformer import Net
    return Net()


def torch_optimizer(s: Setting, model: Any) -> Any:
    import torch

    cls = {"sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad}[s.optimizer]
    return cls(model.parameters(), lr=s.lr)


def batches(s: Setting, r: int, n: int) -> Any:
    """Replica r of n: every n-th batch of each epoch (ctr: of the example stream)."""
    import torch

    if s.workload == "ctr":
        from adamps.data.ctr_data import CtrData, CtrSpec

        data = CtrData(CtrSpec())
        for step in range(r, s.examples // s.batch, n):
            ids, y, _ = data.examples(s.batch, 1 + step)
            yield torch.from_numpy(ids), torch.from_numpy(y)
        return
    x, y, _, _ = image_data()
    for epoch in range(s.epochs):
        gen = torch.Generator().manual_seed(epoch + 1000 * s.seed)
        order = torch.randperm(len(y), generator=gen)
        starts = list(range(0, len(y), s.batch))
        for i in starts[r::n]:
            idx = order[i : i + s.batch]
            yield x[idx], y[idx]


def evaluate(s: Setting, model: Any) -> float:
    """Held-out accuracy (images) or AUC (ctr) of the model as it is."""
    import torch

    model.eval()
    with torch.no_grad():
        if s.workload == "ctr":
            from adamps.data.ctr_data import CtrData, CtrSpec, auc

            ids, y, _ = CtrData(CtrSpec()).examples(s.extra.get("test", 50_000), 0)
            x = torch.from_numpy(ids)
            score = torch.cat([model(x[i : i + 10_000]) for i in range(0, len(x), 10_000)])
            return auc(y, score.numpy())
        _, _, tx, ty = image_data()
        return float((model(tx).argmax(1) == ty).float().mean())


def loss_fn(s: Setting) -> Any:
    from torch import nn

    return nn.BCEWithLogitsLoss() if s.workload == "ctr" else nn.CrossEntropyLoss()


# -- one replica (or the plain process) ----------------------------------------------------------


def replica(s: Setting, r: int, conn: dict[str, Any], barrier: Any, out: Any) -> None:
    try:
        out.put(_replica(s, r, conn, barrier))
    except BaseException as exc:  # reported to the parent, which raises
        if barrier is not None:
            barrier.abort()
        out.put({"error": f"replica {r}: {type(exc).__name__}: {exc}"})


def _replica(s: Setting, r: int, conn: dict[str, Any], barrier: Any) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    # as `adamps launch` (and torchrun) set it: a replica's staleness-aware lr starts from it
    os.environ["WORLD_SIZE"] = str(max(1, s.replicas))
    plain = s.replicas == 0
    model = build_model(s, plain)
    if plain:
        opt = torch_optimizer(s, model)
    else:
        import adamps.torch as at

        opt = at.DownpourOptimizer(
            model, controllers=conn["controllers"], run=conn["run"], token=conn["token"],
            lr=s.lr, optimizer=s.optimizer, create=False,
        )  # fmt: skip
    lossf = loss_fn(s)
    model.train()
    examples = 0
    pids = conn.get("pids", {})
    # the cluster's CPU over this loop, as the trainer's and plain PyTorch's are counted: not
    # over this process's start (torch's import, the model) nor its evaluation's pulls
    cl0 = {k: proc_cpu_s(pid) for k, pid in pids.items()}
    c0, t0 = time.process_time(), time.perf_counter()
    for xb, yb in batches(s, r, max(1, s.replicas)):
        opt.zero_grad()
        lossf(model(xb), yb).backward()
        opt.step()
        examples += len(yb)
    if not plain:
        opt.flush()
    cpu, wall = time.process_time() - c0, time.perf_counter() - t0
    cl1 = {k: proc_cpu_s(pid) for k, pid in pids.items()}
    res = {"examples": examples, "cpu_s": cpu, "wall_s": wall, "cluster0": cl0, "cluster1": cl1}
    if barrier is not None:
        barrier.wait(timeout=1800)  # every replica's pushes are in before replica 0 evaluates
    if r == 0:
        if not plain:
            model.load_state_dict(opt.model_state_dict())  # the servers' parameters
        res["metric"] = evaluate(s, model)
    if not plain:
        opt.close()
    return res


def run_setting(s: Setting, tmp: Path) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    if s.replicas == 0:
        p = ctx.Process(target=replica, args=(s, 0, {}, None, out))
        p.start()
        res = out.get()
        p.join()
        if "error" in res:
            raise RuntimeError(res["error"])
        return {
            **res,
            "cluster_cpu_s": res["cpu_s"],
            "trainer_cpu_s": res["cpu_s"],
            "servers_cpu_s": 0.0,
        }
    token = secrets.token_hex(16)
    cluster = start_cluster(
        s.rf, tmp / f"{s.workload}-rf{s.rf}-r{s.replicas}-b{s.batch}-s{s.seed}", token
    )
    try:
        conn = {"controllers": cluster.controllers, "run": f"bench-{s.workload}", "token": token,
                "pids": {name: p.popen.pid for name, p in cluster.procs.items()}}  # fmt: skip
        # replica 0's values are created before any replica starts (as adamps train does)
        import adamps.torch as at

        at.DownpourOptimizer(
            build_model(s, False), controllers=conn["controllers"], run=conn["run"], token=token,
            lr=s.lr, optimizer=s.optimizer, create=True,
        ).close()  # fmt: skip
        barrier = ctx.Barrier(s.replicas)
        procs = [
            ctx.Process(target=replica, args=(s, r, conn, barrier, out)) for r in range(s.replicas)
        ]
        for p in procs:
            p.start()
        results = [out.get() for _ in procs]
        for p in procs:
            p.join()
    finally:
        cluster.stop()
    errors = [x["error"] for x in results if "error" in x]
    if errors:
        raise RuntimeError(errors[0])
    # the window from the first replica's loop start to the last one's end, per process (its
    # counter only grows: the earliest reading before, the latest after)
    servers = sum(
        max(x["cluster1"][k] for x in results) - min(x["cluster0"][k] for x in results)
        for k in results[0]["cluster0"]
    )
    trainers = sum(x["cpu_s"] for x in results)
    return {
        "examples": sum(x["examples"] for x in results),
        "trainer_cpu_s": trainers,
        "servers_cpu_s": servers,  # controllers and parameter servers over the training loops
        "cluster_cpu_s": trainers + servers,
        "wall_s": max(x["wall_s"] for x in results),
        "metric": next(x["metric"] for x in results if "metric" in x),
    }


def idle_cpu(seconds: float, tmp: Path) -> dict[str, Any]:
    token = secrets.token_hex(16)
    cluster = start_cluster(3, tmp / "idle", token)
    try:
        time.sleep(5.0)  # placement's aftermath (the first flushes, lease renewals) settles
        before, t0 = cluster_cpu_s(cluster), time.monotonic()
        time.sleep(seconds)
        after, dt = cluster_cpu_s(cluster), time.monotonic() - t0
    finally:
        cluster.stop()
    per = {k: (after[k] - before.get(k, 0.0)) / dt for k in after}
    return {"per_process": per, "total": sum(per.values()), "seconds": dt}


# -- the plan ------------------------------------------------------------------------------------


def plan(
    quick: bool, only: set[str], epochs: dict[str, int] | None = None, seeds: int | None = None
) -> list[Setting]:
    """The settings to run: plain PyTorch, RF 3 with 1 and N replicas (each accuracy setting
    over `seeds` seeds: a gap is a difference of means), and the convnet at RF 1 (seed 0)."""
    epochs = epochs or {}
    n_seeds = seeds or (1 if quick else 3)
    conv = Setting("convnet", batch=32, epochs=epochs.get("convnet", 1 if quick else 4),
                   optimizer="sgd", lr=0.05)  # fmt: skip
    trans = Setting("transformer", batch=32, epochs=epochs.get("transformer", 1 if quick else 10),
                    optimizer="adagrad", lr=0.02)  # fmt: skip
    each = lambda base, ns: [replace(base, replicas=n, seed=k) for k in range(n_seeds) for n in ns]  # noqa: E731
    ctr_n = 20_000 if quick else 100_000
    ctr = Setting("ctr", optimizer="adagrad", lr=0.05, examples=ctr_n,
                  extra={"test": 20_000 if quick else 50_000})  # fmt: skip
    out: list[Setting] = []
    if "convnet" in only:
        out += [replace(conv, replicas=0), *each(conv, (1, 2)), replace(conv, replicas=2, rf=1)]
    if "transformer" in only:
        reps = (0, 1, 2) if quick else (0, 1, 2, 4)
        out += [replace(trans, replicas=0), *each(trans, reps[1:])]
    if "ctr" in only:
        for b in (512, 4096):
            out += [replace(ctr, batch=b, replicas=0), replace(ctr, batch=b, replicas=1)]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes: a smoke run")
    ap.add_argument("--only", default="convnet,transformer,ctr,idle",
                    help="comma-separated workloads (default: all)")  # fmt: skip
    ap.add_argument(
        "--idle-seconds", type=float, default=None, help="idle window (default 30, quick 10)"
    )
    ap.add_argument("--epochs", default="",
                    help="passes over the images (default convnet=4,transformer=10; quick 1)")  # fmt: skip
    ap.add_argument("--seeds", type=int, default=None,
                    help="seeds per accuracy setting (default 3, quick 1)")  # fmt: skip
    ap.add_argument("--buckets", type=int, default=64,
                    help="buckets of each cluster (default 64, as adamps up)")  # fmt: skip
    a = ap.parse_args()
    if a.buckets < 1:
        ap.error(f"--buckets: expected a positive number of buckets, got {a.buckets}")
    global BUCKETS
    BUCKETS = a.buckets
    try:
        epochs = {k: int(v) for k, v in (kv.split("=") for kv in a.epochs.split(",") if kv)}
    except ValueError:
        ap.error(f"--epochs: expected WORKLOAD=N,... (e.g. transformer=10), got {a.epochs!r}")
    if set(epochs) - {"convnet", "transformer"} or any(v < 1 for v in epochs.values()):
        ap.error(f"--epochs: expected convnet=N and/or transformer=N with N >= 1, got {a.epochs!r}")
    if a.seeds is not None and a.seeds < 1:
        ap.error(f"--seeds: expected a count >= 1, got {a.seeds}")
    only = {w.strip() for w in a.only.split(",") if w.strip()}
    unknown = only - {"convnet", "transformer", "ctr", "idle"}
    if unknown:
        ap.error(
            f"--only: unknown workload(s) {sorted(unknown)}; expected convnet, transformer, ctr, idle"
        )
    tmp = Path(tempfile.mkdtemp(prefix="adamps-practitioner-"))
    try:
        measure(a, only, epochs, tmp)
    finally:  # the clusters' directories (LMDB files, logs)
        shutil.rmtree(tmp, ignore_errors=True)


def measure(a: argparse.Namespace, only: set[str], epochs: dict[str, int], tmp: Path) -> None:
    """Runs the plan's settings in turn, prints each, then the figures (the JSON last)."""
    print(f"load average at start: {os.getloadavg()[0]:.2f}", flush=True)
    res: list[tuple[Setting, dict[str, Any]]] = []
    for s in plan(a.quick, only, epochs, a.seeds):
        t0 = time.perf_counter()
        r = run_setting(s, tmp)
        res.append((s, r))
        eps_c, eps_t = r["examples"] / r["cluster_cpu_s"], r["examples"] / r["trainer_cpu_s"]
        metric = "AUC" if s.workload == "ctr" else "held-out accuracy"
        print(f"{s.label:40s} {r['examples']:7,} ex  {eps_c:9,.0f} ex/CPU-s cluster  {eps_t:9,.0f} "
              f"trainers  (servers {r['servers_cpu_s']:6.1f} CPU-s, trainers {r['trainer_cpu_s']:6.1f})  "
              f"{metric} {r['metric']:.4f}  [{time.perf_counter() - t0:.0f} s]", flush=True)  # fmt: skip
    figures: dict[str, Any] = {"quick": a.quick}

    def find_all(
        workload: str, replicas: int, rf: int = 3, batch: int | None = None
    ) -> list[dict[str, Any]]:
        return [
            r
            for s, r in res
            if (s.workload, s.replicas, s.rf) == (workload, replicas, rf)
            and batch in (None, s.batch)
        ]

    def find(
        workload: str, replicas: int, rf: int = 3, batch: int | None = None
    ) -> dict[str, Any] | None:
        """The first seed's run (the CPU figures: every seed's cluster costs the same)."""
        found = find_all(workload, replicas, rf, batch)
        return found[0] if found else None

    def ratio(
        key: str, workload: str, replicas: int, rf: int = 3, batch: int | None = None
    ) -> None:
        a_, p = find(workload, replicas, rf, batch), find(workload, 0, 3, batch)
        if a_ and p:
            plain_rate = p["examples"] / p["cluster_cpu_s"]
            c = a_["examples"] / a_["cluster_cpu_s"] / plain_rate
            t = a_["examples"] / a_["trainer_cpu_s"] / plain_rate
            figures[key] = round(c, 4)
            figures[key.replace("_cluster_", "_trainers_")] = round(t, 4)
            print(
                f"{key}: {c:.3f} (trainers alone {t:.3f}); plain PyTorch {plain_rate:,.0f} ex/CPU-s"
            )

    def gap(key: str, workload: str, replicas: int) -> None:
        """Mean held-out accuracy over the seeds with `replicas` minus with one replica."""
        one, n = find_all(workload, 1), find_all(workload, replicas)
        if one and n:
            m1 = sum(r["metric"] for r in one) / len(one)
            mn = sum(r["metric"] for r in n) / len(n)
            figures[key] = round(100 * (mn - m1), 2)
            each = lambda rs: ", ".join(f"{r['metric']:.3f}" for r in rs)  # noqa: E731
            print(f"{key}: {figures[key]:+.2f} points (mean {mn:.4f} with {replicas} replicas: "
                  f"{each(n)}; {m1:.4f} with 1: {each(one)}; {len(n)} seeds)")  # fmt: skip

    ratio("convnet_rf3_2rep_cluster_ratio", "convnet", 2)
    ratio("transformer_rf3_2rep_cluster_ratio", "transformer", 2)
    ratio("ctr_rf3_b512_cluster_ratio", "ctr", 1, batch=512)
    ratio("ctr_rf3_b4096_cluster_ratio", "ctr", 1, batch=4096)
    rf3, rf1 = find("convnet", 2, 3), find("convnet", 2, 1)
    if rf3 and rf1:
        v = (rf3["examples"] / rf3["cluster_cpu_s"]) / (rf1["examples"] / rf1["cluster_cpu_s"])
        figures["rf3_over_rf1_cluster"] = round(v, 4)
        print(f"rf3_over_rf1_cluster: {v:.3f} (convnet, 2 replicas, whole cluster's ex/CPU-s)")
    gap("convnet_2rep_acc_gap_pp", "convnet", 2)
    gap("transformer_2rep_acc_gap_pp", "transformer", 2)
    gap("transformer_4rep_acc_gap_pp", "transformer", 4)
    for b in (512, 4096):
        a_, p = find("ctr", 1, batch=b), find("ctr", 0, batch=b)
        if a_ and p:
            figures[f"ctr_b{b}_auc_gap"] = round(a_["metric"] - p["metric"], 5)
    if "ctr_b512_auc_gap" in figures:
        figures["ctr_auc_gap"] = figures["ctr_b512_auc_gap"]
        print(f"ctr_auc_gap: {figures['ctr_auc_gap']:+.4f} (adamps minus plain PyTorch, batch 512)")
    for w in ("convnet", "transformer"):
        p = find(w, 0)
        if p:
            figures[f"{w}_plain_acc"] = round(p["metric"], 4)
        ones = find_all(w, 1)
        if ones:  # the mean over the seeds, as the gaps use it
            figures[f"{w}_1rep_acc"] = round(sum(r["metric"] for r in ones) / len(ones), 4)
    if "idle" in only:
        idle = idle_cpu(a.idle_seconds or (10.0 if a.quick else 30.0), tmp)
        figures["idle_cluster_cpu_s_per_s"] = round(idle["total"], 4)
        per = ", ".join(f"{k} {v:.3f}" for k, v in sorted(idle["per_process"].items()))
        print(f"idle_cluster_cpu_s_per_s: {idle['total']:.3f} over {idle['seconds']:.0f} s ({per})")
    figures["load_average_end"] = round(os.getloadavg()[0], 2)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
