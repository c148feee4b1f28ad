"""What a controller process imports: every test cluster starts three of them (and every
`adamps up` too), and each pays for its imports in CPU seconds at its start and its exit.

The servers' numba kernels (adamps.server.updates.kernels, loaded through the optimizers and the
checkpoint restore's state checks) cost about half a CPU second per process and half the
controller's start; a controller saves checkpoints (its schedule) but never restores one, and
applies no update."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.timeout(120)
def test_a_controller_does_not_import_the_servers_kernels() -> None:
    probe = "import controller.main, json, sys\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    mods = json.loads(out.strip().splitlines()[-1])
    heavy = sorted(m for m in mods if m == "numba" or m.startswith("adamps.server.updates"))
    assert heavy == [], heavy
