"""Every package the code and the tests import is declared in pyproject.toml (issue 10).

A fresh virtualenv once lacked `cryptography`, which pysyncobj imports lazily for the Raft password,
and `wheel`, which the Dockerfile test builds with: the system Python of the CI machine held both,
so nothing failed there. deptry reads every import of the tree (tests and benchmarks included) and
the declared dependencies; the lazy imports of other packages are checked here by name.
"""

from __future__ import annotations

import importlib.metadata
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_every_import_is_a_declared_dependency() -> None:
    deptry = shutil.which("deptry", path=str(Path(sys.executable).parent)) or shutil.which("deptry")
    assert deptry is not None, "deptry is a test dependency: pip install -e '.[test]'"
    out = subprocess.run(
        [deptry, str(ROOT)], cwd=ROOT, capture_output=True, text=True, timeout=120
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr


def test_raft_password_encryption_is_installed() -> None:
    # pysyncobj swallows the ImportError and fails only when a controller starts with a password.
    from pysyncobj.encryptor import HAS_CRYPTO

    assert HAS_CRYPTO, "pysyncobj needs 'cryptography' for the Raft password"


@pytest.mark.parametrize("dist", ["cryptography", "setuptools", "wheel", "deptry", "pyyaml"])
def test_lazily_used_distributions_are_installed(dist: str) -> None:
    importlib.metadata.version(dist)  # raises PackageNotFoundError when not installed


def test_lazy_extras_are_declared_in_their_extra() -> None:
    """adamps/extras.py names, for each optional package, the extra that installs it; that
    extra lists it in pyproject.toml, and the roles' own dependencies do not (issue 37)."""
    import tomllib

    from adamps.extras import DIST, EXTRA

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

    def names(reqs: list[str]) -> set[str]:
        import re

        return {re.split(r"[<>=!~; \[]", r, maxsplit=1)[0].lower() for r in reqs}

    core = names(project["dependencies"])
    for module, extra in EXTRA.items():
        dist = DIST.get(module, module).lower()
        assert dist in names(project["optional-dependencies"][extra]), (module, extra)
        assert dist not in core, f"{dist} is a core dependency: the roles must not need it"
