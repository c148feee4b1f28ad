"""Models a practitioner brings, against plain torch.optim with one replica (the defaults
`n_push = n_fetch = 1`): each must train to torch's values step for step, or be refused with a
message naming the problem, never crash deep inside a step.

- a convolutional model in ``channels_last`` memory format (its conv weights are not
  row-major in memory): the values the servers hold reach the parameters, and the gradients
  the servers, in the tensor's logical order;
- an ``nn.Embedding(sparse=True)`` under SGD and Adagrad (torch.optim's take its sparse
  gradient): pushed as its dense equivalent;
"""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch", reason="adamps.torch needs torch")
from torch import nn  # noqa: E402

import adamps.torch as at  # noqa: E402

STEPS = 12


def max_diff(a: nn.Module, b: nn.Module) -> float:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    return max((sa[k].double() - sb[k].double()).abs().max().item() for k in sa)


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
        for m, o in ((ref, want), (model, opt)):
            o.zero_grad()
            nn.functional.cross_entropy(m(x), y).backward()
            o.step()
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
