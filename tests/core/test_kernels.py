"""The fused (numba) optimizer kernels against their numpy reference: bit-identical (issue 27)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from adamps.server.updates import kernels, optim
from adamps.server.updates.optim import Dense, Optimizer, Scratch

ROOT = Path(__file__).resolve().parents[2]


def _state(n: int, seed: int) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    g = np.random.default_rng(seed)
    w = g.standard_normal(n).astype(np.float32)
    acc = np.abs(g.standard_normal(n)).astype(np.float32) * np.float32(0.1)
    grads = []
    for k in range(6):
        # magnitudes from 1e-6 to 1e3, exact zeros and both signs: where rounding differs first
        x = g.standard_normal(n).astype(np.float32) * np.float32(10.0 ** (k - 4))
        x[:: 7 + k] = 0.0
        grads.append(x)
    return w, acc, grads


@pytest.fixture(autouse=True)
def _fused_loaded() -> None:
    """The kernels load in a background thread on a process's first Adagrad update; these tests
    compare the fused kernels themselves, so they load them first (as a server has by then)."""
    assert all(f is not None for f in kernels.load())


def test_the_fused_kernel_is_the_default() -> None:
    # numba is a declared dependency: if it went missing the fast path would silently be lost
    assert kernels.SELECTED == "numba"
    assert kernels._ready() is not None


@pytest.mark.parametrize("n", [1, 7, 64, 1000, 262_147])
def test_fused_torch_adagrad_is_bit_identical_to_numpy(n: int) -> None:
    """torch's Adagrad (eps outside the square root, the accumulator from 0): fused = numpy."""
    assert kernels._ready()[1] is not None
    w1, a1, grads = _state(n, seed=n + 1)
    a1[::3] = 0.0  # torch's default start, where the first step divides by |g| + eps
    w2, a2 = w1.copy(), a1.copy()
    tmp = np.empty(n, np.float32)
    for clr, eps, g in zip(
        (0.1, 0.01, 3.0, 1e-4, 0.5, 1.0), (1e-10, 1e-6, 0.1, 1e-10, 1.0, 1e-3), grads, strict=True
    ):
        g_ro = np.frombuffer(g.tobytes(), np.float32)
        kernels.adagrad_torch(w1, a1, g_ro, clr, eps, tmp)
        kernels.adagrad_torch_numpy(w2, a2, g_ro, clr, eps, tmp)
        assert np.array_equal(a1, a2)
        assert w1.tobytes() == w2.tobytes()


@pytest.mark.parametrize("n", [1, 7, 64, 1000, 262_147])
def test_fused_adagrad_is_bit_identical_to_numpy(n: int) -> None:
    w1, a1, grads = _state(n, seed=n)
    w2, a2 = w1.copy(), a1.copy()
    tmp = np.empty(n, np.float32)
    for lr, eps, g in zip(
        (0.1, 0.01, 3.0, 1e-4, 0.5, 1.0), (1e-8, 1e-6, 0.1, 1e-8, 1.0, 1e-3), grads, strict=True
    ):
        g_ro = np.frombuffer(g.tobytes(), np.float32)  # read-only, as decoded from the wire
        kernels.adagrad(w1, a1, g_ro, lr, eps, tmp)
        kernels.adagrad_numpy(w2, a2, g_ro, lr, eps, tmp)
        assert np.array_equal(a1, a2)
        assert w1.tobytes() == w2.tobytes()  # bit for bit, -0.0 and all


def test_fused_adagrad_in_apply_batch_matches_numpy_on_a_2d_shard() -> None:
    opt = Optimizer("adagrad_legacy", 0.05, {"eps": 1e-7, "initial_accumulator": 0.01})
    w1, a1, grads = _state(128 * 96, seed=3)
    w1, a1 = w1.reshape(128, 96), a1.reshape(128, 96)
    w2, a2 = w1.copy(), a1.copy()
    addr = w1.__array_interface__["data"][0]
    optim.apply_batch(opt, w1, a1, [Dense(g) for g in grads], Scratch(w1.size))
    tmp = np.empty(w2.size, np.float32)
    for g in grads:
        kernels.adagrad_numpy(w2.reshape(-1), a2.reshape(-1), g, opt.lr, opt.eps, tmp)
    assert w1.__array_interface__["data"][0] == addr  # in place
    assert w1.tobytes() == w2.tobytes() and a1.tobytes() == a2.tobytes()


def test_the_numpy_path_keeps_the_float64_reference_within_float32_rounding() -> None:
    opt = Optimizer("adagrad_legacy", 0.1, {"eps": 1e-6})
    w, acc, grads = _state(5000, seed=9)
    w64, acc64 = w.copy(), acc.copy()
    tmp = np.empty(w.size, np.float32)
    for g in grads[:3]:
        kernels.adagrad(w, acc, g, opt.lr, opt.eps, tmp)
        optim.reference_apply(opt, w64, acc64, g)
    np.testing.assert_allclose(acc, acc64, rtol=1e-6)
    np.testing.assert_allclose(w, w64, rtol=1e-5, atol=1e-6)


def test_a_non_contiguous_shard_is_refused_rather_than_updated_in_a_copy() -> None:
    w = np.zeros((8, 8), np.float32)[:, ::2]
    acc = np.zeros((8, 4), np.float32)
    with pytest.raises(ValueError, match="C-contiguous"):
        kernels.adagrad(w, acc, np.ones(32, np.float32), 0.1, 1e-8, np.empty(32, np.float32))
    assert not w.any()


def _run(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    e = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    return subprocess.run(
        [sys.executable, "-c", code], env=e, capture_output=True, text=True, timeout=120
    )


def test_adamps_kernels_numpy_selects_the_reference_and_a_bad_value_is_named(
    tmp_path: Path,
) -> None:
    r = _run(
        "from adamps.server.updates import kernels; print(kernels.SELECTED, kernels.load()[0])",
        ADAMPS_KERNELS="numpy",
        NUMBA_CACHE_DIR=str(tmp_path),
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["numpy", "None"]
    r = _run("import adamps.server.updates.kernels", ADAMPS_KERNELS="fortran")
    assert r.returncode != 0
    assert "ADAMPS_KERNELS" in r.stderr and "'fortran'" in r.stderr and "numba" in r.stderr


def test_the_compiled_kernel_is_cached_on_disk(tmp_path: Path) -> None:
    # NUMBA_CACHE_DIR stands in for the module's __pycache__: a second process loads, not compiles
    code = (
        "from adamps.server.updates import kernels; s = kernels.load()[0].stats; "
        "print(sum(s.cache_hits.values()), sum(s.cache_misses.values()))"
    )
    first = _run(code, NUMBA_CACHE_DIR=str(tmp_path))
    assert first.returncode == 0, first.stderr
    assert first.stdout.split() == ["0", "1"]  # compiled once and stored
    assert any(p.suffix == ".nbi" for p in tmp_path.rglob("*"))
    second = _run(code, NUMBA_CACHE_DIR=str(tmp_path))
    assert second.returncode == 0, second.stderr
    assert second.stdout.split() == ["1", "0"]  # loaded, not compiled


def test_without_a_writable_cache_the_kernel_compiles_in_memory_instead_of_failing() -> None:
    # Source compiled under the name "<string>" has no place numba could cache it in, as a
    # read-only install with a read-only home would not: the server must still start, fused.
    src = Path(kernels.__file__).read_text()
    ns: dict[str, object] = {"__name__": "kernels_without_cache"}
    exec(compile(src, "<string>", "exec"), ns)  # noqa: S102
    fused = ns["load"]()[0]  # type: ignore[operator]
    assert fused is not None
    w, acc, grads = _state(1000, seed=5)
    w2, acc2 = w.copy(), acc.copy()
    ns["adagrad"](w, acc, grads[0], 0.1, 1e-8, np.empty(1000, np.float32))  # type: ignore[operator]
    kernels.adagrad_numpy(w2, acc2, grads[0], 0.1, 1e-8, np.empty(1000, np.float32))
    assert w.tobytes() == w2.tobytes()


def test_a_server_imports_no_numba_until_its_first_adagrad_update() -> None:
    """numba and the kernels' load cost about 0.6 CPU-s, half a parameter server's start; every
    test cluster starts several servers, and many apply no Adagrad at all."""
    r = _run(
        "import sys, adamps.server.api.app\n"
        "from adamps.server.updates import kernels\n"
        "print('numba' in sys.modules, kernels._fused is None, kernels._loader is None)"
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False", "True", "True"]


def test_the_first_adagrad_update_runs_numpy_while_the_kernels_load_in_a_thread() -> None:
    """The first update starts the load and does not wait for it (a compile takes seconds on a
    new machine): it runs the bit-identical numpy reference; once loaded, the fused kernel runs."""
    code = """
import numpy as np
from adamps.server.updates import kernels
w = np.linspace(-1, 1, 1000, dtype=np.float32); acc = np.full(1000, 0.1, np.float32)
g = np.linspace(3, -2, 1000, dtype=np.float32); tmp = np.empty(1000, np.float32)
w2, acc2 = w.copy(), acc.copy()
with kernels._load_lock:  # the load cannot finish before the first update returns
    kernels.adagrad(w, acc, g, 0.1, 1e-8, tmp)
    kernels.adagrad_numpy(w2, acc2, g, 0.1, 1e-8, tmp)
    first = (kernels._fused is None, kernels._loader is not None, w.tobytes() == w2.tobytes())
kernels._loader.join(120)
fused = kernels._ready()
calls = []
real = fused[0]
kernels._fused = (lambda *a: (calls.append(1), real(*a))[1], fused[1])
kernels.adagrad(w, acc, g, 0.1, 1e-8, tmp)
kernels.adagrad_numpy(w2, acc2, g, 0.1, 1e-8, tmp)
print(*first, fused is not None, calls == [1], w.tobytes() == w2.tobytes())
"""
    r = _run(code)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["True"] * 6, r.stdout


def test_a_tensor_created_under_adagrad_starts_the_load_and_one_under_sgd_does_not() -> None:
    """The load runs when a shard whose optimizer applies the kernels is created (or reloaded),
    not inside the first steps of training, and a server without one never loads numba."""
    code = """
import sys
from adamps.layout import TensorSpec
from adamps.optspec import Optimizer, spec_of
from adamps.server.store.store import Store
from adamps.server.updates import kernels
s = Store(n_buckets=4, owner_threads=1, max_shard_elems=100)
try:
    s.define(TensorSpec("w", (10,)), Optimizer.from_dict(spec_of("sgd", 0.1, 0.0, None)),
             {"kind": "zeros"}, None)
    after_sgd = (kernels._loader is None, "numba" in sys.modules)
    s.define(TensorSpec("v", (10,)), Optimizer.from_dict(spec_of("adagrad", 0.1, 0.0, None)),
             {"kind": "zeros"}, None)
    kernels._loader.join(120)
    print(*after_sgd, kernels._fused is not None)
finally:
    s.close()
"""
    r = _run(code)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["True", "False", "True"], r.stdout
