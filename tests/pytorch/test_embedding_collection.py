"""EmbeddingBagCollection, padding_idx, max_norm and per-sample weights (issue 38 item 4) on
real `adamps ps` processes.

- A keyed jagged lookup equals the same tables looked up one feature at a time with
  ``adamps.torch.EmbeddingBag`` (forward at every step, the rows after training), and it costs
  one request per server per forward and per step for all its tables (two servers, each the
  primary of half the buckets).
- ``padding_idx`` and ``max_norm`` against torch's ``nn.Embedding`` / ``nn.EmbeddingBag`` on
  the same ids; the padding row is never updated on the servers.
- Per-sample weights against torch's ``per_sample_weights``.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="adamps.torch needs torch")
from torch import nn  # noqa: E402

import adamps.torch as at  # noqa: E402
from adamps.client import PSClient, StaticRouting  # noqa: E402
from adamps.client.rpc import get_json  # noqa: E402
from adamps.layout import Layout  # noqa: E402
from adamps.tables import buckets_of, initial_rows, normalize_row_init  # noqa: E402
from adamps.up.procs import free_port  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

N_BUCKETS, N_IDS, LR, B = 16, 40, 0.05, 8
C = at.EmbeddingBagConfig


def init_of(seed: int) -> dict:  # type: ignore[type-arg]
    return {"kind": "normal", "std": 0.5, "seed": seed}


def init_weight(seed: int, dim: int) -> torch.Tensor:
    """The rows the servers create for ids 0 .. N_IDS - 1 of a table with init_of(seed)."""
    return torch.from_numpy(initial_rows(normalize_row_init(init_of(seed)), np.arange(N_IDS), dim))


def two_servers(procs, tmp_path) -> list[str]:  # type: ignore[no-untyped-def]
    urls = []
    for i, buckets in enumerate([range(0, N_BUCKETS // 2), range(N_BUCKETS // 2, N_BUCKETS)]):
        port = free_port()
        p = procs.start(
            f"ps{i}", "ps", "--port", str(port), "--data-dir", str(tmp_path / f"ps{i}"),
            "--n-buckets", str(N_BUCKETS), "--buckets", ",".join(map(str, buckets)),
            "--max-shard-elems", "8", "--no-lmdb-sync",
        )  # fmt: skip
        p.wait_http(f"http://127.0.0.1:{port}/healthz", 60)
        urls.append(f"http://127.0.0.1:{port}")
    return urls


def servers_of(ids: np.ndarray) -> int:
    """How many of the two servers hold some of `ids`."""
    return len({b < N_BUCKETS // 2 for b in buckets_of(ids, N_BUCKETS).tolist()})


def touched(kjt: at.KeyedJaggedTensor) -> np.ndarray:
    """The ids whose rows a CollectionNet forward fetches: all but the user table's padding 0."""
    d = kjt.to_dict()
    uid = d["uid"].values().numpy()
    rest = [d[f].values().numpy() for f in ("item", "seen")]
    return np.unique(np.concatenate([uid[uid != 0], *rest]))


def requests(client: PSClient) -> int:
    return client.dp_requests + client.http_requests


FEATURES = ["uid", "item", "seen"]


def batches(n: int, seed: int = 3, weighted: bool = False) -> list[at.KeyedJaggedTensor]:
    """Keyed jagged batches: 0 .. 3 ids per example and feature, many duplicates and zeros."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        lengths = torch.randint(0, 4, (len(FEATURES) * B,), generator=g)
        lengths[0] = 2  # never an empty batch
        values = (torch.rand(int(lengths.sum()), generator=g) ** 2 * N_IDS).long()
        w = torch.rand(len(values), generator=g) * 2 if weighted else None
        out.append(at.KeyedJaggedTensor(FEATURES, values, weights=w, lengths=lengths))
    return out


class CollectionNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ebc = at.EmbeddingBagCollection(
            [
                C(N_IDS, 4, "user", ["uid"], padding_idx=0, init=init_of(1)),
                C(N_IDS, 6, "item", ["item", "seen"], pooling="mean", init=init_of(2)),
            ],
            lr=LR,
        )
        torch.manual_seed(11)
        self.head = nn.Linear(16, 1)

    def forward(self, kjt: at.KeyedJaggedTensor) -> torch.Tensor:
        return self.head(self.ebc(kjt).values()).squeeze(1)


class PerTableNet(nn.Module):
    """The same tables as modules of their own, looked up one feature at a time."""

    def __init__(self) -> None:
        super().__init__()
        self.user = at.EmbeddingBag(
            N_IDS, 4, mode="sum", padding_idx=0, table="user", init=init_of(1), lr=LR
        )
        self.item = at.EmbeddingBag(N_IDS, 6, mode="mean", table="item", init=init_of(2), lr=LR)
        torch.manual_seed(11)
        self.head = nn.Linear(16, 1)

    def pooled(self, kjt: at.KeyedJaggedTensor) -> torch.Tensor:
        d = kjt.to_dict()
        mods = {"uid": self.user, "item": self.item, "seen": self.item}
        return torch.cat([mods[f](d[f].values(), d[f].offsets()[:-1]) for f in FEATURES], 1)

    def forward(self, kjt: at.KeyedJaggedTensor) -> torch.Tensor:
        return self.head(self.pooled(kjt)).squeeze(1)


def test_a_keyed_lookup_equals_per_table_lookups_in_one_round_per_server(
    procs, tmp_path, token
) -> None:  # type: ignore[no-untyped-def]
    """Under DownpourOptimizer: every forward equals the per-table model's, the rows of both
    tables after the steps equal, the padding row was never updated; the collection's forward
    is one request per server holding its ids (a round fetching every table), and its step one
    request per server (the rows of both tables and the head's gradients)."""
    urls = two_servers(procs, tmp_path)
    data = batches(12)
    mine, ref = CollectionNet(), PerTableNet()
    # no fetch of the head in these steps (n_fetch): a step's requests are its round's alone
    kw = {"ps": urls, "lr": LR, "token": token, "n_fetch": 1000}
    opt = at.DownpourOptimizer(mine, run="ebc", **kw)
    ref_opt = at.DownpourOptimizer(ref, run="ref", **kw)
    client = opt.conn.remote.client
    layout = opt.conn.remote.layout
    head_buckets = set(layout.bucket_of.values())
    fwd, step, spans, step_spans = [], [], [], []
    try:
        for kjt in data:
            y = (kjt.lengths()[:B] % 2).float()
            opt.zero_grad()
            before = requests(client)
            out = mine(kjt)
            fwd.append(requests(client) - before)
            ids = touched(kjt)
            spans.append(servers_of(ids))
            on = {b < N_BUCKETS // 2 for b in [*buckets_of(ids, N_BUCKETS).tolist(), *head_buckets]}
            step_spans.append(len(on))
            nn.functional.binary_cross_entropy_with_logits(out, y).backward()
            before = requests(client)
            opt.step()
            step.append(requests(client) - before)

            ref_opt.zero_grad()
            ref_out = ref(kjt)
            nn.functional.binary_cross_entropy_with_logits(ref_out, y).backward()
            ref_opt.step()
            assert (out - ref_out).abs().max() <= 1e-5
        assert fwd == spans, (fwd, spans)  # one request per server, for all tables
        assert 2 in spans  # the batches' rows lie on both servers
        # the step: one round per server, for the rows of both tables and the head's gradients
        assert step == step_spans, (step, step_spans)
        ids = np.arange(N_IDS)
        for table, dim, seed in (("user", 4, 1), ("item", 6, 2)):
            client.tables[f"ref..{table}"] = dim
            got = client.pull_rows(f"ebc..{table}", ids)
            want = client.pull_rows(f"ref..{table}", ids)
            assert np.abs(got - want).max() <= 1e-5, table
            init = init_weight(seed, dim).numpy()
            assert np.abs(got - init).max() > 1e-3, table  # trained
        assert np.array_equal(client.pull_rows("ebc..user", [0])[0], init_weight(1, 4)[0].numpy())
    finally:
        opt.close()
        ref_opt.close()


def test_a_bound_collection_pushes_every_table_in_one_round(procs, tmp_path, token) -> None:  # type: ignore[no-untyped-def]
    """Bound by .bind(client) alone (no optimizer): backward pushes both tables' gradients in
    one round per server, and the rows equal the per-table modules' pushed one by one."""
    urls = two_servers(procs, tmp_path)
    n = int(get_json(urls[0], "/status")["n_buckets"])
    client = PSClient(StaticRouting(urls, n), Layout([], n_buckets=n), token)
    try:
        mine, ref = CollectionNet(), PerTableNet()
        mine.ebc.bind(client, "own")
        for m in (ref.user, ref.item):
            m.bind(client, "own-ref")
        back = []
        for kjt in batches(6, seed=5):
            out = mine.ebc(kjt).values()
            before = requests(client)
            (out * out).sum().backward()
            back.append(requests(client) - before)
            assert back[-1] == servers_of(touched(kjt))
            ref_out = ref.pooled(kjt)
            assert (out - ref_out).abs().max() <= 1e-5
            (ref_out * ref_out).sum().backward()
        for table in ("user", "item"):
            got = client.pull_rows(f"own..{table}", np.arange(N_IDS))
            want = client.pull_rows(f"own-ref..{table}", np.arange(N_IDS))
            assert np.abs(got - want).max() <= 1e-5, table
    finally:
        client.close()


def client_for(ps_url: str, token: str) -> PSClient:
    n = int(get_json(ps_url, "/status")["n_buckets"])
    return PSClient(StaticRouting([ps_url], n), Layout([], n_buckets=n), token)


def id_batches(n: int, seed: int = 7) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.rand(B, 5, generator=g) ** 2 * N_IDS).long() for _ in range(n)]


@pytest.mark.parametrize("kind", ["embedding", "bag-mean", "bag-sum"])
def test_padding_idx_equals_torchs(ps_url, token, kind) -> None:  # type: ignore[no-untyped-def]
    """The padding id reads as zeros, is left out of a bag's mean, gets no gradient: every
    forward and the rows after 20 SGD steps equal torch's, and the servers' padding row is its
    initial value, never updated."""
    pad = 0
    w0 = init_weight(1, 4)
    if kind == "embedding":
        ref: nn.Module = nn.Embedding(N_IDS, 4, padding_idx=pad)
        mine: nn.Module = at.Embedding(
            N_IDS, 4, padding_idx=pad, table=kind, init=init_of(1), lr=LR
        )
    else:
        mode = kind.split("-")[1]
        ref = nn.EmbeddingBag(N_IDS, 4, mode=mode, padding_idx=pad)
        mine = at.EmbeddingBag(
            N_IDS, 4, mode=mode, padding_idx=pad, table=kind, init=init_of(1), lr=LR
        )
    with torch.no_grad():
        ref.weight.copy_(w0)
        ref.weight[pad] = 0  # torch's padding row starts at zeros: what adamps reads for it
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    client = client_for(ps_url, token)
    try:
        mine.bind(client)
        data = id_batches(20)
        assert all(bool((ids == pad).any()) for ids in data[:3])
        for ids in data:
            out, want = mine(ids), ref(ids)
            assert (out - want).abs().max() <= 1e-5
            opt.zero_grad()
            (want * want).sum().backward()
            opt.step()
            (out * out).sum().backward()
        got = client.pull_rows(mine.server_table, np.arange(N_IDS))
        assert np.abs(got[1:] - ref.weight.detach().numpy()[1:]).max() <= 1e-5
        assert np.array_equal(got[pad], w0[pad].numpy())  # never updated
        assert np.abs(got[1:] - w0[1:].numpy()).max() > 1e-3  # the others trained
    finally:
        client.close()


@pytest.mark.parametrize("kind", ["embedding", "bag-mean"])
def test_max_norm_forward_and_gradient_equal_torchs(ps_url, token, kind) -> None:  # type: ignore[no-untyped-def]
    """Rows longer than max_norm are renormalized as torch renormalizes them: the forward and
    the rows' gradients equal torch's. The servers' rows keep their norm (torch writes the
    renormalized rows into its weight; docs/training.md)."""
    w0 = init_weight(1, 6)  # std 0.5, dim 6: most rows are longer than 1
    norms = w0.norm(dim=1)
    assert (norms > 1.0).sum() > 5 and (norms < 1.0).sum() > 5
    if kind == "embedding":
        ref: nn.Module = nn.Embedding(N_IDS, 6, max_norm=1.0)
        mine: nn.Module = at.Embedding(N_IDS, 6, max_norm=1.0, table=kind, init=init_of(1))
    else:
        ref = nn.EmbeddingBag(N_IDS, 6, max_norm=1.0, mode="mean")
        mine = at.EmbeddingBag(N_IDS, 6, max_norm=1.0, mode="mean", table=kind, init=init_of(1))
    with torch.no_grad():
        ref.weight.copy_(w0)
    client = client_for(ps_url, token)
    try:
        mine.bind(client, defer=True)  # the gradient kept, to compare it with torch's
        ids = id_batches(1)[0]
        out, want = mine(ids), ref(ids)
        assert (out - want).abs().max() <= 1e-6
        if kind == "embedding":
            assert out.norm(dim=-1).max() <= 1.0 + 1e-5
        proj = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
        (out * proj).sum().backward()
        (want * proj).sum().backward()
        [(u, g)] = mine.take_grads()
        assert np.abs(g.numpy() - ref.weight.grad.numpy()[u]).max() <= 1e-5
        assert not ref.weight.grad.numpy()[np.setdiff1d(np.arange(N_IDS), u)].any()
        # torch renormalized its weight in place; the servers' rows are as created
        stored = client.pull_rows(mine.server_table, u)
        assert np.array_equal(stored, w0.numpy()[u])
        assert np.abs(ref.weight.detach().numpy()[u] - stored).max() > 1e-2
    finally:
        client.close()


@pytest.mark.parametrize("how", ["collection", "bag"])
def test_per_sample_weights_equal_torchs(ps_url, token, how) -> None:  # type: ignore[no-untyped-def]
    """Weighted sum pooling (a weighted collection's batch weights; EmbeddingBag's
    per_sample_weights) equals torch's EmbeddingBag(per_sample_weights) on every forward and
    in the rows after 10 SGD steps."""
    w0 = init_weight(1, 4)
    ref = nn.EmbeddingBag(N_IDS, 4, mode="sum")
    with torch.no_grad():
        ref.weight.copy_(w0)
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    client = client_for(ps_url, token)
    try:
        if how == "collection":
            mod: nn.Module = at.EmbeddingBagCollection(
                [C(N_IDS, 4, "t", FEATURES, init=init_of(1))], is_weighted=True, lr=LR
            )
            mod.bind(client)
            table = mod.embedding_bags["t"].server_table
        else:
            mod = at.EmbeddingBag(N_IDS, 4, mode="sum", table="t", init=init_of(1), lr=LR)
            mod.bind(client)
            table = mod.server_table
        for kjt in batches(10, weighted=True):
            # torch's view of the same batch: every feature's bags, one after the other
            flat_off = kjt.offsets()[:-1]
            want = ref(kjt.values(), flat_off, per_sample_weights=kjt.weights())
            want = torch.cat(want.split(B), 1)  # [B, features * 4], the collection's layout
            if how == "collection":
                out = mod(kjt).values()
            else:
                out = mod(kjt.values(), flat_off, per_sample_weights=kjt.weights())
                out = torch.cat(out.split(B), 1)
            assert (out - want).abs().max() <= 1e-5
            opt.zero_grad()
            (want * want).sum().backward()
            opt.step()
            (out * out).sum().backward()
        got = client.pull_rows(table, np.arange(N_IDS))
        assert np.abs(got - ref.weight.detach().numpy()).max() <= 1e-5
        assert np.abs(got - w0.numpy()).max() > 1e-3
    finally:
        client.close()


@pytest.mark.timeout(240)
def test_the_docs_example_runs(ps_url, token, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """docs/training.md's EmbeddingBagCollection example, verbatim, against a real server:
    it trains (the loss of its two examples falls)."""
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "training.md").read_text()
    section = text.split("### EmbeddingBagCollection", 1)[1].split("\n### ", 1)[0]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)  # type: ignore[union-attr]
    (tmp_path / "ebc.py").write_text(code)
    env = {**os.environ, "ADAMPS_PS": ps_url, "ADAMPS_TOKEN": token, "OPENBLAS_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, str(tmp_path / "ebc.py")], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=220)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"step \d+: loss (\S+)", out.stdout)]
    assert len(losses) == 2 and losses[1] < losses[0] - 0.1, out.stdout


def test_a_collection_under_replica_trains_as_under_downpour(ps_url, token) -> None:  # type: ignore[no-untyped-def]
    """Replica.fit computes the gradients with torch.autograd.grad of the collection's one rows
    leaf (every table's): the rows after its steps equal DownpourOptimizer's on the batches."""
    data = [(kjt, (kjt.lengths()[:B] % 2).float()) for kjt in batches(10, seed=9)]
    loss = nn.functional.binary_cross_entropy_with_logits
    kw = {"ps": [ps_url], "lr": LR, "token": token}
    rep = at.Replica(CollectionNet(), loss, run="rep", **kw)
    opt = at.DownpourOptimizer(dp_model := CollectionNet(), run="dp", **kw)
    try:
        rep.fit(data)
        for kjt, y in data:
            opt.zero_grad()
            loss(dp_model(kjt), y).backward()
            opt.step()
        client = opt.conn.remote.client
        for table, dim, seed in (("user", 4, 1), ("item", 6, 2)):
            client.tables[f"rep..{table}"] = dim
            got = client.pull_rows(f"rep..{table}", np.arange(N_IDS))
            want = client.pull_rows(f"dp..{table}", np.arange(N_IDS))
            assert np.abs(got - want).max() <= 1e-5, table
            assert np.abs(got - init_weight(seed, dim).numpy()).max() > 1e-3, table
    finally:
        rep.close()
        opt.close()


@pytest.mark.timeout(120)
def test_a_configs_data_type_is_its_tables_row_storage(ps_url, token) -> None:  # type: ignore[no-untyped-def]
    """torchrec's ``data_type`` (issue 38): FP16 / "bfloat16" per table, else the collection's
    ``row_dtype``; the servers' tables say so, and a lookup reads 16-bit values as float32."""
    n = int(get_json(ps_url, "/status")["n_buckets"])
    client = PSClient(StaticRouting([ps_url], n), Layout([], n_buckets=n), token)
    fp16 = type("DataType", (), {"value": "FP16"})()  # as torchrec's enum: its value is read
    ebc = at.EmbeddingBagCollection(
        [C(N_IDS, 4, "dt_a", ["uid"], data_type=fp16), C(N_IDS, 6, "dt_b", ["item"]),
         C(N_IDS, 6, "dt_c", ["seen"], data_type="float32")],
        row_dtype="bfloat16", client=client,
    )  # fmt: skip
    try:
        held = {t["name"]: t["dtype"] for t in client._rpc(ps_url).call("list_tables")["tables"]}
        tables = {k: held[m.server_table] for k, m in ebc.embedding_bags.items()}
        assert tables["dt_a"] == "float16" and tables["dt_b"] == "bfloat16", tables
        assert tables["dt_c"] == "float32"
        out = ebc(batches(1)[0]).values()
        assert out.dtype == torch.float32 and out.shape == (B, 16)
    finally:
        client.close()
