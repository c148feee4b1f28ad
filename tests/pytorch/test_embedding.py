"""adamps.torch.Embedding / EmbeddingBag (issue 23) against plain PyTorch on a real `adamps ps`:
after 100 steps the servers' rows (and the dense weights) equal ``torch.nn.EmbeddingBag(
sparse=True)`` / ``nn.Embedding(sparse=True)`` trained by ``torch.optim.SGD`` (or ``Adagrad``)
on the same batches, within 1e-5, in a loop of one's own, under ``DownpourOptimizer`` and under
``Replica.fit``; one pull_rows and one push_rows per step."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="adamps.torch needs torch")
pytestmark = pytest.mark.slow  # a real `adamps ps` process
from torch import nn  # noqa: E402

import adamps.torch as at  # noqa: E402
from adamps.client.ps import PSClient, StaticRouting  # noqa: E402
from adamps.client.rpc import get_json  # noqa: E402
from adamps.layout import Layout  # noqa: E402
from adamps.tables import initial_rows, normalize_row_init  # noqa: E402

STEPS, BATCH, BAG, N_IDS, DIM, LR = 100, 8, 5, 300, 6, 0.05
INIT = {"kind": "normal", "std": 0.5, "seed": 7}


def bags(n: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Zipf-ish ids (many duplicates within a batch) and regression targets."""
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(n):
        ids = (torch.rand(BATCH, BAG, generator=g) ** 3 * N_IDS).long()
        out.append((ids, torch.randn(BATCH, 2, generator=g)))
    return out


def init_weight() -> torch.Tensor:
    """The rows the servers create for ids 0 .. N_IDS - 1 (a function of (seed, id))."""
    return torch.from_numpy(initial_rows(normalize_row_init(INIT), np.arange(N_IDS), DIM))


def client_for(ps_url: str, token: str) -> PSClient:
    n = int(get_json(ps_url, "/status")["n_buckets"])
    return PSClient(StaticRouting([ps_url], n), Layout([], n_buckets=n), token)


class Counting:
    """A PSClient's row calls counted (the module must pull once and push once per step)."""

    def __init__(self, client: PSClient) -> None:
        self.client = client
        self.tables = client.tables
        self.pulls = self.pushes = 0

    def create_table(self, *a, **k):  # type: ignore[no-untyped-def]
        return self.client.create_table(*a, **k)

    def pull_rows(self, table, ids):  # type: ignore[no-untyped-def]
        self.pulls += 1
        return self.client.pull_rows(table, ids)

    def push_rows(self, table, ids, grads):  # type: ignore[no-untyped-def]
        self.pushes += 1
        return self.client.push_rows(table, ids, grads)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_embedding_bag_equals_torch_sparse(ps_url: str, token: str, optimizer: str) -> None:
    """Own loop, no Downpour: the rows equal torch's EmbeddingBag(sparse=True) + SGD/Adagrad
    (the servers' adagrad is torch's rule, per element of each pushed row)."""
    data = bags()
    proj = torch.randn(DIM, 2, generator=torch.Generator().manual_seed(5))
    ref = nn.EmbeddingBag(N_IDS, DIM, mode="sum", sparse=True)
    with torch.no_grad():
        ref.weight.copy_(init_weight())
    if optimizer == "sgd":
        opt = torch.optim.SGD(ref.parameters(), lr=LR)
    else:
        opt = torch.optim.Adagrad(ref.parameters(), lr=LR, initial_accumulator_value=0.1)
    # torch's sparse Adagrad builds COO tensors: say the invariant checks are off (else a
    # UserWarning, an error under this suite's warnings policy)
    with torch.sparse.check_sparse_tensor_invariants(enable=False):
        for ids, y in data:
            opt.zero_grad()
            nn.functional.mse_loss(ref(ids) @ proj, y).backward()
            opt.step()

    client = client_for(ps_url, token)
    counting = Counting(client)
    emb = at.EmbeddingBag(None, DIM, mode="sum", table=f"bag-{optimizer}", optimizer=optimizer,
                          lr=LR, init=INIT, adagrad_initial=0.1, client=counting)  # fmt: skip
    first = None
    for ids, y in data:
        out = emb(ids)
        if first is None:  # before any push: the initial rows, as torch's
            first = out.detach()
            assert torch.allclose(
                first, nn.functional.embedding_bag(ids, init_weight(), mode="sum")
            )
        nn.functional.mse_loss(out @ proj, y).backward()
    assert counting.pulls == STEPS and counting.pushes == STEPS
    got = torch.from_numpy(client.pull_rows(emb.server_table, np.arange(N_IDS)))
    client.close()
    diff = (got - ref.weight.detach()).abs().max()
    assert diff <= 1e-5, diff
    assert (got - init_weight()).abs().max() > 1e-2  # trained, not a stale copy


class Net(nn.Module):
    def __init__(self, emb: nn.Module) -> None:
        super().__init__()
        self.emb = emb
        torch.manual_seed(11)
        self.head = nn.Linear(BAG * DIM, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids).reshape(len(ids), -1))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["downpour", "replica"])
def test_embedding_in_downpour_equals_torch(ps_url: str, token: str, how: str) -> None:
    """Embedding + a Linear head under DownpourOptimizer (own loop) and Replica.fit (the
    gradients by torch.autograd.grad): rows and weights equal torch's after 100 steps."""
    data = bags()
    ref = Net(nn.Embedding(N_IDS, DIM, sparse=True))
    with torch.no_grad():
        ref.emb.weight.copy_(init_weight())
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    for ids, y in data:
        opt.zero_grad()
        nn.functional.mse_loss(ref(ids), y).backward()
        opt.step()

    emb = at.Embedding(None, DIM, table="items", lr=LR, init=INIT)
    model = Net(emb)
    run = f"emb-{how}"
    if how == "downpour":
        dp = at.DownpourOptimizer(model, ps=[ps_url], lr=LR, run=run, token=token)
        for ids, y in data:
            dp.zero_grad()
            nn.functional.mse_loss(model(ids), y).backward()
            dp.step()
        server = dp.model_state_dict()
        dp.close()
    else:
        rep = at.Replica(model, nn.functional.mse_loss, ps=[ps_url], lr=LR, run=run, token=token)
        rep.fit(data)
        server = rep.state_dict()
        rep.close()
    assert emb.server_table == f"{run}..items"
    client = client_for(ps_url, token)
    client.tables[emb.server_table] = DIM
    rows = torch.from_numpy(client.pull_rows(emb.server_table, np.arange(N_IDS)))
    client.close()
    assert (rows - ref.emb.weight.detach()).abs().max() <= 1e-5
    for k in ("head.weight", "head.bias"):
        assert (server[k] - ref.state_dict()[k]).abs().max() <= 1e-5, k
    assert "emb.weight" not in server  # the rows are the table's, not a dense tensor


def test_refused_arguments() -> None:
    with pytest.raises(at.ModelError, match="scale_grad_by_freq"):
        at.Embedding(10, 4, table="t", scale_grad_by_freq=True)
    with pytest.raises(at.ModelError, match="padding_idx 10 must be within"):
        at.Embedding(10, 4, table="t", padding_idx=10)
    with pytest.raises(at.ModelError, match="give num_embeddings"):
        at.EmbeddingBag(None, 4, table="t", padding_idx=-1)
    with pytest.raises(at.ModelError, match="max_norm"):
        at.Embedding(10, 4, table="t", max_norm=0)
    assert at.Embedding(10, 4, -1, table="t").padding_idx == 9  # torch's: from the end
    with pytest.raises(at.ModelError, match="mode"):
        at.EmbeddingBag(10, 4, mode="median", table="t")
    emb = at.Embedding(10, 4, table="t")
    with pytest.raises(RuntimeError, match="not bound"):
        emb(torch.tensor([1]))
    with pytest.raises(IndexError, match="out of range"):
        emb(torch.tensor([10]))
    with pytest.raises(TypeError, match="LongTensor"):
        emb(torch.tensor([1.0]))


@pytest.mark.timeout(240)
def test_torch_ctr_example_runs(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """examples/torch_ctr.py, as docs/training.md runs it (shortened): 2 replicas on a local
    cluster learn the planted click-through workload."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "TMPDIR": str(tmp_path)}
    out = subprocess.run(
        [sys.executable, str(root / "examples" / "torch_ctr.py"), "--local", "--replicas", "2",
         "--examples", "16384", "--test", "20000"],
        env=env, capture_output=True, text=True, timeout=220,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["examples"] == 2 * 16384
    assert res["loss_last"] < res["loss_first"]
    assert res["auc"] > 0.68, res  # chance is 0.5; 0.73 after 20,000 examples per replica
    # progress while it runs (issue 37: nothing was printed until the end), and its cluster's
    # directory (60-117 MB) removed at the end
    assert "cluster ready" in out.stdout and "replica 1: step 32/32" in out.stdout, out.stdout
    assert not list(tmp_path.glob("adamps-torch-ctr-*")), list(tmp_path.iterdir())


@pytest.mark.timeout(120)
def test_a_modules_admission_reaches_the_servers_table(ps_url: str, token: str) -> None:
    """`admission=` (row limit, filter, expiry) goes to `create_table`: a run with a table_rows
    quota needs `max_rows`, and the modules had no way to give it (an outside tester's model
    could not be built)."""
    client = client_for(ps_url, token)
    try:
        bag = at.EmbeddingBag(None, DIM, table="adm", admission={"max_rows": 50}, mode="sum")
        bag.bind(client)
        tables = client._rpc(ps_url).call("list_tables")["tables"]
        mine = [t for t in tables if t["name"].endswith("..adm")]
        assert mine and mine[0]["admission"]["max_rows"] == 50, tables
    finally:
        client.close()
    with pytest.raises(at.ModelError, match="admission"):
        at.Embedding(None, DIM, table="t", admission=50)


@pytest.mark.timeout(120)
def test_a_step_with_rows_is_one_request_per_server(ps_url: str, token: str) -> None:
    """Issue 36: DownpourOptimizer.step() sends the rows' gradients in the step's round with the
    head's gradients (PSClient.round): one request to the one server, not a push_rows beside
    the dense push (two, before). The forward's pull_rows and the fetch are their own."""
    data = bags()[:5]
    emb = at.Embedding(None, DIM, table="items", lr=LR, init=INIT)
    model = Net(emb)
    dp = at.DownpourOptimizer(model, ps=[ps_url], lr=LR, run="emb-round", token=token, n_fetch=1000)
    client = dp.conn.remote.client
    sent = []
    for ids, y in data:
        dp.zero_grad()
        nn.functional.mse_loss(model(ids), y).backward()
        before = client.dp_requests + client.http_requests
        dp.step()
        sent.append(client.dp_requests + client.http_requests - before)
    dp.close()
    assert sent == [1] * len(data), sent


class FM(nn.Module):
    """A factorization machine over two tables that see the same ids: per-id weights (an
    EmbeddingBag summing them) and factors (an Embedding), the click-through model of
    benchmarks/practitioner.py."""

    def __init__(self, w: nn.Module, v: nn.Module) -> None:
        super().__init__()
        self.w, self.v = w, v
        self.bias = nn.Parameter(torch.zeros(1))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        v = self.v(ids)
        s = v.sum(1)
        return self.bias + self.w(ids).squeeze(1) + 0.5 * ((s * s).sum(1) - (v * v).sum((1, 2)))


@pytest.mark.timeout(120)
def test_two_tables_of_one_step_equal_torchs_sparse_adagrad(ps_url: str, token: str) -> None:
    """Both tables of a step ride its one round (and the bias too): after the steps, each
    table's rows and the bias equal torch.optim.Adagrad's on nn.EmbeddingBag/nn.Embedding with
    sparse gradients."""
    data = [(ids, (y[:, 0] > 0).float()) for ids, y in bags(40)]
    w_init = {"kind": "zeros"}
    ref = FM(
        nn.EmbeddingBag(N_IDS, 1, mode="sum", sparse=True), nn.Embedding(N_IDS, DIM, sparse=True)
    )
    with torch.no_grad():
        ref.w.weight.zero_()
        ref.v.weight.copy_(init_weight())
    opt = torch.optim.Adagrad(ref.parameters(), lr=LR)
    with torch.sparse.check_sparse_tensor_invariants(enable=False):  # torch's sparse Adagrad
        for ids, y in data:
            opt.zero_grad()
            nn.functional.binary_cross_entropy_with_logits(ref(ids), y).backward()
            opt.step()

    kw = {"optimizer": "adagrad", "lr": LR}
    model = FM(
        at.EmbeddingBag(None, 1, mode="sum", table="w", init=w_init, **kw),
        at.Embedding(None, DIM, table="v", init=INIT, **kw),
    )
    dp = at.DownpourOptimizer(model, ps=[ps_url], run="fm", token=token, **kw)
    for ids, y in data:
        dp.zero_grad()
        nn.functional.binary_cross_entropy_with_logits(model(ids), y).backward()
        dp.step()
    server = dp.model_state_dict()
    dp.close()
    client = client_for(ps_url, token)
    client.tables.update({"fm..w": 1, "fm..v": DIM})
    got_w = torch.from_numpy(client.pull_rows("fm..w", np.arange(N_IDS)))
    got_v = torch.from_numpy(client.pull_rows("fm..v", np.arange(N_IDS)))
    client.close()
    assert (got_w - ref.w.weight.detach()).abs().max() <= 1e-5
    assert (got_v - ref.v.weight.detach()).abs().max() <= 1e-5
    assert (server["bias"] - ref.bias.detach()).abs().max() <= 1e-5


@pytest.mark.timeout(120)
@pytest.mark.parametrize("row_dtype", [torch.float16, "bfloat16"])
def test_a_16_bit_table_trains_as_torch_rounding_its_weight_each_step(
    ps_url: str, token: str, row_dtype: object
) -> None:
    """``row_dtype`` (issue 38): the servers store the rows in 16 bits; each step is float32,
    rounded back. Equal, within the type's precision, to torch's EmbeddingBag + SGD whose
    weight is rounded to that type after every step; the module's output stays float32."""
    t16 = torch.float16 if row_dtype is torch.float16 else torch.bfloat16
    data = bags(30)
    proj = torch.randn(DIM, 2, generator=torch.Generator().manual_seed(5))
    ref = nn.EmbeddingBag(N_IDS, DIM, mode="sum", sparse=True)
    with torch.no_grad():
        ref.weight.copy_(init_weight().to(t16).float())
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    for ids, y in data:
        opt.zero_grad()
        nn.functional.mse_loss(ref(ids) @ proj, y).backward()
        opt.step()
        with torch.no_grad():
            ref.weight.copy_(ref.weight.to(t16).float())
    client = client_for(ps_url, token)
    emb = at.EmbeddingBag(None, DIM, mode="sum", table=f"half-{t16}", lr=LR, init=INIT,
                          row_dtype=row_dtype, client=client)  # fmt: skip
    for ids, y in data:
        out = emb(ids)
        assert out.dtype == torch.float32
        nn.functional.mse_loss(out @ proj, y).backward()
    got = torch.from_numpy(client.pull_rows(emb.server_table, np.arange(N_IDS)))
    mine = [t for t in client._rpc(ps_url).call("list_tables")["tables"]
            if t["name"] == emb.server_table]  # fmt: skip
    client.close()
    assert mine[0]["dtype"] == str(t16).removeprefix("torch.")
    assert torch.equal(got, got.to(t16).float())  # every value is a 16-bit one
    tol = 2.0**-8 if t16 is torch.bfloat16 else 2.0**-11
    diff = (got - ref.weight.detach()).abs().max()
    assert diff <= 8 * tol * ref.weight.abs().max(), diff
    with pytest.raises(at.ModelError, match="row_dtype must be float32, float16 or bfloat16"):
        at.Embedding(None, DIM, table="t", row_dtype="int8")
