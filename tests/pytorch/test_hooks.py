"""The act/err capture (adamps/torch/hooks.py), without servers: for every nn.Linear weight the
captured rows give exactly autograd's weight gradient, e.T @ a, also for a layer called twice in
one pass and for sequence inputs; evaluation passes and other threads' rows are not mixed in."""

from __future__ import annotations

import threading

import pytest

torch = pytest.importorskip("torch", reason="adamps.torch needs torch")
from torch import nn  # noqa: E402

from adamps.client.round import use_act_err  # noqa: E402
from adamps.torch.hooks import ActErrCapture  # noqa: E402
from adamps.torch.params import linear_weights, model_params  # noqa: E402


class Shared(nn.Module):
    """One linear layer applied twice (a recurrent step), over a [b, t, n] sequence."""

    def __init__(self) -> None:
        super().__init__()
        self.step = nn.Linear(8, 8)
        self.emb = nn.Embedding(5, 8)
        self.head = nn.Linear(8, 3)
        self.head.weight = nn.Parameter(torch.randn(3, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.step(x))
        h = torch.tanh(self.step(h))
        return self.head(h).mean(1)


def test_rows_give_the_weight_gradient() -> None:
    torch.manual_seed(0)
    m = Shared()
    params = model_params(m, "r")
    layers = linear_weights(m, params)
    assert set(layers) == {"r..step.weight", "r..head.weight"}  # not the embedding
    cap = ActErrCapture(layers)
    with torch.no_grad():
        m(torch.randn(2, 4, 8))  # evaluation: nothing recorded
    m(torch.randn(2, 4, 8))  # a forward without backward: dropped at take()
    cap.take()
    x = torch.randn(3, 4, 8)
    nn.functional.cross_entropy(m(x), torch.tensor([0, 1, 2])).backward()
    rows = cap.take()
    for name, mod in (("r..step.weight", m.step), ("r..head.weight", m.head)):
        a, e = rows[name]
        assert a.shape[0] == e.shape[0] == (24 if name == "r..step.weight" else 12)
        assert torch.allclose(torch.from_numpy(e.T @ a), mod.weight.grad, atol=1e-6)
    assert cap.take() == {}

    # rows recorded in another thread stay there
    seen: dict = {}

    def other() -> None:
        nn.functional.cross_entropy(m(x), torch.tensor([0, 1, 2])).backward()
        seen.update(cap.take())

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert set(seen) == set(layers) and cap.take() == {}
    cap.remove()


def test_act_err_rule() -> None:
    assert use_act_err(64, 128, 512)  # 64 * 640 < 65,536
    assert not use_act_err(103, 128, 512)
    assert not use_act_err(32, 10, 128)  # the head: 32 * 138 > 1,280


def test_both_engines_share_the_round_clients_act_err_rule() -> None:
    """Issue 36: the rule exists once, in adamps/client/round.py, for both engines."""
    import adamps.torch.downpour as torch_downpour
    import trainer.packing as packing

    assert packing.use_vectors is use_act_err
    assert torch_downpour.use_act_err is use_act_err
