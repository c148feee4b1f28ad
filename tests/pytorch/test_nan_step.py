"""A NaN anywhere in a torch step refuses the whole step before any server applies anything
(issue 39): the testers' ``loss.backward()`` raised ``non_finite`` after part of an embedding
table was updated (its push split over two servers, one refusing its NaN rows).

Two real parameter servers with a static bucket map, each the primary of half the buckets, so
a batch's rows and a model's shards are pushed to both.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="adamps.torch needs torch")
from torch import nn  # noqa: E402

import adamps.torch as at  # noqa: E402
from adamps.client import PSClient, StaticRouting  # noqa: E402
from adamps.client.rpc import RpcError  # noqa: E402
from adamps.layout import Layout  # noqa: E402
from adamps.tables import buckets_of  # noqa: E402
from adamps.up.procs import free_port  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

N_BUCKETS = 16
DIM = 4
IDS = torch.arange(12)


def two_servers(procs, tmp_path) -> list[str]:  # type: ignore[no-untyped-def]
    urls = []
    halves = [range(0, N_BUCKETS // 2), range(N_BUCKETS // 2, N_BUCKETS)]
    for i, buckets in enumerate(halves):
        port = free_port()
        p = procs.start(
            f"ps{i}", "ps", "--port", str(port), "--data-dir", str(tmp_path / f"ps{i}"),
            "--n-buckets", str(N_BUCKETS), "--buckets", ",".join(map(str, buckets)),
            "--max-shard-elems", "8", "--no-lmdb-sync",
        )  # fmt: skip
        p.wait_http(f"http://127.0.0.1:{port}/healthz", 60)
        urls.append(f"http://127.0.0.1:{port}")
    on = {b < N_BUCKETS // 2 for b in buckets_of(IDS.numpy(), N_BUCKETS).tolist()}
    assert on == {True, False}, "the batch's ids must span both servers"
    return urls


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = at.Embedding(None, DIM, table="items", lr=0.1)
        self.fc = nn.Linear(DIM, 6)  # 24 weights: 3 shards of 8 over the two servers
        self.scale = nn.Parameter(torch.ones(10))

    def forward(self, ids: torch.Tensor, nan_at: int | None, nan_scale: bool) -> torch.Tensor:
        out = self.fc(self.emb(ids))
        w = torch.ones(len(ids), 1)
        if nan_at is not None:
            w[nan_at] = float("nan")  # one row's gradient NaN, the other rows' finite
        s = self.scale * (float("nan") if nan_scale else 1.0)
        return (out * w).sum() + s.sum()


def server_state(opt, model) -> tuple[np.ndarray, dict[str, torch.Tensor]]:  # type: ignore[no-untyped-def]
    client = opt.conn.remote.client
    return client.pull_rows(model.emb.server_table, IDS.numpy()), opt.model_state_dict()


@pytest.mark.parametrize(
    "nan_at, nan_scale", [(3, False), (None, True)], ids=["one-row-nan", "dense-nan-only"]
)
def test_a_nan_step_changes_nothing_anywhere(procs, tmp_path, token, nan_at, nan_scale) -> None:  # type: ignore[no-untyped-def]
    urls = two_servers(procs, tmp_path)
    torch.manual_seed(0)
    model = Net()
    opt = at.DownpourOptimizer(model, ps=urls, token=token, lr=0.1)
    try:
        rows0, params0 = server_state(opt, model)
        local0 = {k: v.clone() for k, v in model.state_dict().items()}

        opt.zero_grad()
        loss = model(IDS, nan_at, nan_scale)
        assert torch.isnan(loss)
        loss.backward()  # the rows' gradients wait for the step, checked with the rest
        with pytest.raises(RpcError) as exc:
            opt.step()
        assert exc.value.code == "non_finite" and exc.value.http_status == 400
        assert "nothing was sent" in str(exc.value)

        rows1, params1 = server_state(opt, model)
        np.testing.assert_array_equal(rows1, rows0, "a table row was changed")
        for k, v in params0.items():
            assert torch.equal(params1[k], v), f"the servers' {k} was changed"
        for k, v in model.state_dict().items():
            assert torch.equal(v, local0[k]), f"the local {k} was changed"

        # the next good step goes through: rows and every parameter move
        opt.zero_grad()
        model(IDS, None, False).backward()
        opt.step()
        rows2, params2 = server_state(opt, model)
        assert not np.array_equal(rows2, rows0) and np.isfinite(rows2).all()
        assert not torch.equal(params2["fc.weight"], params0["fc.weight"])
    finally:
        opt.close()


def test_a_bound_embeddings_nan_rows_refuse_its_push_whole(procs, tmp_path, token) -> None:  # type: ignore[no-untyped-def]
    """Bound by hand (no optimizer, no step): backward pushes, and a NaN row refuses it whole."""
    urls = two_servers(procs, tmp_path)
    client = PSClient(StaticRouting(urls, N_BUCKETS), Layout([], n_buckets=N_BUCKETS), token)
    emb = at.Embedding(None, DIM, table="items", lr=0.1, client=client)
    rows0 = client.pull_rows(emb.server_table, IDS.numpy())
    w = torch.ones(len(IDS), 1)
    w[5] = float("nan")
    loss = (emb(IDS) * w).sum()
    with pytest.raises(RpcError) as exc:
        loss.backward()
    assert exc.value.code == "non_finite"
    np.testing.assert_array_equal(
        client.pull_rows(emb.server_table, IDS.numpy()), rows0, "a row was applied"
    )
    (emb(IDS) * torch.ones(len(IDS), 1)).sum().backward()  # a good one is applied whole
    after = client.pull_rows(emb.server_table, IDS.numpy())
    np.testing.assert_allclose(after, rows0 - 0.1, rtol=1e-6)
    client.close()
