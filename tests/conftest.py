"""Shared fixtures: real processes that are always stopped, and run directories."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from adamps.up.procs import Proc, adamps_argv, free_port

TOKEN = "test-token"


class ProcessGroup:
    """The processes a test started; every one is stopped at teardown (no orphans)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.procs: list[Proc] = []

    def start(self, name: str, *args: str, env: dict[str, str] | None = None) -> Proc:
        """Starts `adamps ARGS...` with its log in the test's run directory."""
        full_env = {"ADAMPS_TOKEN": TOKEN, "OPENBLAS_NUM_THREADS": "1", **(env or {})}
        proc = Proc(adamps_argv(*args), self.root / "logs" / f"{name}.log", env=full_env, name=name)
        self.procs.append(proc)
        return proc

    def stop_all(self) -> None:
        for p in reversed(self.procs):
            p.stop(timeout=5)


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[ProcessGroup]:
    group = ProcessGroup(tmp_path)
    try:
        yield group
    finally:
        group.stop_all()


@pytest.fixture
def token() -> str:
    return TOKEN


@pytest.fixture
def port() -> int:
    return free_port()


def pytest_configure(config: pytest.Config) -> None:
    # Child processes and BLAS in the test process: one thread each, so tests behave the same on
    # 2 cores as on 64 and do not oversubscribe the CI machine.
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    # A role started without a token on loopback uses this user's local token file: in tests,
    # one of the test session's own, never the developer's ~/.config/adamps/local-token.
    if "ADAMPS_LOCAL_TOKEN_FILE" not in os.environ:
        tmp = tempfile.mkdtemp(prefix="adamps-tests-")
        atexit.register(shutil.rmtree, tmp, True)
        os.environ["ADAMPS_LOCAL_TOKEN_FILE"] = os.path.join(tmp, "local-token")
