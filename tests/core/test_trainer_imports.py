"""What a trainer process and each of its spawned Hogwild workers import (issue 27).

Every trainer and every worker process (spawned: a fresh interpreter) pays for its imports in
CPU seconds, and a training cluster's images per CPU second counts them. The server's numba
kernels (adamps.server.updates.kernels, loaded through adamps.server.updates.optim) cost about a CPU second
per process; scipy a few tenths. Neither is needed to train: the workers run numpy only, and
the replica's main thread loads scipy's BLAS on its first install of a fetch.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ("numba", "scipy", "adamps.server")


def _imported(code: str) -> list[str]:
    probe = f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    mods = json.loads(out.strip().splitlines()[-1])
    return sorted({h for h in HEAVY for m in mods if m == h or m.startswith(h + ".")})


@pytest.mark.timeout(120)
def test_a_hogwild_worker_imports_neither_numba_nor_scipy_nor_the_server() -> None:
    # what a spawned worker process imports: the pool and the factory's module
    # (trainer.packing.downpour_worker_factory), then builds a model
    code = (
        "import trainer.hogwild, trainer.packing\n"
        "from trainer.model import Model, resolve_spec\n"
        "Model(resolve_spec('adam-mnist'))"
    )
    assert _imported(code) == []


@pytest.mark.timeout(120)
def test_a_replica_does_not_import_the_servers_kernels() -> None:
    assert _imported("import trainer.main, trainer.downpour") == []
