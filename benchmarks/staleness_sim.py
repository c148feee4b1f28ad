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
adamps/core/staleness.py), ``sqrt`` (lr / sqrt(1 + tau)), ``decay:K`` (lr / (1 + tau * K / (K +
t)), t the updates applied so far: the division fades as the steps shrink; studied, not
shipped). Step rules, alone or ``+``-combined with one of those (``dca:2+auto``), use what only
a simulation has at hand at once, the values the replica computed on and the servers' values
at apply time: ``dc:L`` and ``dca:L`` (DC-ASGD's delay compensation, constant and adaptive
lambda), ``gap`` (Gap-Aware), ``adarev`` and ``adaacc`` (AdaptiveRevision for Adagrad, with and
without its revision of past steps), ``cos`` (the lr divided by 1 + tau times the cosine of the
replica's gradient with its previous one; the replica's own knowledge only): ``compensate``,
``adagrad_revised`` and ``agreement`` below. None is shipped: docs/training.md, "Several
replicas", gives their table. ``--one ACC`` takes one replica's mean from an earlier run.
Deterministic: a seed gives
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


LR_RULES = ("off", "auto", "sqrt")
#: the rules that change the gradient or the step beyond its lr (``+``-combined with an lr rule)
STEP_RULES = ("dc", "dca", "gap", "adarev", "adaacc", "cos")


def parse(rule: str) -> tuple[str, dict[str, float]]:
    """`rule` (``+``-separated parts: at most one lr rule, any step rules) as (its lr rule,
    step rule -> its parameter)."""
    lr_rule, steps = "off", {}
    for part in rule.split("+"):
        name, _, arg = part.partition(":")
        if name in LR_RULES and not arg or name == "decay" and arg:
            lr_rule = part
        elif name in ("dc", "dca") and arg:
            steps[name] = float(arg)
        elif name in ("gap", "adarev", "adaacc", "cos") and not arg:
            steps[name] = 0.0
        else:
            raise ValueError(f"unknown rule part {part!r}")
    if {"adarev", "adaacc"} <= set(steps):
        raise ValueError("adarev and adaacc are two forms of one rule: name one")
    factor(lr_rule, 1, 0)
    return lr_rule, steps


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


def compensate(steps, g, now, fetched, st) -> Any:
    """The gradient `g` (computed on `fetched`, applied at `now`) after the step rules that
    change the gradient. ``dc:L``: DC-ASGD's delay compensation (Zheng et al., ICML 2017) with
    a constant lambda, g + L g*g*(now - fetched); ``dca:L``: its adaptive form, lambda
    L / sqrt(MeanSquare), MeanSquare = 0.95 MeanSquare + 0.05 g*g per element; ``gap``:
    Gap-Aware (Barkai et al., ICLR 2020), g / (1 + |now - fetched| / C), C the mean size of
    one update per element (an average of |step| over the updates so far)."""
    import torch

    if "dc" in steps:
        g = g + steps["dc"] * g * g * (now - fetched)
    if "dca" in steps:
        ms = st.setdefault("ms", torch.zeros_like(g))
        ms.mul_(0.95).addcmul_(g, g, value=0.05)
        g = g + steps["dca"] * g * g * (now - fetched) / (ms.sqrt() + 1e-7)
    if "gap" in steps and "c" in st:
        g = g / (1 + (now - fetched).abs() / (st["c"] + 1e-12))
    return g


def track_step(st, delta) -> None:
    """Gap-Aware's C: the running mean of |one update| per element."""
    st["k"] = st.get("k", 0) + 1
    c = st.setdefault("c", delta.abs())
    if st["k"] > 1:
        c.add_((delta.abs() - c) / st["k"])


def agreement(g, prev, j, tau) -> float:
    """``cos``'s lr factor for tensor j: 1 / (1 + tau * max(0, cos(g, the replica's previous
    gradient of j))), full division (cos 1) for its first push. Pushes whose gradients keep
    their direction (signal) are divided as ``auto`` divides them; gradients that are mostly
    noise (cos ~ 0) are not: their stale sum does not add up N-fold. The replica knows both
    gradients: nothing on the servers, no bytes more per push."""
    import torch

    c = 1.0
    if prev[j] is not None:
        c = max(0.0, float(torch.nn.functional.cosine_similarity(g.reshape(1, -1),
                                                                 prev[j].reshape(1, -1))))  # fmt: skip
    prev[j] = g.clone()
    return 1.0 / (1 + tau * c)


def adagrad_revised(p, g, lr, st, gbar_old, revise: bool) -> None:
    """One torch Adagrad step (accumulator from 0, eps 1e-10 outside the root) on `p` under
    AdaptiveRevision (McMahan and Streeter, "Delay-Tolerant Algorithms for Asynchronous
    Distributed Online Learning", NIPS 2014): g_bck, the gradients the servers applied
    since this push's fetch (gbar - gbar_old, gbar their running sum), joins the accumulator
    as z += g*g + 2 g*g_bck, so pushes that agree with what landed meanwhile grow it as one
    summed gradient would (1 replica: g_bck = 0, torch's Adagrad); the denominator uses
    z' = max(z', z); `revise` also revises the lr the g_bck steps took: p += (eta_old - eta)
    g_bck."""
    import torch

    z = st.setdefault("z", torch.zeros_like(p))
    zmax = st.setdefault("zmax", torch.zeros_like(p))
    gbar = st.setdefault("gbar", torch.zeros_like(p))
    g_bck = gbar - gbar_old
    eta_old = lr / (zmax.sqrt() + 1e-10)
    z.add_(g * g + 2 * g * g_bck)
    torch.maximum(zmax, z, out=zmax)
    eta = lr / (zmax.sqrt() + 1e-10)
    p.sub_(eta * g)
    if revise:
        p.add_((eta_old - eta) * g_bck * (zmax > 0))
    gbar.add_(g)


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
    lr_rule, steps = parse(rule)
    manual = "adarev" in steps or "adaacc" in steps
    if manual and kind != "adagrad":
        raise ValueError(f"{rule}: adarev and adaacc revise Adagrad; {workload} runs {kind}")
    opt_cls = {"adagrad": torch.optim.Adagrad, "sgd": torch.optim.SGD}[kind]
    params = list(server.parameters())
    # one group per tensor where the rule scales each tensor's lr (cos)
    opt = opt_cls([{"params": [p]} for p in params] if "cos" in steps else params, lr=lr)
    replicas = [copy.deepcopy(server) for _ in range(n)]
    state: list[dict[str, Any]] = [{} for _ in params]  # the servers' per-element state
    #: replica -> the servers' running gradient sums at its fetch (adarev, adaacc)
    gbar_at = [[torch.zeros_like(p) for p in params] for _ in range(n)]
    #: replica -> its previous gradients (cos)
    prev: list[list[Any]] = [[None] * len(params) for _ in range(n)]
    lossf = torch.nn.CrossEntropyLoss()
    t = 0
    for epoch in range(epochs):
        gen = torch.Generator().manual_seed(epoch + 1000 * seed)  # practitioner.py's order
        order = torch.randperm(len(y), generator=gen)
        for i, start in enumerate(range(0, len(y), 32)):
            r = i % n
            m = replicas[r]
            m.zero_grad()
            idx = order[start : start + 32]
            lossf(m(x[idx]), y[idx]).backward()
            step_lr = lr * factor(lr_rule, n - 1, t)
            with torch.no_grad():
                before = [p.clone() for p in params] if "gap" in steps else None
                for j, (ps, pr) in enumerate(zip(params, m.parameters(), strict=True)):
                    g = compensate(steps, pr.grad, ps, pr, state[j])
                    if "cos" in steps:
                        opt.param_groups[j]["lr"] = step_lr * agreement(g, prev[r], j, n - 1)
                    if manual:
                        adagrad_revised(ps, g, step_lr, state[j], gbar_at[r][j],
                                        "adarev" in steps)  # fmt: skip
                    else:
                        ps.grad = g.clone()
            if not manual:
                if "cos" not in steps:
                    for g in opt.param_groups:
                        g["lr"] = step_lr
                opt.step()
            t += 1
            with torch.no_grad():  # the fetch: the values only, the buffers stay the replica's
                for j, (ps, pr) in enumerate(zip(params, m.parameters(), strict=True)):
                    pr.copy_(ps)
                    if before is not None:
                        track_step(state[j], ps - before[j])
                    if manual:
                        gbar_at[r][j].copy_(state[j]["gbar"])
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
        "--rules",
        default="off,auto",
        help="off, auto, sqrt, decay:K, dc:L, dca:L, gap, adarev, adaacc; + combines (comma-separated)",
    )
    ap.add_argument("--seeds", default="0,1,2", help="seeds (the model's init, the order)")
    ap.add_argument(
        "--one", type=float, default=None,
        help="one replica's mean accuracy (e.g. 0.9477) from an earlier run: skips those runs",
    )  # fmt: skip
    a = ap.parse_args()
    try:
        ns = [int(v) for v in a.replicas.split(",") if v]
        seeds = [int(v) for v in a.seeds.split(",") if v]
        rules = [r for r in a.rules.split(",") if r]
        for r in rules:
            steps = parse(r)[1]
            if ("adarev" in steps or "adaacc" in steps) and SETTINGS[a.workload][0] != "adagrad":
                raise ValueError(f"{r} revises Adagrad; the {a.workload} runs SGD")
    except ValueError as exc:
        ap.error(
            "--replicas/--seeds take integers, --rules off, auto, sqrt or decay:K, + dc:L, "
            f"dca:L, gap, adarev, adaacc or cos: {exc}"
        )
    if a.epochs < 1 or not seeds or any(n < 1 for n in ns):
        ap.error("--epochs >= 1, at least one seed and replica counts >= 1 are expected")
    out: dict[str, Any] = {"workload": a.workload, "epochs": a.epochs}
    if a.one is not None:  # one replica's mean known from an earlier run: not run again
        one, mean1 = [], a.one
    else:
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
