"""The click-through workload (adamps/data/ctr_data.py), its AUC, the CTR model's gradients, and the
numpy embedding layers' pure parts (trainer/embedding.py)."""

from __future__ import annotations

import numpy as np

from adamps.data.ctr_data import CtrData, CtrSpec, auc
from trainer.ctr import CtrConfig, gradients, mlp_specs
from trainer.embedding import lookup, pool, row_grads


def test_examples_are_deterministic_zipf_over_a_million_ids_with_a_planted_truth() -> None:
    spec = CtrSpec()
    assert spec.n_ids >= 1_000_000 and spec.n_fields >= 3
    data = CtrData(spec)
    ids, y, logit = data.examples(50_000, 3)
    ids2, y2, _ = data.examples(50_000, 3)
    assert np.array_equal(ids, ids2) and np.array_equal(y, y2)
    for f, (off, n) in enumerate(zip(spec.offsets, spec.sizes, strict=True)):
        col = ids[:, f]
        assert col.min() >= off and col.max() < off + n
        counts = np.bincount(col - off, minlength=min(n, 10))
        assert counts[0] > counts[1] > counts[9]  # Zipf: rank 0 most frequent
    # Labels follow the planted logit: the truth's AUC is well above chance and the rate matches.
    assert 0.75 < auc(y, logit) < 0.95
    assert abs(y.mean() - np.mean(1 / (1 + np.exp(-logit)))) < 0.01


def test_auc_matches_the_pairwise_definition() -> None:
    rng = np.random.default_rng(0)
    y = rng.random(300) < 0.3
    s = np.round(rng.normal(size=300), 1)  # ties
    pos, neg = s[y], s[~y]
    want = ((pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()) / (
        len(pos) * len(neg)
    )
    assert abs(auc(y, s) - want) < 1e-12


def test_mlp_gradients_match_finite_differences() -> None:
    spec, cfg = CtrSpec(sizes=(10, 20)), CtrConfig(dim=3, hidden=5)
    rng = np.random.default_rng(1)
    p = {t.name: rng.normal(size=t.shape).astype(np.float64) for t in mlp_specs(spec, cfg)}
    x = rng.normal(size=(7, 6))
    y = (rng.random(7) < 0.5).astype(np.float64)
    loss, grads, dx = gradients(x, y, p)
    eps = 1e-6
    for name in p:
        flat = p[name].reshape(-1)
        for k in range(min(flat.size, 4)):
            old = flat[k]
            flat[k] = old + eps
            up = gradients(x, y, p)[0]
            flat[k] = old - eps
            down = gradients(x, y, p)[0]
            flat[k] = old
            assert abs((up - down) / (2 * eps) - grads[name].reshape(-1)[k]) < 1e-5
    x2 = x.copy()
    x2[2, 4] += eps
    assert abs((gradients(x2, y, p)[0] - loss) / eps - dx[2, 4]) < 1e-4


def test_embedding_lookup_and_row_gradients() -> None:
    ids = np.array([[5, 9], [9, 9], [2, 5]])
    uniq, inv = lookup(ids)
    assert uniq.tolist() == [2, 5, 9] and np.array_equal(uniq[inv], ids)
    grad = np.arange(12, dtype=np.float32).reshape(3, 2, 2)
    g = row_grads(inv, grad, len(uniq))
    want = {2: grad[2, 0], 5: grad[0, 0] + grad[2, 1], 9: grad[0, 1] + grad[1, 0] + grad[1, 1]}
    for k, i in enumerate(uniq.tolist()):
        assert np.array_equal(g[k], want[i])
    assert np.array_equal(pool(grad, "sum"), grad.sum(axis=1))
