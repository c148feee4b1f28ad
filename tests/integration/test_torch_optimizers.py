"""The torch-named server optimizers end to end through a real parameter server (in-process on
loopback, its LMDB on disk): 100 gradients pushed over /rpc, the values pulled and compared with
torch.optim applying the same gradients (within 1e-6), with a restart from LMDB half way, so the
optimizer state (its arrays and step count) is flushed and reloaded on the way; the same for
table rows (torch's Adagrad per element, the row-wise Adagrad per row, sparse_adam against
torch's SparseAdam per row); bad definitions are 4xx."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from adamps.client.rpc import AsyncRpc, RpcError
from adamps.server.api.app import ParameterServer
from adamps.server.config import PsConfig
from adamps.tables import initial_rows, normalize_row_init
from adamps.up.procs import free_port
from adamps.wire import web as aweb

torch = pytest.importorskip("torch")

TOKEN = "optim-test-token"
STEPS = 100
TOL = 1e-6
ROW_INIT = {"kind": "normal", "std": 0.1, "seed": 3}

#: (adamps definition, torch.optim class and kwargs): each kind with its options
CASES = [
    ({"kind": "sgd", "lr": 0.01, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01},
     "SGD", {"lr": 0.01, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}),
    ({"kind": "sgd", "lr": 0.01, "momentum": 0.5, "dampening": 0.2},
     "SGD", {"lr": 0.01, "momentum": 0.5, "dampening": 0.2}),
    ({"kind": "adagrad", "lr": 0.02}, "Adagrad", {"lr": 0.02}),
    ({"kind": "adagrad", "lr": 0.02, "lr_decay": 0.01, "weight_decay": 0.01},
     "Adagrad", {"lr": 0.02, "lr_decay": 0.01, "weight_decay": 0.01}),
    ({"kind": "adam", "lr": 0.01, "amsgrad": True, "weight_decay": 0.01},
     "Adam", {"lr": 0.01, "amsgrad": True, "weight_decay": 0.01}),
    ({"kind": "adamw", "lr": 0.01, "betas": [0.8, 0.99]}, "AdamW", {"lr": 0.01, "betas": (0.8, 0.99)}),
    ({"kind": "rmsprop", "lr": 0.005, "momentum": 0.5, "centered": True},
     "RMSprop", {"lr": 0.005, "momentum": 0.5, "centered": True}),
]  # fmt: skip


async def start(tmp_path: Path) -> tuple[aweb.web.AppRunner, AsyncRpc]:
    port = free_port()
    cfg = PsConfig(
        port=port,
        token=TOKEN,
        data_dir=str(tmp_path / "ps"),
        owner_threads=2,
        flush_interval=3600,
        max_shard_elems=1000,  # the tensor below is 2 shards, each with its own step count
    )
    runner = await aweb.serve(ParameterServer(cfg).make_app(), "127.0.0.1", port)
    return runner, AsyncRpc(f"http://127.0.0.1:{port}", TOKEN)


async def restarted(tmp_path: Path, runner: aweb.web.AppRunner, c: AsyncRpc):
    """Flushes, stops and starts the server again on the same LMDB."""
    await c.call("flush")
    await c.close()
    await runner.cleanup()
    return await start(tmp_path)


def torch_steps(cls: str, kw: dict, w0: np.ndarray, grads: list[np.ndarray]) -> np.ndarray:
    p = torch.nn.Parameter(torch.from_numpy(w0.copy()))
    opt = getattr(torch.optim, cls)([p], foreach=False, **kw)
    for g in grads:
        p.grad = torch.from_numpy(g.copy())
        opt.step()
    return p.detach().numpy()


@pytest.mark.parametrize(("d", "cls", "kw"), CASES, ids=[c[0]["kind"] for c in CASES])
async def test_dense_tensor_matches_torch_across_a_restart(
    tmp_path: Path, d: dict, cls: str, kw: dict
) -> None:
    runner, c = await start(tmp_path)
    try:
        init = {"kind": "normal", "std": 0.5, "seed": 1}
        r = await c.call("create", name="w", shape=[1500], init=init, optimizer=d)
        assert r["tensor"]["optimizer"]["kind"] == d["kind"]
        w0 = (await c.call("pull", tensors=["w"]))["tensors"]["w"].copy()
        rng = np.random.default_rng(7)
        grads = [rng.normal(size=1500).astype(np.float32) for _ in range(STEPS)]
        for i, g in enumerate(grads):
            if i == STEPS // 2:
                runner, c = await restarted(tmp_path, runner, c)
            await c.call("push_dense", tensor="w", delta=g)
        got = (await c.call("pull", tensors=["w"]))["tensors"]["w"]
        np.testing.assert_allclose(got, torch_steps(cls, kw, w0, grads), rtol=TOL, atol=TOL)
        # a create repeating the definition (defaults filled in either way) is not a conflict
        again = await c.call("create", name="w", shape=[1500], init=init, optimizer=d)
        assert again["created"] is False
    finally:
        await c.close()
        await runner.cleanup()


def row_pushes(n_ids: int, dim: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(9)
    out = []
    for _ in range(STEPS):
        ids = np.sort(rng.choice(n_ids, size=int(rng.integers(1, n_ids)), replace=False))
        out.append((ids.astype(np.int64), rng.normal(size=(len(ids), dim)).astype(np.float32)))
    return out


@pytest.mark.parametrize("kind", ["adagrad", "rowwise_adagrad", "sparse_adam"])
async def test_table_rows_match_their_reference_across_a_restart(tmp_path: Path, kind: str) -> None:
    """adagrad: torch.optim.Adagrad, one step per push on the rows it carries; rowwise_adagrad:
    a per-row numpy reference (acc += mean(g*g) over the row; w -= lr * g / (sqrt(acc) + eps))."""
    n_ids, dim, lr = 20, 6, 0.05
    pushes = row_pushes(n_ids, dim)
    runner, c = await start(tmp_path)
    try:
        opt = {"kind": kind, "lr": lr}
        await c.call("create_table", name="emb", dim=dim, init=ROW_INIT, optimizer=opt)
        for i, (ids, g) in enumerate(pushes):
            if i == STEPS // 2:
                runner, c = await restarted(tmp_path, runner, c)
            await c.call("push_rows", table="emb", ids=ids, grads=g)
        got = (await c.call("pull_rows", table="emb", ids=np.arange(n_ids)))["rows"]
    finally:
        await c.close()
        await runner.cleanup()
    want = initial_rows(normalize_row_init(ROW_INIT), np.arange(n_ids), dim)
    if kind == "adagrad":
        acc = np.zeros_like(want)
        for ids, g in pushes:
            p = torch.nn.Parameter(torch.from_numpy(want[ids].copy()))
            o = torch.optim.Adagrad([p], lr=lr, foreach=False)
            o.state[p]["sum"].copy_(torch.from_numpy(acc[ids]))
            p.grad = torch.from_numpy(g.copy())
            o.step()
            want[ids] = p.detach().numpy()
            acc[ids] = o.state[p]["sum"].numpy()
    elif kind == "sparse_adam":  # torch's SparseAdam on each row's own pushes (rowoptim.py)
        for i in range(n_ids):
            emb = torch.nn.Embedding(1, dim, sparse=True)
            with torch.no_grad():
                emb.weight.copy_(torch.from_numpy(want[i : i + 1]))
            o = torch.optim.SparseAdam(emb.parameters(), lr=lr)
            for ids, g in pushes:
                if (ids == i).any():
                    o.zero_grad()
                    emb(torch.zeros(1, dtype=torch.long)).backward(torch.from_numpy(g[ids == i]))
                    o.step()
            want[i] = emb.weight.detach().numpy()[0]
    else:
        w, acc64 = want.astype(np.float64), np.zeros(n_ids)
        for ids, g in pushes:
            for i, row in zip(ids, g.astype(np.float64), strict=True):
                acc64[i] += np.mean(row * row)
                w[i] -= lr * row / (np.sqrt(acc64[i]) + 1e-8)
        want = w
    np.testing.assert_allclose(got, want, rtol=TOL, atol=TOL)


@pytest.mark.parametrize(
    ("op", "fields", "words"),
    [
        ("create", {"name": "x", "shape": [4], "optimizer": {"kind": "adam", "momentum": 0.9}},
         "unknown field(s) ['momentum'] for optimizer 'adam'"),
        ("create", {"name": "x", "shape": [4], "optimizer": {"kind": "rowwise_adagrad"}},
         "rowwise_adagrad is for tables"),
        ("create_table", {"name": "t", "dim": 4, "optimizer": {"kind": "adam"}},
         "a table's optimizer must be one of"),
    ],
)  # fmt: skip
async def test_bad_optimizers_are_a_4xx_naming_the_problem(
    tmp_path: Path, op: str, fields: dict, words: str
) -> None:
    runner, c = await start(tmp_path)
    try:
        with pytest.raises(RpcError) as e:
            await c.call(op, **fields)
        assert e.value.status == 400 and words in str(e.value)
        assert (await c.call("list"))["tensors"] == []
        assert (await c.call("list_tables"))["tables"] == []
    finally:
        await c.close()
        await runner.cleanup()
