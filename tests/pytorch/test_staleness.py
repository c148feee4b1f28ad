"""Two async replicas against a real `adamps ps` (issue 36 item 5): each push's server lr is
divided by 1 + its measured staleness (adamps/core/staleness.py), so two replicas in step take
one replica's step per round; ``staleness="off"`` keeps every push at the group's lr (auto is the
default). One replica alone is unchanged (tests/pytorch/test_equivalence.py: torch.optim.SGD's values)."""

from __future__ import annotations

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
@pytest.mark.parametrize("mode", ["auto", "off"])
def test_two_replicas_in_step_each_take_half_a_step(ps_url: str, token: str, mode: str) -> None:
    kw = {"staleness": mode}
    a, b = replicas(ps_url, token, f"stale-{mode}", **kw)
    for _ in range(4):  # alternate: each push is one update (the other's) behind
        step(a, 1.0)
        step(b, 1.0)
    a[0].flush()
    got = float(a[0].model_state_dict()["weight"][0, 0])
    a[0].close()
    b[0].close()
    # SGD: the first two fetches of each give its first tau (1: its own push and the other's
    # between them), so each replica's first two pushes are full steps, its last two half
    # steps under "auto": 4 + 4 / 2 steps in all; 8 full steps under "off"
    want = 1.0 - LR * (4 + 4 * 0.5) if mode == "auto" else 1.0 - LR * 8
    assert got == pytest.approx(want, abs=1e-6)
