"""The step rules of benchmarks/staleness_sim.py (issue 36 item 5): their arithmetic against
values computed by hand, so that the table in docs/training.md measures the rules it names."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.timeout(60)


def _load_sim():
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "staleness_sim.py"
    spec = importlib.util.spec_from_file_location("staleness_sim", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["staleness_sim"] = mod
    spec.loader.exec_module(mod)
    return mod


sim = _load_sim()


def test_parse_combines_one_lr_rule_with_step_rules_and_refuses_the_rest() -> None:
    assert sim.parse("auto") == ("auto", {})
    assert sim.parse("dc:0.04+auto") == ("auto", {"dc": 0.04})
    assert sim.parse("adarev+decay:250") == ("decay:250", {"adarev": 0.0})
    for bad in ("dc", "gap:1", "adarev+adaacc", "nope", "decay"):
        with pytest.raises(ValueError):
            sim.parse(bad)


def test_delay_compensation_constant_and_adaptive_by_hand() -> None:
    g = torch.tensor([0.5, -2.0])
    now, fetched = torch.tensor([1.0, 1.0]), torch.tensor([0.0, 3.0])
    # DC-ASGD-c: g + L * g*g*(now - fetched) = [0.5 + 0.1*0.25*1, -2 + 0.1*4*(-2)]
    out = sim.compensate({"dc": 0.1}, g, now, fetched, {})
    assert torch.allclose(out, torch.tensor([0.525, -2.8]))
    # DC-ASGD-a: MeanSquare from 0 is 0.05*g*g, lambda L / sqrt(MeanSquare)
    st: dict = {}
    out = sim.compensate({"dca": 2.0}, g, now, fetched, st)
    ms = torch.tensor([0.05 * 0.25, 0.05 * 4.0])
    want = g + 2.0 * g * g * (now - fetched) / (ms.sqrt() + 1e-7)
    assert torch.allclose(st["ms"], ms) and torch.allclose(out, want)


def test_gap_aware_divides_by_one_plus_gap_over_the_mean_step() -> None:
    st: dict = {}
    sim.track_step(st, torch.tensor([0.5, -1.0]))
    sim.track_step(st, torch.tensor([-1.5, 1.0]))  # mean |step|: [1.0, 1.0]
    g = torch.tensor([3.0, 3.0])
    out = sim.compensate({"gap": 0.0}, g, torch.tensor([2.0, 0.0]), torch.tensor([0.0, 0.0]), st)
    assert torch.allclose(out, torch.tensor([1.0, 3.0]))  # gap 2 steps: / 3; no gap: as is


def test_adaptive_revision_without_delay_is_torch_adagrad() -> None:
    torch.manual_seed(0)
    w = torch.randn(50)
    ref = w.clone().requires_grad_(True)
    opt = torch.optim.Adagrad([ref], lr=0.02)
    st: dict = {}
    for _ in range(100):
        g = torch.randn(50)
        ref.grad = g.clone()
        opt.step()
        sim.adagrad_revised(w, g, 0.02, st, st.get("gbar", torch.zeros(50)).clone(), True)
    assert torch.allclose(w, ref.detach(), atol=1e-6)


def test_adaptive_revision_of_two_pushes_from_one_point_is_one_summed_step() -> None:
    # two replicas fetch w0 and push g1, g2 that agree in sign; the second's g_bck is g1: the
    # accumulator becomes (g1 + g2)^2 and the revision takes g1's step back to the new lr:
    # together one Adagrad step of the summed gradient, -lr * (g1 + g2) / |g1 + g2|
    w = torch.zeros(3)
    g1, g2 = torch.tensor([1.0, 2.0, -1.0]), torch.tensor([3.0, 1.0, -1.0])
    st: dict = {}
    sim.adagrad_revised(w, g1, 0.1, st, torch.zeros(3), True)
    sim.adagrad_revised(w, g2, 0.1, st, torch.zeros(3), True)
    s = g1 + g2
    assert torch.allclose(w, -0.1 * s / (s.abs() + 1e-10), atol=1e-6)
    assert torch.allclose(st["z"], s * s) and torch.allclose(st["gbar"], s)
    # adaacc (no revision): g1's step stays at its first lr
    w2, st2 = torch.zeros(3), {}
    sim.adagrad_revised(w2, g1, 0.1, st2, torch.zeros(3), False)
    sim.adagrad_revised(w2, g2, 0.1, st2, torch.zeros(3), False)
    assert torch.allclose(w2, -0.1 * g1 / g1.abs() - 0.1 * g2 / (s.abs() + 1e-10), atol=1e-6)
    # gradients that disagree shrink z below its maximum: the denominator keeps the maximum
    w3, st3 = torch.zeros(1), {}
    sim.adagrad_revised(w3, torch.tensor([2.0]), 0.1, st3, torch.zeros(1), True)
    sim.adagrad_revised(w3, torch.tensor([-1.0]), 0.1, st3, torch.zeros(1), True)
    assert float(st3["z"]) == pytest.approx(1.0) and float(st3["zmax"]) == pytest.approx(4.0)
    assert float(w3) == pytest.approx(-0.1 + 0.1 / 2)  # lr / sqrt(4) for -1; no revision


def test_agreement_divides_by_tau_times_the_cosine_with_the_previous_gradient() -> None:
    prev: list = [None]
    g = torch.tensor([1.0, 0.0])
    assert sim.agreement(g, prev, 0, 3) == pytest.approx(1 / 4)  # first push: cos 1
    assert sim.agreement(torch.tensor([1.0, 1.0]), prev, 0, 3) == pytest.approx(
        1 / (1 + 3 * 2**-0.5)
    )
    assert sim.agreement(torch.tensor([-1.0, -1.0]), prev, 0, 3) == pytest.approx(1.0)
