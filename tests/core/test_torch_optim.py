"""The server optimizers with torch.optim's names against torch.optim itself: 100 steps of random
gradients, dense (every update form: dense deltas one by one and in batches, fc activations and
errors, compressed pushes) and on table rows (torch's Adagrad per element; the row-wise Adagrad
against a per-row numpy reference), within 1e-6. Also the definitions: torch's defaults, the
legacy Adagrad kept for old definitions, and clear errors."""

from __future__ import annotations

import numpy as np
import pytest

from adamps.server.store.tables.rowblock import ApplyStats, RowBlock, RowPush
from adamps.server.updates import optim, torchoptim
from adamps.server.updates.optim import Dense, Fc, OptimError, Optimizer, Scratch, Signs
from adamps.tables import Admission, initial_rows, normalize_row_init

torch = pytest.importorskip("torch")

STEPS = 100
TOL = 1e-6

#: (adamps definition, torch.optim class, its kwargs): every kind and its options
CASES = [
    ({"kind": "sgd", "lr": 0.05}, "SGD", {"lr": 0.05}),
    ({"kind": "sgd", "lr": 0.05, "momentum": 0.9}, "SGD", {"lr": 0.05, "momentum": 0.9}),
    (
        {"kind": "sgd", "lr": 0.05, "momentum": 0.9, "dampening": 0.3, "weight_decay": 0.01},
        "SGD",
        {"lr": 0.05, "momentum": 0.9, "dampening": 0.3, "weight_decay": 0.01},
    ),
    (
        {"kind": "sgd", "lr": 0.05, "momentum": 0.8, "nesterov": True},
        "SGD",
        {"lr": 0.05, "momentum": 0.8, "nesterov": True},
    ),
    ({"kind": "sgd", "lr": 0.05, "weight_decay": 0.1}, "SGD", {"lr": 0.05, "weight_decay": 0.1}),
    ({"kind": "adagrad", "lr": 0.02}, "Adagrad", {"lr": 0.02}),
    (
        {
            "kind": "adagrad",
            "lr": 0.02,
            "lr_decay": 0.01,
            "weight_decay": 0.05,
            "initial_accumulator_value": 0.1,
            "eps": 1e-6,
        },
        "Adagrad",
        {
            "lr": 0.02,
            "lr_decay": 0.01,
            "weight_decay": 0.05,
            "initial_accumulator_value": 0.1,
            "eps": 1e-6,
        },
    ),  # fmt: skip
    ({"kind": "adam", "lr": 0.01}, "Adam", {"lr": 0.01}),
    (
        {
            "kind": "adam",
            "lr": 0.01,
            "betas": [0.8, 0.99],
            "eps": 1e-6,
            "weight_decay": 0.01,
            "amsgrad": True,
        },
        "Adam",
        {"lr": 0.01, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.01, "amsgrad": True},
    ),  # fmt: skip
    ({"kind": "adam", "lr": 0.01, "betas": [0.3, 0.9]}, "Adam", {"lr": 0.01, "betas": (0.3, 0.9)}),
    ({"kind": "adamw", "lr": 0.01}, "AdamW", {"lr": 0.01}),
    (
        {"kind": "adamw", "lr": 0.01, "weight_decay": 0.1, "amsgrad": True},
        "AdamW",
        {"lr": 0.01, "weight_decay": 0.1, "amsgrad": True},
    ),
    ({"kind": "rmsprop", "lr": 0.01}, "RMSprop", {"lr": 0.01}),
    (
        {
            "kind": "rmsprop",
            "lr": 0.005,
            "alpha": 0.9,
            "momentum": 0.5,
            "centered": True,
            "weight_decay": 0.01,
        },
        "RMSprop",
        {"lr": 0.005, "alpha": 0.9, "momentum": 0.5, "centered": True, "weight_decay": 0.01},
    ),  # fmt: skip
]


def _torch_run(cls: str, kw: dict, w0: np.ndarray, grads: list[np.ndarray]) -> np.ndarray:
    p = torch.nn.Parameter(torch.from_numpy(w0.copy()))
    opt = getattr(torch.optim, cls)([p], foreach=False, **kw)
    for g in grads:
        p.grad = torch.from_numpy(g.reshape(w0.shape).copy())
        opt.step()
    return p.detach().numpy()


def _state(opt: Optimizer, n: int) -> np.ndarray | None:
    return optim.initial_state(opt, n) if opt.has_accumulator else None


@pytest.mark.parametrize(("d", "cls", "kw"), CASES, ids=[str(c[0]) for c in CASES])
def test_dense_matches_torch_after_100_steps(d: dict, cls: str, kw: dict) -> None:
    rng = np.random.default_rng(3)
    opt = Optimizer.from_dict(d)
    w0 = rng.normal(size=(20, 30)).astype(np.float32)
    grads = [rng.normal(size=(20, 30)).astype(np.float32) for _ in range(STEPS)]
    want = _torch_run(cls, kw, w0, grads)
    # one push per batch, and the same pushes in batches of 7: the same steps
    for batch in (1, 7):
        w, acc = w0.copy(), _state(opt, w0.size)
        scratch = Scratch(w0.size)
        for i in range(0, STEPS, batch):
            optim.apply_batch(opt, w, acc, [Dense(g) for g in grads[i : i + batch]], scratch)
        np.testing.assert_allclose(w, want, rtol=TOL, atol=TOL)
        if acc is not None and not opt.legacy_layout:
            assert torchoptim.step_count(acc) == STEPS


@pytest.mark.parametrize("kind", ["sgd", "adagrad", "adam", "rmsprop"])
def test_fc_and_compressed_pushes_are_their_dense_gradients(kind: str) -> None:
    """An fc push is the gradient e.T @ a, a compressed push the gradient +-tau on its elements
    and 0 elsewhere: torch given those dense gradients ends at the same point."""
    rng = np.random.default_rng(5)
    d = {"kind": kind, "lr": 0.01, **({"momentum": 0.9} if kind == "sgd" else {})}
    opt = Optimizer.from_dict(d)
    cls = {"sgd": "SGD", "adagrad": "Adagrad", "adam": "Adam", "rmsprop": "RMSprop"}[kind]
    w0 = rng.normal(size=(6, 10)).astype(np.float32)
    updates, grads = [], []
    for i in range(STEPS):
        if i % 2:
            a = rng.normal(size=(3, 10)).astype(np.float32)
            e = rng.normal(size=(3, 6)).astype(np.float32)
            updates.append(Fc(a, e))
            grads.append((e.T.astype(np.float64) @ a).astype(np.float32))
        else:
            idx = np.sort(rng.choice(60, size=15, replace=False)).astype(np.uint32)
            neg = rng.integers(0, 2, size=15).astype(np.uint32)
            updates.append(Signs(idx << np.uint32(1) | neg, 0.25))
            g = np.zeros(60, np.float32)
            g[idx] = np.where(neg == 1, -0.25, 0.25)
            grads.append(g)
    w, acc = w0.copy(), _state(opt, w0.size)
    optim.apply_batch(opt, w, acc, updates, Scratch(w0.size))
    # torch given the fc gradients computed in float64: the sgemm's rounding differs slightly
    kw = {k: v for k, v in d.items() if k != "kind"}
    np.testing.assert_allclose(w, _torch_run(cls, kw, w0, grads), rtol=TOL, atol=10 * TOL)


NORMAL = normalize_row_init({"kind": "normal", "std": 0.1, "seed": 7})


def _pushes(rng: np.random.Generator, n_ids: int, dim: int) -> list[tuple[np.ndarray, np.ndarray]]:
    out = []
    for _ in range(STEPS):
        ids = np.sort(rng.choice(n_ids, size=rng.integers(1, n_ids), replace=False))
        out.append((ids.astype(np.int64), rng.normal(size=(len(ids), dim)).astype(np.float32)))
    return out


def test_table_adagrad_matches_torch_per_element() -> None:
    """torch's Adagrad, one step per push on the rows it carries (a row is created at its first
    push from its initial value, with a zero accumulator), against the table's per-row step."""
    rng = np.random.default_rng(11)
    n_ids, dim = 12, 5
    pushes = _pushes(rng, n_ids, dim)
    d = {"kind": "adagrad", "lr": 0.05, "weight_decay": 0.01}
    blk = RowBlock(dim, NORMAL, Optimizer.from_dict(d), Admission(), None)
    want = initial_rows(NORMAL, np.arange(n_ids), dim)
    acc = np.zeros_like(want)
    for t, (ids, g) in enumerate(pushes):
        blk.apply(RowPush(ids, g, float(t)), ApplyStats())
        p = torch.nn.Parameter(torch.from_numpy(want[ids].copy()))
        o = torch.optim.Adagrad([p], lr=0.05, weight_decay=0.01, foreach=False)
        o.step()  # no gradient yet: creates the state, moves nothing
        o.state[p]["sum"].copy_(torch.from_numpy(acc[ids]))
        p.grad = torch.from_numpy(g.copy())
        o.step()
        want[ids] = p.detach().numpy()
        acc[ids] = o.state[p]["sum"].numpy()
    s = blk.slots(np.arange(n_ids))
    seen = s >= 0
    np.testing.assert_allclose(blk.values[s[seen]], want[seen], rtol=TOL, atol=TOL)
    np.testing.assert_allclose(blk.accum[s[seen]], acc[seen], rtol=TOL, atol=TOL)


def test_rowwise_adagrad_matches_a_per_row_reference() -> None:
    """One accumulator per row, growing by the mean of the row's squared gradient; the step is
    lr * g / (sqrt(acc) + eps) (TorchRec's and FBGEMM's row-wise Adagrad), in float64 numpy."""
    rng = np.random.default_rng(12)
    n_ids, dim = 10, 8
    pushes = _pushes(rng, n_ids, dim)
    opt = Optimizer.from_dict({"kind": "rowwise_adagrad", "lr": 0.05})
    blk = RowBlock(dim, NORMAL, opt, Admission(), None)
    assert blk.acc_width == 1
    w = initial_rows(NORMAL, np.arange(n_ids), dim).astype(np.float64)
    acc = np.zeros(n_ids)
    for t, (ids, g) in enumerate(pushes):
        blk.apply(RowPush(ids, g, float(t)), ApplyStats())
        for i, row in zip(ids, g.astype(np.float64), strict=True):
            acc[i] += np.mean(row * row)
            w[i] -= 0.05 * row / (np.sqrt(acc[i]) + 1e-8)
    s = blk.slots(np.arange(n_ids))
    seen = s >= 0
    np.testing.assert_allclose(blk.values[s[seen]], w[seen], rtol=TOL, atol=TOL)
    np.testing.assert_allclose(blk.accum[s[seen], 0], acc[seen], rtol=1e-6, atol=0)
    # its state survives the block's bytes (LMDB flushes, state transfer, checkpoints)
    copy = RowBlock(dim, NORMAL, opt, Admission(), None)
    copy.load_bytes(blk.tobytes())
    assert copy.digest() == blk.digest() and copy.accum.shape == (blk.n, 1)


def test_definitions_take_torchs_defaults_and_names() -> None:
    assert Optimizer.from_dict({"kind": "adagrad"}).to_dict() == {
        "kind": "adagrad", "lr": 0.01, "lr_decay": 0.0, "weight_decay": 0.0,
        "initial_accumulator_value": 0.0, "eps": 1e-10,
    }  # fmt: skip
    adam = Optimizer.from_dict({"kind": "adam"})
    assert adam.lr == 1e-3 and adam.betas == (0.9, 0.999) and adam.eps == 1e-8
    assert Optimizer.from_dict({"kind": "adamw"}).weight_decay == 1e-2
    rms = Optimizer.from_dict({"kind": "rmsprop"})
    assert (rms.lr, rms.alpha, rms.eps) == (0.01, 0.99, 1e-8)
    # state per element: the arrays, then a step count (2 float32)
    assert Optimizer.from_dict({"kind": "adam", "amsgrad": True}).state_size(100) == 302
    assert Optimizer.from_dict({"kind": "sgd"}).state_size(100) == 0


def test_old_adagrad_definitions_keep_the_old_rule() -> None:
    """Every Adagrad definition written before the torch kinds names initial_accumulator: it
    reads as adagrad_legacy (acc += g*g; w -= lr * g / sqrt(acc + eps)), state shaped like the
    shard, and round-trips under that explicit name."""
    old = {"kind": "adagrad", "lr": 0.1, "eps": 1e-8, "initial_accumulator": 0.1}
    opt = Optimizer.from_dict(old)
    assert opt.kind == "adagrad_legacy" and opt.legacy_layout
    assert Optimizer.from_dict(opt.to_dict()) == opt
    assert optim.state_shape(opt, (4, 5)) == (4, 5)
    w = np.ones(20, np.float32)
    acc = optim.initial_state(opt, 20)
    g = np.full(20, 0.5, np.float32)
    optim.apply_batch(opt, w, acc, [Dense(g)], Scratch(20))
    np.testing.assert_allclose(w, 1 - 0.1 * 0.5 / np.sqrt(0.1 + 0.25 + 1e-8), rtol=1e-6)


@pytest.mark.parametrize(
    ("d", "words"),
    [
        ({"kind": "adamax"}, "must be one of"),
        ({"kind": "adam", "momentum": 0.9}, "unknown field(s) ['momentum'] for optimizer 'adam'"),
        ({"kind": "adam", "betas": [0.9, 1.0]}, "betas must be in [0, 1)"),
        ({"kind": "adam", "betas": 0.9}, "betas must be two numbers"),
        ({"kind": "sgd", "nesterov": True}, "nesterov needs a momentum > 0"),
        ({"kind": "rmsprop", "centered": 1}, "centered must be true or false"),
        ({"kind": "adagrad", "lr": -0.1}, "adagrad lr must be >= 0"),
        ({"kind": "adam", "eps": float("nan")}, "eps must be a finite number"),
        ({"kind": "adam", "eps": 0}, "adam eps must be > 0"),
        ({"kind": "rmsprop", "alpha": 1.0}, "rmsprop alpha must be < 1"),
    ],
)
def test_bad_definitions_name_the_field(d: dict, words: str) -> None:
    with pytest.raises(OptimError) as e:
        Optimizer.from_dict(d)
    assert words in str(e.value)


def test_tables_and_tensors_refuse_the_other_kinds() -> None:
    with pytest.raises(OptimError, match="a table's optimizer must be one of"):
        Optimizer.from_dict({"kind": "adam"}).check_for_table()
    with pytest.raises(OptimError, match="no lr_decay"):
        Optimizer.from_dict({"kind": "adagrad", "lr_decay": 0.1}).check_for_table()
    with pytest.raises(OptimError, match="rowwise_adagrad is for tables"):
        Optimizer.from_dict({"kind": "rowwise_adagrad"}).check_for_tensor()


def test_torch_adagrad_applies_a_compressed_push_sparsely_bit_for_bit() -> None:
    """A compressed push under torch's Adagrad touches only its elements (gather, scatter), and
    ends bit-identical to the dense step of its gradient (+-tau there, 0 elsewhere)."""
    rng = np.random.default_rng(8)
    opt = Optimizer.from_dict({"kind": "adagrad", "lr": 0.05, "lr_decay": 0.01})
    w1 = rng.normal(size=500).astype(np.float32)
    w2, s1, s2 = w1.copy(), optim.initial_state(opt, 500), optim.initial_state(opt, 500)
    scratch = Scratch(500)
    for _ in range(20):
        idx = np.sort(rng.choice(500, size=40, replace=False)).astype(np.uint32)
        u = Signs(idx << np.uint32(1) | rng.integers(0, 2, 40).astype(np.uint32), 0.3)
        optim.apply_batch(opt, w1, s1, [u], scratch)
        optim.apply_batch(
            opt, w2, s2, [Dense(optim.signs_dense(u, np.empty(500, np.float32)))], scratch
        )
    assert w1.tobytes() == w2.tobytes() and s1.tobytes() == s2.tobytes()
    assert torchoptim.step_count(s1) == 20


def _sparse_adam_torch(w0: np.ndarray, steps, lr: float, betas, eps: float) -> np.ndarray:
    """torch.optim.SparseAdam on an nn.Embedding(sparse=True) from `w0`, one step per
    (ids, grads): the gradient reaches the table through the embedding's own backward (its
    duplicate ids summed by torch's coalesce)."""
    emb = torch.nn.Embedding(*w0.shape, sparse=True)
    with torch.no_grad():
        emb.weight.copy_(torch.from_numpy(w0))
    o = torch.optim.SparseAdam(emb.parameters(), lr=lr, betas=betas, eps=eps)
    for ids, g in steps:
        o.zero_grad()
        out = emb(torch.from_numpy(ids))
        out.backward(torch.from_numpy(g))  # d(sum(out * g))/d rows = g, summed per id
        o.step()
    return emb.weight.detach().numpy()


@pytest.mark.parametrize("betas", [(0.9, 0.999), (0.5, 0.9)])
def test_sparse_adam_matches_torch_sparse_adam_step_for_step(betas) -> None:
    """sparse_adam against torch.optim.SparseAdam on an nn.Embedding(sparse=True): every push
    names every row (in a shuffled order, some ids twice), so the rows' own step counts are
    torch's table step count and the two must agree step for step, moments included."""
    rng = np.random.default_rng(21)
    n_ids, dim, lr, eps = 9, 6, 0.01, 1e-8
    opt = Optimizer.from_dict({"kind": "sparse_adam", "lr": lr, "betas": list(betas)})
    blk = RowBlock(dim, NORMAL, opt, Admission(), None)
    assert blk.acc_width == 2 * dim + 1
    w0 = initial_rows(NORMAL, np.arange(n_ids), dim)
    steps = []
    for t in range(STEPS):
        ids = np.concatenate([rng.permutation(n_ids), rng.choice(n_ids, 3)]).astype(np.int64)
        g = rng.normal(size=(len(ids), dim)).astype(np.float32)
        steps.append((ids, g))
        blk.apply(RowPush(ids, g, float(t)), ApplyStats())
        if t in (0, 1, STEPS - 1):
            want = _sparse_adam_torch(w0, steps, lr, betas, eps)
            got = blk.values[blk.slots(np.arange(n_ids))]
            np.testing.assert_allclose(got, want, rtol=TOL, atol=TOL)
    s = blk.slots(np.arange(n_ids))
    assert (blk.accum[s, 2 * dim] == STEPS).all()  # each row's step count
    copy = RowBlock(dim, NORMAL, opt, Admission(), None)
    copy.load_bytes(blk.tobytes())
    assert copy.digest() == blk.digest() and copy.accum.shape == (n_ids, 2 * dim + 1)


def test_sparse_adam_counts_each_rows_own_steps() -> None:
    """Pushes naming a few rows each: a row's moments move only when it is pushed (lazy, as
    SparseAdam) and its bias correction counts its own pushes: each row is what torch's
    SparseAdam makes of a one-row nn.Embedding stepped at that row's pushes only."""
    rng = np.random.default_rng(22)
    n_ids, dim, lr = 10, 4, 0.02
    opt = Optimizer.from_dict({"kind": "sparse_adam", "lr": lr})
    blk = RowBlock(dim, NORMAL, opt, Admission(), None)
    pushes = _pushes(rng, n_ids, dim)
    for t, (ids, g) in enumerate(pushes):
        blk.apply(RowPush(ids, g, float(t)), ApplyStats())
    w0 = initial_rows(NORMAL, np.arange(n_ids), dim)
    for i in range(n_ids):
        mine = [(np.zeros(1, np.int64), g[ids == i]) for ids, g in pushes if (ids == i).any()]
        want = _sparse_adam_torch(w0[i : i + 1], mine, lr, (0.9, 0.999), 1e-8)
        s = blk.slots(np.array([i]))
        if not mine:
            assert s[0] < 0
            continue
        np.testing.assert_allclose(blk.values[s], want, rtol=TOL, atol=TOL)
        assert blk.accum[s[0], 2 * dim] == len(mine)


def test_sparse_adam_is_for_tables_only() -> None:
    with pytest.raises(OptimError, match="sparse_adam is for tables"):
        Optimizer.from_dict({"kind": "sparse_adam"}).check_for_tensor()
    Optimizer.from_dict({"kind": "sparse_adam"}).check_for_table()
    with pytest.raises(OptimError, match="unknown field"):
        Optimizer.from_dict({"kind": "sparse_adam", "weight_decay": 0.1})
