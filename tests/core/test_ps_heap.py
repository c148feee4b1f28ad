"""A parameter server freezes its startup heap before it serves (issue 36's profile: full
collections walking ~170,000 startup objects took about a tenth of a server's CPU in training)."""

from __future__ import annotations

import gc
import re
import subprocess
import sys
import time

import pytest

from adamps.server.main import freeze_startup_heap


def test_freeze_moves_what_is_alive_out_of_the_collections() -> None:
    kept = [[i] for i in range(1000)]  # alive now: frozen with the rest
    try:
        frozen = freeze_startup_heap()
        assert frozen >= len(kept)
        assert frozen == gc.get_freeze_count()
        assert len(gc.get_objects()) < frozen  # the full collection's walk: what came after
    finally:
        gc.unfreeze()  # the rest of this test process collects as before


@pytest.mark.slow
def test_a_started_server_has_frozen_its_startup_heap(tmp_path) -> None:  # type: ignore[no-untyped-def]
    proc = subprocess.Popen(
        [sys.executable, "-m", "adamps", "ps", "--port", "0", "--data-dir", str(tmp_path),
         "--log-level", "INFO"],
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        frozen = None
        assert proc.stderr is not None
        while time.monotonic() < deadline and frozen is None:
            line = proc.stderr.readline()
            if not line:
                break
            if m := re.search(r"startup heap frozen: (\d+) objects", line):
                frozen = int(m.group(1))
        assert frozen is not None, "the server did not say that it froze its startup heap"
        assert frozen > 20_000  # the imported modules and the server as built
    finally:
        proc.terminate()
        proc.wait(30)
