"""Models a practitioner brings, against plain torch.optim with one replica (the defaults
`n_push = n_fetch = 1`): each must train to torch's values step for step, or be refused with a
message naming the problem, never crash deep inside a step.

- a convolutional model in ``channels_last`` memory format (its conv weights are not
  row-major in memory): the values the servers hold reach the parameters, and the gradients
  the servers, in the tensor's logical order;
- an ``nn.Embedding(sparse=True)`` under SGD and Adagrad (torch.optim's take its sparse
  gradient): pushed as its dense equivalent;
- linear layers whose activation/error rows are not their weight's gradient (a penalty on the
  weight in the loss, ``autograd.grad`` before ``backward``, a gradient penalty) push their
  ``.grad``; an ordinary loss, also under autocast, still pushes rows;
- a linear layer frozen (``requires_grad_(False)``) before the optimizer is made, then
  unfrozen: the constructor stopped with torch's 'cannot register a hook on a tensor that
  doesn't require gradient'; now it trains as torch's AdamW with ``add_param_group``;
- torch.optim's implementation flags (``foreach``, ``fused``) taken, ``maximize`` refused.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="adamps.torch needs torch")
from torch import nn  # noqa: E402

import adamps.torch as at  # noqa: E402

STEPS = 12


def max_diff(a: nn.Module, b: nn.Module) -> float:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    return max((sa[k].double() - sb[k].double()).abs().max().item() for k in sa)


def step_both(ref: nn.Module, want: Any, model: nn.Module, opt: Any, x: Any, y: Any) -> None:
    """One step of the same batch, plain torch (ref, want) beside adamps (model, opt)."""
    for m, o in ((ref, want), (model, opt)):
        o.zero_grad()
        nn.functional.cross_entropy(m(x), y).backward()
        o.step()


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 4, 3, padding=1)
        self.fc = nn.Linear(4 * 6 * 6, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.conv2(torch.relu(self.conv(x)))).flatten(1))


@pytest.mark.slow  # a real `adamps ps` process
@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_a_channels_last_model_trains_like_torch(ps_url: str, token: str, kind: str) -> None:
    torch.manual_seed(0)
    ref = ConvNet().to(memory_format=torch.channels_last)
    model = copy.deepcopy(ref)
    assert not model.conv.weight.is_contiguous()  # the case: a conv weight in NHWC order
    cls, ours, kw = {
        "sgd": (torch.optim.SGD, at.SGD, {"lr": 0.1, "momentum": 0.9}),
        "adam": (torch.optim.Adam, at.Adam, {"lr": 0.01}),
    }[kind]
    want = cls(ref.parameters(), **kw)
    opt = ours(model.parameters(), model=model, ps=[ps_url], run=f"nhwc-{kind}", token=token, **kw)
    g = torch.Generator().manual_seed(1)
    for step in range(STEPS):
        x = torch.randn(4, 3, 6, 6, generator=g).to(memory_format=torch.channels_last)
        y = torch.randint(0, 5, (4,), generator=g)
        step_both(ref, want, model, opt, x, y)
        assert max_diff(ref, model) < 1e-6, (step, max_diff(ref, model))
    # the model keeps its memory format, and holds the servers' values
    assert model.conv.weight.is_contiguous(memory_format=torch.channels_last)
    server = opt.model_state_dict()
    opt.close()
    for k, v in model.state_dict().items():
        assert torch.equal(server[k], v), k


class SparseBag(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(30, 4, sparse=True)
        self.head = nn.Linear(12, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids).flatten(1))


@pytest.mark.slow  # a real `adamps ps` process
@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", ["sgd", "adagrad"])
@pytest.mark.filterwarnings("ignore:Sparse invariant checks")  # torch's Adagrad, on the reference
def test_a_sparse_nn_embedding_trains_like_torch(ps_url: str, token: str, kind: str) -> None:
    """torch.optim.SGD and Adagrad take an ``nn.Embedding(sparse=True)``'s sparse gradient; the
    same model under adamps's SGD and Adagrad reaches the same values (it stopped in the step
    with 'reshape is not implemented for sparse tensors')."""
    torch.manual_seed(0)
    ref = SparseBag()
    model = copy.deepcopy(ref)
    cls, ours, kw = {
        "sgd": (torch.optim.SGD, at.SGD, {"lr": 0.5, "momentum": 0.9}),
        "adagrad": (torch.optim.Adagrad, at.Adagrad, {"lr": 0.1}),
    }[kind]
    want = cls(ref.parameters(), **kw)
    opt = ours(
        model.parameters(), model=model, ps=[ps_url], run=f"sparse-{kind}", token=token, **kw
    )
    g = torch.Generator().manual_seed(1)
    for step in range(STEPS):
        ids = torch.randint(0, 30, (5, 3), generator=g)
        y = torch.randint(0, 2, (5,), generator=g)
        for m, o in ((ref, want), (model, opt)):
            o.zero_grad()
            nn.functional.cross_entropy(m(ids), y).backward()
            assert m.emb.weight.grad.is_sparse
            o.step()
        assert max_diff(ref, model) < 1e-6, (step, max_diff(ref, model))
    opt.close()


class Mlp(nn.Module):
    """Its 64 x 32 and 64 x 64 weights push activation and error rows at batch 4."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.out = nn.Linear(32, 64), nn.Linear(64, 64), nn.Linear(64, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def loss_of(case: str, m: Mlp, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The loss of one step, after whatever the case computes before it."""
    if case == "l2 in the loss":  # weight decay written into the loss
        ce = nn.functional.cross_entropy(m(x), y)
        return ce + 1e-3 * sum(p.pow(2).sum() for p in m.parameters())
    if case == "orthogonality penalty":  # a penalty on one weight only
        w = m.fc2.weight
        return nn.functional.cross_entropy(m(x), y) + 1e-2 * (w @ w.T - torch.eye(64)).pow(2).sum()
    if case == "saliency first":  # the inputs' gradient before backward: errors, no accumulation
        xx = x.clone().requires_grad_()
        loss = nn.functional.cross_entropy(m(xx), y)
        torch.autograd.grad(loss, xx, retain_graph=True)
        return loss
    if case == "gradient penalty":  # create_graph: second-order terms reach the weights
        xx = x.clone().requires_grad_()
        loss = nn.functional.cross_entropy(m(xx), y)
        (gx,) = torch.autograd.grad(loss, xx, create_graph=True)
        return loss + gx.pow(2).sum()
    if case == "bfloat16 autocast":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return nn.functional.cross_entropy(m(x), y)
    return nn.functional.cross_entropy(m(x), y)


ROWS_WRONG = [
    "l2 in the loss", "orthogonality penalty", "saliency first", "gradient penalty", "no zero_grad"
]  # fmt: skip


@pytest.mark.slow  # a real `adamps ps` process
@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", [*ROWS_WRONG, "plain", "bfloat16 autocast"])
def test_a_linear_layer_pushes_its_rows_only_when_they_are_its_gradient(
    ps_url: str, token: str, case: str
) -> None:
    """The activation/error rows are the weight's gradient only when the loss reaches the
    weight through the layer's outputs alone. A penalty on the weight in the loss, an
    ``autograd.grad`` to the inputs before ``backward``, a gradient penalty and a loop that
    never calls ``zero_grad`` each made the servers apply ``e.T @ a`` instead of ``.grad``: values off torch's by 3e-4 to 2e-2 after 8
    steps, silently. Now such a layer pushes its gradient, and an ordinary loss (also under
    autocast) still pushes rows."""
    torch.manual_seed(0)
    ref = Mlp()
    model = copy.deepcopy(ref)
    want = torch.optim.SGD(ref.parameters(), lr=0.1)
    run = "rows-" + case.replace(" ", "-")
    opt = at.SGD(model.parameters(), model=model, ps=[ps_url], run=run, token=token, lr=0.1)
    g = torch.Generator().manual_seed(1)
    steps = 8
    for step in range(steps):
        x, y = torch.randn(4, 32, generator=g), torch.randint(0, 3, (4,), generator=g)
        for m, o in ((ref, want), (model, opt)):
            if case != "no zero_grad" or step == 0:  # (then .grad sums every step's: torch's)
                o.zero_grad()
            loss_of(case, m, x, y).backward()
            o.step()
        tol = 1e-6 if case != "bfloat16 autocast" else 1e-3  # (rows: float32; .grad: rounded)
        assert max_diff(ref, model) < tol, (step, max_diff(ref, model))
    stats = opt.stats()
    opt.close()
    if case in ROWS_WRONG:
        assert stats["rows_disagreed"] >= steps, stats  # at least one layer each step
    else:
        assert stats["rows_disagreed"] == 0, stats
        assert stats["forms"]["fc"] == 2 * steps, stats  # fc1 and fc2 pushed rows every step


@pytest.mark.slow  # a real `adamps ps` process
@pytest.mark.timeout(180)
def test_unfreezing_a_group_given_at_construction_is_torchs_add_param_group(
    ps_url: str, token: str
) -> None:
    """docs/training.md: ``add_param_group`` after construction is refused (ModelError); a
    frozen group given at construction, unfrozen later with its lr set, trains as torch's
    AdamW with the group added at that step."""
    torch.manual_seed(0)
    ref = Mlp()
    model = copy.deepcopy(ref)
    for m in (ref, model):
        m.fc1.requires_grad_(False)
    body = lambda m: [p for n, p in m.named_parameters() if not n.startswith("fc1")]  # noqa: E731
    want = torch.optim.AdamW(body(ref), lr=1e-2)
    groups = [{"params": body(model)}, {"params": model.fc1.parameters(), "lr": 0.0}]
    opt = at.AdamW(groups, model=model, ps=[ps_url], run="unfreeze", token=token, lr=1e-2)
    with pytest.raises(at.ModelError, match="takes its param groups when it is made"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(2))]})
    g = torch.Generator().manual_seed(1)
    for step in range(10):
        if step == 5:
            for m in (ref, model):
                m.fc1.requires_grad_(True)
            want.add_param_group({"params": ref.fc1.parameters(), "lr": 3e-3})
            opt.param_groups[1]["lr"] = 3e-3
        x, y = torch.randn(4, 32, generator=g), torch.randint(0, 3, (4,), generator=g)
        step_both(ref, want, model, opt, x, y)
        assert max_diff(ref, model) < 1e-6, (step, max_diff(ref, model))
    opt.close()


@pytest.mark.slow  # a real `adamps ps` process
@pytest.mark.timeout(180)
def test_torchs_implementation_flags_are_taken(ps_url: str, token: str) -> None:
    """A script ported from ``torch.optim.AdamW(..., foreach=True)`` or ``fused=True`` keeps
    them (they choose torch's kernels, not the rule: the servers apply it); they were a
    TypeError 'unknown hyperparameter(s)'. ``maximize=True`` and ``capturable=True`` would
    change what is computed or where: refused, naming the flag."""
    torch.manual_seed(0)
    ref = Mlp()
    model = copy.deepcopy(ref)
    want = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=True)
    kw = {"ps": [ps_url], "token": token, "lr": 1e-2}
    for flag, why in (("maximize", "minimize the negated loss"), ("capturable", "CUDA graphs")):
        with pytest.raises(at.ModelError, match=f"{flag}=True is not supported.*{why}"):
            at.AdamW(model.parameters(), model=model, run="flags", **{flag: True}, **kw)
    opt = at.AdamW(model.parameters(), model=model, run="flags", foreach=True, fused=False, **kw)
    g = torch.Generator().manual_seed(1)
    for step in range(5):
        x, y = torch.randn(4, 32, generator=g), torch.randint(0, 3, (4,), generator=g)
        step_both(ref, want, model, opt, x, y)
        assert max_diff(ref, model) < 1e-6, (step, max_diff(ref, model))
    opt.close()
