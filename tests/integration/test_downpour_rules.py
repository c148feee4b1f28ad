"""Downpour's pure parts, without processes or sockets: the epoch-end rule (Adam 3.2.5), the
vectors-or-dense choice (Adam 3.2.6), the coalescing push queue, and that what a worker's round
pushes, applied by the parameter server's optimizer code, equals the dense gradient push."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from adamps.server.updates.optim import Dense, Fc, Optimizer, Scratch, apply_batch
from trainer import export
from trainer.model import Model
from trainer.packing import (
    DownpourWorker,
    PackPlan,
    PushItem,
    add_pending,
    collect_round,
    push_parts,
    use_vectors,
)
from trainer.push_queue import PushQueue
from trainer.schedule import completed_epoch, required_replicas


def test_required_replicas_default_fraction() -> None:
    # 75% of the replicas, rounded up, at least one
    assert [required_replicas(n, 0.75) for n in (1, 2, 3, 4, 8)] == [1, 2, 3, 3, 6]
    assert required_replicas(4, 0.5) == 2
    assert required_replicas(10, 0.01) == 1


def test_completed_epoch_moves_on_without_the_slowest() -> None:
    # 4 replicas, 75%: epoch 2 is complete once 3 replicas finished it; the 4th (still in
    # epoch 1) is inside a complete epoch and must move on.
    finished = {"0": 2, "1": 2, "2": 3, "3": 0}
    assert completed_epoch(finished, 4, 0.75) == 2
    assert completed_epoch({"0": 5}, 4, 0.75) == 0  # replicas never heard of count as 0
    assert completed_epoch({"0": 1, "1": 0}, 2, 0.75) == 0  # 2 replicas: both needed
    assert completed_epoch({"0": 1, "1": 1}, 2, 0.75) == 1
    assert completed_epoch({"0": 4, "1": 1}, 2, 0.5) == 4


def test_vectors_only_when_smaller_than_the_matrix() -> None:
    # adam-mnist's fc1 is 400 x 320: vectors while k * 720 < 128,000, i.e. k <= 177
    assert use_vectors(177, 400, 320)
    assert not use_vectors(178, 400, 320)
    # the 10 x 400 output layer: only up to 9 samples
    assert use_vectors(9, 10, 400) and not use_vectors(10, 10, 400)


def _item(v: float) -> PushItem:
    a, e = np.full((2, 30), v, np.float32), np.full((2, 40), v, np.float32)
    return PushItem({"c.w": np.full(5, v, np.float32)}, {"f.w": [(a, e)]}, steps=1)


def test_push_queue_merges_instead_of_blocking_and_keeps_markers_in_order() -> None:
    q = PushQueue(limit=2)
    seen: list[str] = []
    q.put(_item(1))
    q.put(lambda: seen.append("marker"))
    q.put(_item(2))  # the last item is a marker: appended, not merged
    q.put(_item(3))  # full: merged into the item before it
    q.put(_item(4))
    assert len(q) == 3 and q.merged == 2
    first, marker, last = q.get(), q.get(), q.get()
    assert first.steps == 1 and last.steps == 3
    np.testing.assert_array_equal(last.dense["c.w"], np.full(5, 9, np.float32))
    assert [b[0][0, 0] for b in last.vectors["f.w"]] == [2, 3, 4]
    marker()
    assert seen == ["marker"]
    for _ in range(3):
        q.done()
    assert q.join(0.1)


def test_merging_folds_vectors_once_the_matrix_is_smaller() -> None:
    """A 40 x 30 weight: vectors while k * 70 < 1200, i.e. up to 17 rows; the 18th row folds
    the stack into the dense delta (bounded memory under a long push backlog)."""
    rng = np.random.default_rng(1)
    blocks = [
        (rng.standard_normal((6, 30)).astype(np.float32), rng.standard_normal((6, 40)).astype(np.float32))
        for _ in range(4)
    ]  # fmt: skip
    item = PushItem({}, {"f.w": [blocks[0]]})
    item.merge(PushItem({}, {"f.w": [blocks[1]]}))
    assert len(item.vectors["f.w"]) == 2 and "f.w" not in item.dense  # 12 rows
    item.merge(PushItem({}, {"f.w": [blocks[2]]}))  # 18 rows: folded
    assert "f.w" not in item.vectors
    expected = sum(e.T @ a for a, e in blocks[:3])
    np.testing.assert_allclose(item.dense["f.w"].reshape(40, 30), expected, rtol=1e-5, atol=1e-5)
    item.merge(PushItem({}, {"f.w": [blocks[3]]}))  # new vectors beside the folded delta
    (part,) = push_parts(item, 1.0, {"f.w": (40, 30)})
    assert part[0] == "dense"  # pushed together with the folded delta
    np.testing.assert_allclose(
        part[2], expected + blocks[3][1].T @ blocks[3][0], rtol=1e-5, atol=1e-5
    )


def test_push_queue_join_waits_for_the_consumer() -> None:
    q = PushQueue(limit=4)
    q.put(_item(1))
    assert not q.join(0.05)  # nobody consumed it

    def consume() -> None:
        q.get()
        q.done()

    t = threading.Thread(target=consume)
    t.start()
    assert q.join(5)
    t.join()


@pytest.mark.parametrize("kind", ["sgd", "adagrad"])
def test_a_rounds_pushes_equal_the_dense_gradient_push(kind: str) -> None:
    """Two minibatches through a worker (as in a Hogwild process), collected and turned into
    pushes like the push thread does, then applied with the server's optimizer code: the result
    equals pushing the summed dense gradients (Adam 3.2.6's vectors change traffic, not math)."""
    local_lr, batch, steps = 0.05, 4, 2
    rng = np.random.default_rng(3)
    xs = [rng.integers(0, 256, (batch, 28, 28), dtype=np.uint8) for _ in range(steps)]
    ys = [rng.integers(0, 10, batch) for _ in range(steps)]

    init = Model("adam-mnist")
    init.init_params(7)
    plan = PackPlan.of(init, max_rows=steps * batch)
    params = init.params.copy()
    buffers = {k: np.zeros(n, np.float32) for k, n in plan.buffers(1).items()}
    worker = DownpourWorker(init.spec, local_lr, plan, 0, params, buffers)
    loss, n_batches, rows = worker(list(zip(xs, ys, strict=True)))
    assert (n_batches, rows) == (steps, steps * batch) and np.isfinite(loss)
    item = collect_round(buffers, plan, [(loss, n_batches, rows)])
    assert not buffers["acc0"].any()  # cleared for the next round

    # the reference: the same local SGD steps, summing the true gradients
    ref = Model("adam-mnist", params=init.params.copy())
    total = np.zeros(ref.n_params, np.float32)
    for x, y in zip(xs, ys, strict=True):
        ref.loss_and_grad(ref.prepare(x), y)
        total += ref.grads
        ref.params -= local_lr * ref.grads
    np.testing.assert_allclose(params, ref.params, rtol=1e-4, atol=1e-6)  # the local copy moved

    shapes = dict(init.tensors())
    parts = push_parts(item, -1.0 / local_lr, shapes)
    kinds = {p[1]: p[0] for p in parts}
    assert kinds["fc1.w"] == "fc" and kinds["fc2.w"] == "fc"  # k = 8 rows: vectors
    assert kinds["conv1.w"] == "dense" and kinds["fc1.b"] == "dense"
    assert set(kinds) == set(shapes)

    opt = Optimizer(kind, 0.01)
    scratch = Scratch(200_000)
    sl = init.slices()
    for part in parts:
        name = part[1]
        start = init.param(name).copy()
        acc_a = np.zeros_like(start) if opt.has_accumulator else None
        acc_b = np.zeros_like(start) if opt.has_accumulator else None
        via_push = start.copy()
        update = Fc(part[2], part[3]) if part[0] == "fc" else Dense(part[2])
        apply_batch(opt, via_push, acc_a, [update], scratch)
        dense = start.copy()
        apply_batch(opt, dense, acc_b, [Dense(total[sl[name]].reshape(shapes[name]))], scratch)
        # Adagrad's first step is lr * g / |g|: for gradients near 0 float rounding of the
        # rescaled g moves it by up to ~5e-3 of lr (e.T @ a's summation order is BLAS's, which
        # follows its thread count: other tests in the same worker process may have set it;
        # 3e-5 was seen under pytest-xdist)
        atol = 5e-5 if kind == "adagrad" else 1e-6
        np.testing.assert_allclose(via_push, dense, rtol=1e-4, atol=atol, err_msg=name)
        assert not np.array_equal(via_push, start), name  # something was applied


def test_many_rows_go_dense() -> None:
    """Past k * (M + N) >= M * N a fully connected layer pushes e.T @ a instead."""
    rng = np.random.default_rng(0)
    blocks = [
        (rng.standard_normal((8, 400)).astype(np.float32), rng.standard_normal((8, 10)).astype(np.float32))
        for _ in range(2)
    ]  # fmt: skip
    item = PushItem({}, {"out.w": blocks})
    (part,) = push_parts(item, -2.0, {"out.w": (10, 400)})
    assert part[0] == "dense"
    a = np.concatenate([b[0] for b in blocks])
    e = np.concatenate([b[1] for b in blocks])
    np.testing.assert_allclose(part[2], -2.0 * e.T @ a, rtol=1e-5)


def test_export_round_trip(tmp_path) -> None:
    m = Model("adam-mnist")
    m.init_params(1)
    path = export.save(
        tmp_path / "m.npz", m.spec, {n: m.param(n) for n, _ in m.tensors()}, {"x": 1}
    )
    back, meta = export.load(path)
    assert meta == {"x": 1} and back.spec == m.spec
    np.testing.assert_array_equal(back.params, m.params)
    with pytest.raises(ValueError, match="do not match"):
        export.save(tmp_path / "bad.npz", m.spec, {"conv1.w": m.param("conv1.w")})


def test_installing_queued_items_at_once_equals_one_by_one() -> None:
    """add_pending (one stacked in-place sgemm per fc weight over every queued item) equals the
    item-by-item expansion params += e.T @ a, up to float rounding (issue 16, trainer CPU)."""
    rng = np.random.default_rng(3)
    shapes = {"c.w": (4, 5), "f.w": (30, 20), "g.w": (7, 3)}
    slices, pos = {}, 0
    for n, s in shapes.items():
        slices[n] = slice(pos, pos + int(np.prod(s)))
        pos += int(np.prod(s))

    def vec(m: int, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
        return rng.standard_normal((k, n), np.float32), rng.standard_normal((k, m), np.float32)

    items = [
        PushItem({"c.w": rng.standard_normal(20, np.float32)},
                 {"f.w": [vec(30, 20, 3), vec(30, 20, 2)], "g.w": [vec(7, 3, 1)]}),
        PushItem({"c.w": rng.standard_normal(20, np.float32)}, {"f.w": [vec(30, 20, 4)]}),
        PushItem({"g.w": rng.standard_normal(21, np.float32)}, {}),
    ]  # fmt: skip
    base = rng.standard_normal(pos).astype(np.float32)
    want = base.astype(np.float64)
    for item in items:
        for n, d in item.dense.items():
            want[slices[n]] += d
        for n, blocks in item.vectors.items():
            for a, e in blocks:
                want[slices[n]] += (e.T.astype(np.float64) @ a).reshape(-1)
    got = base.copy()
    add_pending(got, items, slices, shapes)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert not np.array_equal(got, base)
