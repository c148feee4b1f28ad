"""A push's `hyper` (issue 37: an LR scheduler's lr on the servers; adamps/server/updates/hyper.py):
checked as a create's optimizer is, never changing the kind or the state's layout; each update
it names is applied with it, a batch of updates under several lrs equals applying them one by
one; it travels in the replicated update ("o"), which a copy checks again and applies alike.

Pure functions and a real Store (owner threads); no sockets."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from adamps.layout import TensorSpec
from adamps.server.decode import replicated as check_update
from adamps.server.decode import update_parts
from adamps.server.decode.dense import update as dense_update
from adamps.server.decode.fc import update as fc_update
from adamps.server.store.initial import normalize_init
from adamps.server.store.store import Store
from adamps.server.updates import optim
from adamps.server.updates.hyper import push_hyper, with_hyper
from adamps.server.updates.optim import Dense, Fc, Optimizer, Scratch
from adamps.wire.protocol import ProtocolError

ADAMW = Optimizer.from_dict({"kind": "adamw", "lr": 1e-3, "weight_decay": 0.01})


def test_hyper_changes_hyperparameters_and_keeps_the_rest() -> None:
    o = with_hyper(ADAMW, {"lr": 0.05, "betas": [0.8, 0.99]}, "t")
    assert o.kind == "adamw" and o.lr == 0.05 and o.params["betas"] == (0.8, 0.99)
    assert o.params["weight_decay"] == 0.01 and o.slots == ADAMW.slots
    assert with_hyper(ADAMW, {"kind": "adamw"}, "t") == ADAMW


@pytest.mark.parametrize(
    ("base", "hyper", "message"),
    [
        (ADAMW, {"kind": "sgd"}, "names optimizer 'sgd'; the tensor's is 'adamw'"),
        (ADAMW, {"amsgrad": True}, "changes amsgrad"),
        (Optimizer("sgd", 0.1), {"momentum": 0.9}, "changes momentum"),
        (Optimizer("sgd", 0.1, {"momentum": 0.9}), {"momentum": 0.0}, "changes momentum"),
        (ADAMW, {"lr": -1.0}, "adamw lr must be >= 0"),
        (ADAMW, {"lr": float("nan")}, "finite number"),
        (ADAMW, {"betas": [1.5, 0.9]}, r"betas must be in \[0, 1\)"),
        (ADAMW, {"momentum": 0.9}, "unknown field"),
        (ADAMW, {"lr": 1e30}, "lr of magnitude"),
        (ADAMW, [0.1], "must map field names to values"),
    ],
)
def test_bad_hyper_is_refused_naming_it(base: Optimizer, hyper: object, message: str) -> None:
    with pytest.raises(ProtocolError, match=message) as exc:
        with_hyper(base, hyper, "run..w")
    assert exc.value.code == "bad_request" and "run..w" in str(exc.value)


@pytest.fixture
def store() -> Iterator[Store]:
    s = Store(n_buckets=1, owner_threads=1)
    try:
        s.define(TensorSpec("w", (4, 3)), ADAMW, normalize_init(None, (4, 3)), None)
        yield s
    finally:
        s.close()


def test_push_hyper_names_defined_tensors_only(store: Store) -> None:
    got = push_hyper({"hyper": {"w": {"lr": 0.5}}}, store.tensors)
    assert got["w"][0].lr == 0.5 and got["w"][1]["lr"] == 0.5
    assert push_hyper({}, store.tensors) == {}
    with pytest.raises(ProtocolError) as exc:
        push_hyper({"hyper": {"nope": {"lr": 0.5}}}, store.tensors)
    assert exc.value.code == "unknown_tensor"
    with pytest.raises(ProtocolError, match="must map tensor names"):
        push_hyper({"hyper": [1]}, store.tensors)


def test_a_batch_under_several_rules_equals_them_one_by_one() -> None:
    rng = np.random.default_rng(0)
    g = [rng.standard_normal(12).astype(np.float32) for _ in range(4)]
    lrs = [None, 0.01, 0.01, 0.002]  # None: the tensor's own (1e-3)
    opts = [None if lr is None else with_hyper(ADAMW, {"lr": lr}, "w") for lr in lrs]
    w0 = rng.standard_normal(12).astype(np.float32)
    scratch = Scratch(12)
    w1, s1 = w0.copy(), optim.initial_state(ADAMW, 12)
    last = optim.apply_batch(
        ADAMW, w1, s1, [Dense(x, o) for x, o in zip(g, opts, strict=True)], scratch
    )
    assert last.lr == 0.002
    w2, s2 = w0.copy(), optim.initial_state(ADAMW, 12)
    for x, o in zip(g, opts, strict=True):
        optim.apply_batch(o or ADAMW, w2, s2, [Dense(x)], scratch)
    assert np.array_equal(w1, w2) and np.array_equal(s1, s2)
    # plain SGD stacks a run of fc pushes into one sgemm: only those under one lr
    sgd = Optimizer("sgd", 0.1)
    a, e = (
        rng.standard_normal((2, 3)).astype(np.float32),
        rng.standard_normal((2, 4)).astype(np.float32),
    )
    fast = with_hyper(sgd, {"lr": 0.5}, "w")
    w3 = w0.reshape(4, 3).copy()
    optim.apply_batch(sgd, w3, None, [Fc(a, e), Fc(a, e, fast)], scratch)
    want = w0.reshape(4, 3) - 0.1 * (e.T @ a) - 0.5 * (e.T @ a)
    assert np.allclose(w3, want, atol=1e-6)


def test_the_replicated_update_carries_the_rule_and_is_checked_again(store: Store) -> None:
    st = store.shards["w/0"] if "w/0" in store.shards else next(iter(store.shards.values()))
    o = with_hyper(ADAMW, {"lr": 0.25}, "w").to_dict()
    u = dense_update(st.id, np.ones(12, np.float32), o)
    check_update(store, u)
    [(got_st, part)] = update_parts(store, u)
    assert got_st is st and part.opt is not None and part.opt.lr == 0.25
    plain = dense_update(st.id, np.ones(12, np.float32))
    assert "o" not in plain and update_parts(store, plain)[0][1].opt is None
    f = fc_update("w", [st.id], np.ones((1, 3), np.float32), np.ones((1, 4), np.float32), o)
    check_update(store, f)
    assert all(p.opt.lr == 0.25 for _s, p in update_parts(store, f))
    bad = dense_update(st.id, np.ones(12, np.float32), {**o, "amsgrad": True})
    with pytest.raises(ProtocolError, match="changes amsgrad"):
        check_update(store, bad)
