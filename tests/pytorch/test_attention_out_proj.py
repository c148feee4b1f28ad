"""Act/err capture on a layer torch calls without its ``forward`` (issue 36 item 5):
``nn.MultiheadAttention`` applies ``out_proj.weight`` inside ``F.multi_head_attention_forward``,
so the ``nn.Linear`` forward hook never sees it. The capture records no rows for it, and the
step pushes its autograd gradient dense: 1 replica of an attention model equals
torch.optim.SGD within 1e-5 after 30 steps, against a real `adamps ps`."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="adamps.torch needs torch")
pytestmark = pytest.mark.slow  # a real `adamps ps` process
from torch import nn  # noqa: E402

import adamps.torch as at  # noqa: E402

STEPS, LR = 30, 0.05


class Attn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(8, 32)
        self.attn = nn.MultiheadAttention(32, 4, batch_first=True)
        self.head = nn.Linear(32, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        h, _ = self.attn(h, h, h, need_weights=False)
        return self.head(h.mean(1))


def data() -> list:  # type: ignore[type-arg]
    g = torch.Generator().manual_seed(2)
    return [(torch.randn(16, 12, 8, generator=g), torch.randint(0, 3, (16,), generator=g))
            for _ in range(STEPS)]  # fmt: skip


@pytest.mark.timeout(120)
def test_out_proj_trains_by_its_dense_gradient_as_torch_does(ps_url: str, token: str) -> None:
    batches = data()
    ref = Attn()
    sgd = torch.optim.SGD(ref.parameters(), lr=LR)
    for x, y in batches:
        sgd.zero_grad()
        nn.functional.cross_entropy(ref(x), y).backward()
        sgd.step()
    model = Attn()
    opt = at.DownpourOptimizer(model, ps=[ps_url], lr=LR, optimizer="sgd", run="attn",
                               token=token)  # fmt: skip
    # out_proj is an nn.Linear (hooked) whose forward torch never calls
    assert "attn..{0}attn.out_proj.weight" in opt.conn.capture.layers
    for x, y in batches:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        assert "attn..{0}attn.out_proj.weight" not in opt.conn.capture._records()
        opt.step()
    server = opt.model_state_dict()
    opt.close()
    want = ref.state_dict()
    for k, v in want.items():
        assert torch.allclose(server[k], v, atol=1e-5, rtol=0), (k, (server[k] - v).abs().max())
    assert server["attn.out_proj.weight"].ne(Attn().state_dict()["attn.out_proj.weight"]).any()
