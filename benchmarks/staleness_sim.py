"""Async replicas' staleness in one process, without a cluster (issue 36 item 5): what N Downpour
replicas learn when each push is exactly N - 1 updates stale, under a rule for its lr.

    python benchmarks/staleness_sim.py                             # the table in docs/training.md
    python benchmarks/staleness_sim.py --workload convnet --epochs 2 --replicas 1,2 --seeds 0,1
    python benchmarks/staleness_sim.py --rules off,auto,decay:250 --replicas 4

The servers are one torch.optim optimizer over one copy of the model (Adagrad lr 0.02 for the
transformer, SGD lr 0.05 for the convnet: benchmarks/practitioner.py's settings); replica r of
N holds its own copy. Batch i of each pass (batch 32 of the built-in MNIST's 4,000 images, the
pass's order from the seed) goes to replica i mod N: it computes its gradient on the values it
fetched after its previous push, the servers apply it with the rule's lr, and the replica
fetches the values after it. So every push is exactly N - 1 updates stale, as N replicas in
step are in a cluster (benchmarks/staleness.py measures the cluster itself: tau 0.96-1.04 at 2
replicas, 2.90-3.10 at 4). BatchNorm statistics stay each replica's own (as adamps.torch keeps
buffers local); the held-out accuracy is the servers' values with replica 0's statistics.

Rules: ``off`` (every push at lr), ``auto`` (lr / (1 + tau): adamps' default,
adamps/core/staleness.py), ``sqrt`` (lr / sqrt(1 + tau)), ``decay:K`` (lr / (1 + tau * K / (K + t)), t the updates applied so
far: the division fades as the steps shrink; studied, not shipped). Deterministic: a seed gives
the same accuracy twice. The last line printed is one JSON object: for each workload, rule and
N, the accuracies by seed and their mean, and one replica's.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SETTINGS = {"transformer": ("adagrad", 0.02), "convnet": ("sgd", 0.05)}


def factor(rule: str, tau: int, t: int) -> float:
    """The lr factor of a push `tau` updates stale, `t` updates after the start."""
    if rule == "off":
        return 1.0
    if rule == "auto":
        return 1.0 / (1 + tau)
    if rule == "sqrt":
        return (1 + tau) ** -0.5
    if rule.startswith("decay:"):
        k = float(rule.split(":", 1)[1])
        return 1.0 / (1 + tau * k / (k + t))
    raise ValueError(f"unknown rule {rule!r}: expected off, auto, sqrt or decay:K")


def run(workload: str, n: int, epochs: int, rule: str, seed: int) -> float:
    """One replica schedule's held-out accuracy."""
    import torch

    from dataserver.sources import builtin_mnist

    torch.set_num_threads(1)
    x, y, tx, ty = builtin_mnist()
    f = lambda a: torch.from_numpy(a).float().div(255).unsqueeze(1)  # noqa: E731
    x, tx, y, ty = f(x), f(tx), torch.from_numpy(y), torch.from_numpy(ty)
    torch.manual_seed(seed)
    if workload == "convnet":
        from examples.torch_mnist import Net
    else:
        from examples.torch_transformer import Net
    server = Net()
    kind, lr = SETTINGS[workload]
    opt_cls = {"adagrad": torch.optim.Adagrad, "sgd": torch.optim.SGD}[kind]
    opt = opt_cls(server.parameters(), lr=lr)
    replicas = [copy.deepcopy(server) for _ in range(n)]
    lossf = torch.nn.CrossEntropyLoss()
    t = 0
    for epoch in range(epochs):
        gen = torch.Generator().manual_seed(epoch + 1000 * seed)  # practitioner.py's order
        order = torch.randperm(len(y), generator=gen)
        for i, start in enumerate(range(0, len(y), 32)):
            m = replicas[i % n]
            m.zero_grad()
            idx = order[start : start + 32]
            lossf(m(x[idx]), y[idx]).backward()
            for g in opt.param_groups:
                g["lr"] = lr * factor(rule, n - 1, t)
            for ps, pr in zip(server.parameters(), m.parameters(), strict=True):
                ps.grad = pr.grad.clone()
            opt.step()
            t += 1
            with torch.no_grad():  # the fetch: the values only, the buffers stay the replica's
                for ps, pr in zip(server.parameters(), m.parameters(), strict=True):
                    pr.copy_(ps)
    with torch.no_grad():
        for bs, br in zip(server.buffers(), replicas[0].buffers(), strict=True):
            bs.copy_(br)
        server.eval()
        return float((server(tx).argmax(1) == ty).float().mean())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="transformer", choices=sorted(SETTINGS))
    ap.add_argument("--epochs", type=int, default=10, help="passes over the 4,000 images")
    ap.add_argument("--replicas", default="2,4", help="replica counts besides 1, e.g. 2,4")
    ap.add_argument(
        "--rules", default="off,auto", help="off, auto, sqrt, decay:K (comma-separated)"
    )
    ap.add_argument("--seeds", default="0,1,2", help="seeds (the model's init, the order)")
    a = ap.parse_args()
    try:
        ns = [int(v) for v in a.replicas.split(",") if v]
        seeds = [int(v) for v in a.seeds.split(",") if v]
        rules = [r for r in a.rules.split(",") if r]
        for r in rules:
            factor(r, 1, 0)
    except ValueError as exc:
        ap.error(f"--replicas/--seeds take integers, --rules off, auto, sqrt or decay:K: {exc}")
    if a.epochs < 1 or not seeds or any(n < 1 for n in ns):
        ap.error("--epochs >= 1, at least one seed and replica counts >= 1 are expected")
    out: dict[str, Any] = {"workload": a.workload, "epochs": a.epochs}
    one = [run(a.workload, 1, a.epochs, "off", s) for s in seeds]
    mean1 = sum(one) / len(one)
    out["1"] = {"by_seed": one, "mean": round(mean1, 4)}
    print(f"{a.workload}, {a.epochs} passes, 1 replica: {mean1:.4f} ({one})", flush=True)
    for n in ns:
        for rule in rules:
            t0 = time.perf_counter()
            accs = [run(a.workload, n, a.epochs, rule, s) for s in seeds]
            mean = sum(accs) / len(accs)
            out[f"{n}:{rule}"] = {"by_seed": accs, "mean": round(mean, 4),
                                  "gap_pp": round(100 * (mean - mean1), 2)}  # fmt: skip
            print(f"{n} replicas, {rule:10s}: {mean:.4f} ({100 * (mean - mean1):+.2f} points; "
                  f"{accs}) [{time.perf_counter() - t0:.0f} s]", flush=True)  # fmt: skip
    print(json.dumps(out))


if __name__ == "__main__":
    main()
