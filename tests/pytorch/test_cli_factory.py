"""`adamps train --torch` names a bad factory and exits 2 before reaching any server (issue 22):
a factory that does not return a Module, a module that does not exist, a missing attribute."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="adamps.torch needs torch")

from adamps.up.procs import adamps_argv  # noqa: E402


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("usermodels:not_a_model", "the factory returned a int, expected a torch.nn.Module"),
        ("no_such_module:Net", "cannot import module 'no_such_module'"),
        ("usermodels:Missing", "module 'usermodels' has no callable 'Missing'"),
    ],
)
def test_bad_factory_exits_2(tmp_path: Path, spec: str, message: str) -> None:
    (tmp_path / "usermodels.py").write_text("def not_a_model():\n    return 42\n")
    env = {**os.environ, "ADAMPS_TOKEN": "test-token-cli"}
    # an address where nothing listens: the factory is checked before any connection
    out = subprocess.run(
        adamps_argv("train", "--torch", spec, "--ps", "http://127.0.0.1:9", "--metrics-port", "-1"),
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=100,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr[-2000:]
    assert message in out.stderr, out.stderr[-2000:]
