"""Two async replicas against a real `adamps ps` (issue 36 item 5): each push's server lr is
divided by 1 + its measured staleness (adamps/core/staleness.py), so two replicas in step take
one replica's step per round, under every optimizer but plain SGD (never divided: its step is
the gradient's; docs/training.md, "Several replicas"); ``staleness="off"`` keeps every push at the group's lr (auto is the
default). One replica alone is unchanged (tests/pytorch/test_equivalence.py: torch.optim.SGD's values)."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch", reason="adamps.torch needs torch")
pytestmark = pytest.mark.slow  # a real `adamps ps` process
from torch import nn  # noqa: E402

import adamps.torch as at  # noqa: E402

LR = 0.1


def replicas(ps_url: str, token: str, run: str, **kw: object) -> tuple:
    models = [nn.Linear(2, 1, bias=False) for _ in range(2)]
    with torch.no_grad():
        for m in models:
            m.weight.fill_(1.0)
    a = at.DownpourOptimizer(models[0], ps=[ps_url], lr=LR, run=run, token=token, act_err=False,
                             **kw)  # fmt: skip
    b = at.DownpourOptimizer(models[1], ps=[ps_url], lr=LR, run=run, token=token, act_err=False,
                             create=False, **kw)  # fmt: skip
    return (a, models[0]), (b, models[1])


def step(opt_model: tuple, g: float) -> None:
    opt, model = opt_model
    opt.zero_grad()
    model.weight.grad = torch.full_like(model.weight, g)
    opt.step()


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("optimizer", "mode"),
    [("adagrad", "auto"), ("adagrad", "off"), ("sgd", "auto"), ("sgd_momentum", "auto")],
)
def test_two_replicas_in_step_each_take_half_a_step(
    ps_url: str, token: str, optimizer: str, mode: str
) -> None:
    kw: dict[str, object] = {"staleness": mode, "optimizer": optimizer}
    if optimizer == "sgd_momentum":
        kw.update(optimizer="sgd", optimizer_args={"momentum": 0.5})
    a, b = replicas(ps_url, token, f"stale-{optimizer}-{mode}", **kw)
    for _ in range(4):  # alternate: each push is one update (the other's) behind
        step(a, 1.0)
        step(b, 1.0)
    a[0].flush()
    got = float(a[0].model_state_dict()["weight"][0, 0])
    a[0].close()
    b[0].close()
    # the first two fetches of each give its first tau (1: its own push and the other's between
    # them), so each replica's first two pushes are full steps, its last two half steps under
    # "auto" (pushes 5-8 in all); every push a full step under "off"
    half = mode == "auto" and optimizer != "sgd"  # plain SGD is never divided (divides())
    scale = [1.0] * 4 + [0.5 if half else 1.0] * 4
    if optimizer == "adagrad":  # torch's: acc += g * g; w -= lr * g / (sqrt(acc) + eps)
        want = 1.0 - sum(LR * s / (math.sqrt(k) + 1e-10) for k, s in enumerate(scale, 1))
    elif optimizer == "sgd_momentum":  # buf = 0.5 * buf + g (the first: g); w -= lr * buf
        buf, want = 0.0, 1.0
        for s in scale:
            buf = 0.5 * buf + 1.0
            want -= LR * s * buf
    else:
        want = 1.0 - LR * sum(scale)
    assert got == pytest.approx(want, abs=1e-5)
