"""Equivalence (issue 22): 1 replica, 1 worker, server-side SGD, n_fetch = n_push = 1, no
compression: after 100 steps the parameters equal plain torch.optim.SGD's on the same batches
within 1e-5, with the nn.Linear weights pushed as activation/error vectors (the server computes
e.T @ a) and with dense gradients; each step's push and fetch are one request. Against a real
`adamps ps` on loopback."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="adamps.torch needs torch")
pytestmark = pytest.mark.slow  # a real `adamps ps` process
from torch import nn  # noqa: E402

import adamps.torch as at  # noqa: E402
from adamps.client.rpc import SyncRpc  # noqa: E402

STEPS, BATCH, LR = 100, 4, 0.05


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    # 64 x 32 and 32 x 64 weights: k (m + n) = 4 * 96 < m * n, so act/err wins for both;
    # not for 3 x 64 (4 * 67 > 192); the conv and every bias push dense gradients
    return nn.Sequential(
        nn.Conv1d(1, 2, 3, padding=1), nn.Flatten(), nn.Linear(64, 32), nn.Tanh(),
        nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 3),
    )  # fmt: skip


def batches(n: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 1, 32, generator=g), torch.randint(0, 3, (BATCH,), generator=g))
            for _ in range(n)]  # fmt: skip


def plain_sgd(data: list) -> dict[str, torch.Tensor]:  # type: ignore[type-arg]
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for x, y in data:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("act_err", [True, False], ids=["act-err", "dense"])
def test_downpour_equals_plain_sgd(ps_url: str, act_err: bool, token: str) -> None:
    data = batches()
    want = plain_sgd(data)
    model = make_model()
    run = "eq-fc" if act_err else "eq-dense"
    opt = at.DownpourOptimizer(model, ps=[ps_url], lr=LR, optimizer="sgd", run=run,
                               act_err=act_err, token=token)  # fmt: skip
    client = opt.conn.remote.client
    sent = []
    for x, y in data:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        before = client.dp_requests + client.http_requests
        opt.step()
        sent.append(client.dp_requests + client.http_requests - before)
    server = opt.model_state_dict()
    opt.close()
    # the step's push and its fetch are one round: one request to the one server, not a
    # round and a pull (issue 36: a synchronous step paid two round trips)
    assert sent == [1] * STEPS, sent
    forms = opt.counts.forms
    if act_err:  # two linear weights went as vectors every step; 64 x 3 is smaller dense
        assert forms["fc"] == 2 * STEPS, forms
    else:
        assert forms["fc"] == 0, forms
    assert opt.counts.pushes == STEPS and opt.counts.fetches == STEPS
    for k, v in want.items():
        assert torch.allclose(server[k], v, atol=1e-5, rtol=0), (k, (server[k] - v).abs().max())
        assert torch.allclose(model.state_dict()[k], v, atol=1e-5, rtol=0), k
    # the tensors live in the run's namespace on the server
    rpc = SyncRpc(ps_url, token)
    names = {t["name"] for t in rpc.call("list")["tensors"]}
    rpc.close()
    assert f"{run}..{{0}}2.weight" in names and f"{run}..{{0}}0.bias" in names
    # and moved: SGD on the server, not a stale copy
    assert not torch.allclose(server["2.weight"], make_model().state_dict()["2.weight"])


@pytest.mark.timeout(120)
def test_a_layer_whose_vectors_are_larger_sends_autograds_own_gradient(
    ps_url: str, token: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A linear layer over a sequence sees k = batch x length rows a step: 4 x 16 = 64 rows of
    8 + 8 values, larger than its 8 x 8 weight, so it goes dense. Its update is autograd's
    ``W.grad`` (which is ``e.T @ a``): no second product of the same rows in the trainer (that
    product, on numpy's BLAS threads beside torch's, was most of a transformer replica's CPU),
    and the run still equals plain SGD step for step."""
    from adamps.torch import downpour

    def no_second_product(*_a: object) -> None:
        raise AssertionError("the rows' product was computed again in the trainer")

    monkeypatch.setattr(downpour, "_outer", no_second_product)

    def seq_model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Flatten(), nn.Linear(128, 3))

    g = torch.Generator().manual_seed(2)
    data = [(torch.randn(BATCH, 16, 8, generator=g), torch.randint(0, 3, (BATCH,), generator=g))
            for _ in range(30)]  # fmt: skip
    plain = seq_model()
    popt = torch.optim.SGD(plain.parameters(), lr=LR)
    for x, y in data:
        popt.zero_grad()
        nn.functional.cross_entropy(plain(x), y).backward()
        popt.step()
    model = seq_model()
    opt = at.DownpourOptimizer(model, ps=[ps_url], lr=LR, optimizer="sgd", run="eq-seq",
                               token=token)  # fmt: skip
    for x, y in data:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    server = opt.model_state_dict()
    opt.close()
    assert opt.counts.forms.get("fc", 0) == 0, opt.counts.forms  # both layers larger as vectors
    assert opt.counts.fc_dense_bytes == 30 * 4 * (8 * 8 + 128 * 3)
    for k, v in plain.state_dict().items():
        assert torch.allclose(server[k], v, atol=1e-5, rtol=0), (k, (server[k] - v).abs().max())


class Scaled(nn.Module):
    """A 0-d parameter (a learned temperature, as CLIP's logit_scale) beside a Linear."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(8, 3)
        self.temp = nn.Parameter(torch.tensor(1.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.temp


@pytest.mark.timeout(120)
def test_a_zero_dim_parameter_trains_as_torchs(ps_url: str, token: str) -> None:
    """Its server tensor is one element of shape (1,); the model keeps shape (). Before, every
    constructor stopped with LayoutError 'shape must be positive ints, got ()'."""
    g = torch.Generator().manual_seed(2)
    data = [(torch.randn(BATCH, 8, generator=g), torch.randint(0, 3, (BATCH,), generator=g))
            for _ in range(10)]  # fmt: skip
    ref = Scaled()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.05)
    model = Scaled()
    opt = at.AdamW(model, ps=[ps_url], token=token, run="zero-dim", lr=0.05)
    try:
        for x, y in data:
            for m, o in ((ref, ref_opt), (model, opt)):
                o.zero_grad()
                nn.functional.cross_entropy(m(x), y).backward()
                o.step()
        assert model.temp.shape == () and opt.model_state_dict()["temp"].shape == ()
        assert model.temp.item() != 1.5
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            assert (p.detach() - q.detach()).abs().max() <= 1e-5
    finally:
        opt.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("edit", ["clip", "replace"])
def test_a_grad_changed_after_backward_is_what_is_pushed(
    ps_url: str, token: str, edit: str
) -> None:
    """clip_grad_norm_ after backward (or a .grad replaced) with act/err on (the default): the
    Linear weights pushed their captured rows, the unclipped gradient, and the servers' values
    left torch's silently (0.006 after 10 AdamW steps in an outside user's script)."""

    def change(m: nn.Module) -> None:
        if edit == "clip":
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)
        else:
            m[2].weight.grad = m[2].weight.grad * 0.1  # type: ignore[index]

    data = batches(15)
    ref = make_model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    model = make_model()
    opt = at.SGD(model, ps=[ps_url], token=token, run=f"edited-{edit}", lr=LR)
    try:
        for x, y in data:
            for m, o in ((ref, ref_opt), (model, opt)):
                o.zero_grad()
                nn.functional.cross_entropy(m(x), y).backward()
                change(m)
                o.step()
        for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            assert (p.detach() - q.detach()).abs().max() <= 1e-5, name
    finally:
        opt.close()
