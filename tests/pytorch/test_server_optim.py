"""adamps.torch's optimizers are torch.optim optimizers whose rule the servers apply (issue 37
item 1), against a real `adamps ps`: a 2-group model trained by adamps.torch.AdamW (SGD) under
an LR scheduler equals torch.optim.AdamW (SGD) under the same scheduler step for step, and the
servers report each group's lr of the last step; state_dict round-trips and a resumed optimizer
continues as torch's does; zero_grad drops what the passes before it recorded; GradScaler
unscales or skips; a group that changes its state's layout is refused."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="adamps.torch needs torch")
pytestmark = pytest.mark.slow  # a real `adamps ps` process
from torch import nn  # noqa: E402

import adamps.torch as at  # noqa: E402
from adamps.client.rpc import RpcError, SyncRpc  # noqa: E402

BATCH = 8


def make_model() -> nn.Module:
    torch.manual_seed(0)
    # 32 x 16: k (m + n) = 8 * 48 < 512, so the weight pushes activation/error rows
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 3))


def groups(model: nn.Module, kind: str) -> list[dict[str, Any]]:
    body, head = model[0], model[2]  # type: ignore[index]
    if kind == "adamw":
        return [{"params": body.parameters()},
                {"params": head.parameters(), "lr": 3e-3, "weight_decay": 0.0}]  # fmt: skip
    return [{"params": body.parameters(), "momentum": 0.9},
            {"params": head.parameters(), "lr": 0.02}]  # fmt: skip


def batches(n: int, seed: int = 1) -> list[tuple[Any, Any]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(BATCH, 16, generator=g), torch.randint(0, 3, (BATCH,), generator=g))
            for _ in range(n)]  # fmt: skip


def schedule(opt: Any, kind: str, total: int) -> Any:
    if kind == "adamw":  # lr, and beta1 (cycle_momentum), change every step
        return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=[1e-2, 2e-2], total_steps=total)
    return torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)


def train(model: nn.Module, opt: Any, sched: Any, data: list, scaler: Any = None) -> None:  # type: ignore[type-arg]
    for x, y in data:
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        sched.step()


def applied_lr(ps_url: str, token: str, tensor: str) -> float:
    """The lr of the last update the server applied to `tensor` (its first shard)."""
    rpc = SyncRpc(ps_url, token, 10.0)
    try:
        return rpc.call("describe", name=tensor)["shards"][0]["applied"]["lr"]
    finally:
        rpc.close()


def close_to(a: nn.Module, b: nn.Module, tol: float) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert (p.detach() - q.detach()).abs().max() <= tol, name


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_two_groups_under_a_scheduler_equal_torch_step_for_step(
    ps_url: str, token: str, kind: str
) -> None:
    steps = 20
    data = batches(steps)
    ref = make_model()
    torch_cls = torch.optim.AdamW if kind == "adamw" else torch.optim.SGD
    ref_opt = torch_cls(groups(ref, kind), lr=1e-3 if kind == "adamw" else 0.05)
    ref_sched = schedule(ref_opt, kind, steps)

    model = make_model()
    cls = at.AdamW if kind == "adamw" else at.SGD
    opt = cls(groups(model, kind), model=model, ps=[ps_url], token=token, run=f"groups-{kind}",
              lr=1e-3 if kind == "adamw" else 0.05)  # fmt: skip
    assert isinstance(opt, torch.optim.Optimizer)
    sched = schedule(opt, kind, steps)
    try:
        for i, (x, y) in enumerate(data):
            lrs = [g["lr"] for g in ref_opt.param_groups]
            assert [g["lr"] for g in opt.param_groups] == lrs
            train(ref, ref_opt, ref_sched, [(x, y)])
            train(model, opt, sched, [(x, y)])
            close_to(model, ref, 2e-5)  # the servers' values, fetched back every step
            if i in (0, steps - 1):  # each group's lr of this step reached the servers
                assert applied_lr(ps_url, token, f"groups-{kind}..{{0}}0.weight") == pytest.approx(
                    lrs[0]
                )
                assert applied_lr(ps_url, token, f"groups-{kind}..{{0}}2.bias") == pytest.approx(
                    lrs[1]
                )
        assert lrs[0] != ref_opt.defaults["lr"] or kind == "sgd"  # the schedule moved it
    finally:
        opt.close()


@pytest.mark.timeout(180)
def test_state_dict_resumes_as_torch_resumes(ps_url: str, token: str, tmp_path: Any) -> None:
    steps = 16
    data = batches(steps)
    ref = make_model()
    ref_opt = torch.optim.AdamW(groups(ref, "adamw"), lr=1e-3)
    ref_sched = schedule(ref_opt, "adamw", steps)
    train(ref, ref_opt, ref_sched, data)

    model = make_model()
    opt = at.AdamW(groups(model, "adamw"), model=model, ps=[ps_url], token=token, run="resume")
    sched = schedule(opt, "adamw", steps)
    train(model, opt, sched, data[:6])
    torch.save({"opt": opt.state_dict(), "sched": sched.state_dict()}, tmp_path / "ck.pt")
    opt.close()

    saved = torch.load(tmp_path / "ck.pt", weights_only=True)
    assert set(saved["opt"]) == {"state", "param_groups", "adamps"}
    assert saved["opt"]["adamps"]["steps"] == 6
    assert saved["opt"]["adamps"]["tensors"][0] == "resume..{0}0.weight"
    # a new process: a fresh model (other weights), the same run: the servers' values and
    # their AdamW moments come back, the groups' lr and the schedule from the state_dicts
    torch.manual_seed(5)
    model2 = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 3))
    opt2 = at.AdamW(groups(model2, "adamw"), model=model2, ps=[ps_url], token=token,
                    run="resume", lr=0.5)  # fmt: skip
    sched2 = schedule(opt2, "adamw", steps)
    opt2.load_state_dict(saved["opt"])
    sched2.load_state_dict(saved["sched"])
    assert opt2.steps == 6
    assert [g["lr"] for g in opt2.param_groups] == [g["lr"] for g in saved["opt"]["param_groups"]]
    try:
        train(model2, opt2, sched2, data[6:])
        close_to(model2, ref, 2e-5)
        with pytest.raises(ValueError, match="server tensors"):
            other = make_model()
            opt3 = at.AdamW(other, ps=[ps_url], token=token, run="other")
            try:
                opt3.load_state_dict(saved["opt"])
            finally:
                opt3.close()
    finally:
        opt2.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad_forgets_the_passes_before_it(ps_url: str, token: str, set_to_none: bool) -> None:
    """A pass, zero_grad, another pass, step: torch steps on the second pass only. The linear
    layers' activation/error rows of the first pass were pushed too before (DownpourOptimizer
    existed then: this fails on the old code)."""
    (x1, y1), (x2, y2) = batches(2)
    ref = make_model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    model = make_model()
    opt = at.DownpourOptimizer(model, ps=[ps_url], token=token, lr=0.1, run=f"zg-{set_to_none}")
    try:
        for m, o in ((ref, ref_opt), (model, opt)):
            nn.functional.cross_entropy(m(x1), y1).backward()
            o.zero_grad(set_to_none=set_to_none)
            if set_to_none:
                assert all(p.grad is None for p in m.parameters())
            else:
                assert all(p.grad is not None and not p.grad.any() for p in m.parameters())
            nn.functional.cross_entropy(m(x2), y2).backward()
            o.step()
        close_to(model, ref, 1e-6)
    finally:
        opt.close()


@pytest.mark.timeout(120)
def test_grad_scaler_unscales_and_skips(ps_url: str, token: str) -> None:
    data = batches(6)
    ref = make_model()
    ref_opt = torch.optim.AdamW(groups(ref, "adamw"), lr=1e-3)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    model = make_model()
    opt = at.AdamW(groups(model, "adamw"), model=model, ps=[ps_url], token=token, run="amp")
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    try:
        for m, o, s in ((ref, ref_opt, ref_scaler), (model, opt, scaler)):
            for x, y in data:
                o.zero_grad()
                s.scale(nn.functional.cross_entropy(m(x), y)).backward()
                s.step(o)
                s.update()
        close_to(model, ref, 2e-5)
        assert opt.steps == 6 and opt.skipped == 0
        before = {k: v.clone() for k, v in opt.model_state_dict().items()}
        pushes = opt.stats()["pushes"]
        opt.zero_grad()
        scale = scaler.get_scale()
        (
            scaler.scale(nn.functional.cross_entropy(model(data[0][0]), data[0][1])) * float("inf")
        ).backward()
        scaler.step(opt)  # an inf gradient: skipped, the scale backs off
        scaler.update()
        assert opt.skipped == 1 and opt.steps == 6 and opt.stats()["pushes"] == pushes
        assert scaler.get_scale() < scale
        after = opt.model_state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before)
    finally:
        opt.close()


@pytest.mark.timeout(120)
def test_a_group_may_not_change_its_state_layout(ps_url: str, token: str) -> None:
    model = make_model()
    opt = at.SGD(model, ps=[ps_url], token=token, run="layout", lr=0.1)
    try:
        x, y = batches(1)[0]
        opt.param_groups[0]["momentum"] = 0.9  # plain SGD keeps no momentum buffer
        nn.functional.cross_entropy(model(x), y).backward()
        with pytest.raises(at.ModelError, match="param group 0 changed momentum"):
            opt.step()
        assert opt.stats()["pushes"] == 0
        with pytest.raises(at.ModelError, match="takes its param groups when it is made"):
            opt.add_param_group({"params": [torch.zeros(2, requires_grad=True)]})
        with pytest.raises(TypeError, match="unknown hyperparameter"):
            at.SGD(model, ps=[ps_url], token=token, run="layout", betas=(0.9, 0.99))
        # the server refuses the same change from any client, naming it; nothing applied
        client = opt.conn.remote.client
        before, _ = client.pull(["layout..{0}2.bias"])
        for hyper, message in (({"momentum": 0.5}, "changes momentum"),
                               ({"lr": float("inf")}, "finite number"),
                               ({"kind": "adam"}, "names optimizer 'adam'")):  # fmt: skip
            with pytest.raises(RpcError, match=message) as exc:
                client.round(dense={"layout..{0}2.bias": np.ones(3, np.float32)},
                             hyper={"layout..{0}2.bias": hyper})  # fmt: skip
            assert exc.value.code == "bad_request" and "layout..{0}2.bias" in str(exc.value)
        after, _ = client.pull(["layout..{0}2.bias"])
        assert np.array_equal(before["layout..{0}2.bias"], after["layout..{0}2.bias"])
        client.round(dense={"layout..{0}2.bias": np.ones(3, np.float32)},
                     hyper={"layout..{0}2.bias": {"lr": 0.5}})  # fmt: skip
        moved, _ = client.pull(["layout..{0}2.bias"])
        assert np.allclose(moved["layout..{0}2.bias"], before["layout..{0}2.bias"] - 0.5)
    finally:
        opt.close()


@pytest.mark.timeout(120)
def test_a_schedule_through_lr_zero_equals_torch(ps_url: str, token: str) -> None:
    """A linear warmup from lr 0 and a decay to 0 (LambdaLR; transformers' linear schedule) run
    as torch's: torch.optim takes lr 0; the servers refused it ('adamw lr must be > 0') at the
    first step. A negative lr is refused as torch refuses it, for SGD too."""
    steps = 12
    ramp = lambda s: min(1.0, s / 4) * max(0.0, (10 - s) / 6)  # noqa: E731 - 0 at 0 and >= 10
    ref = make_model()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, ramp)
    model = make_model()
    opt = at.AdamW(model, ps=[ps_url], token=token, run="ramp", lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, ramp)
    try:
        assert opt.param_groups[0]["lr"] == 0.0
        for x, y in batches(steps):
            train(ref, ref_opt, ref_sched, [(x, y)])
            train(model, opt, sched, [(x, y)])
            close_to(model, ref, 2e-5)
        assert applied_lr(ps_url, token, "ramp..{0}0.weight") == 0.0  # the last steps' lr
    finally:
        opt.close()
    for cls in (at.SGD, at.AdamW):
        with pytest.raises(at.ModelError, match=r"lr must be >= 0 \(as torch.optim\), got -0.1"):
            cls(make_model(), ps=[ps_url], token=token, run="negative", lr=-0.1)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("cls", "kw", "message"),
    [
        (at.SGD, {"momentum": "0.9"}, "sgd momentum must be a number, got '0.9'"),
        (at.SGD, {"momentum": None}, "sgd momentum must be a number, got None"),
        (at.AdamW, {"lr": "1e-3"}, "adamw lr must be a number, got '1e-3'"),
        (at.Adam, {"betas": 0.9}, "adam betas must be two numbers, got 0.9"),
    ],
)
def test_a_hyperparameter_that_is_not_a_number_is_named(
    ps_url: str, token: str, cls: Any, kw: dict[str, Any], message: str
) -> None:
    """A string was float()ed silently (torch refuses it); None gave float()'s message, which
    names no hyperparameter."""
    args = {"lr": 0.1, **kw}
    with pytest.raises(at.ModelError, match=rf"param group 0: {message}"):
        cls(make_model(), ps=[ps_url], token=token, run="not-a-number", **args)
