"""Shared fixtures: real processes that are always stopped, and run directories."""

from __future__ import annotations

import atexit
import gc
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from adamps.up.procs import (
    PORT_RANGE_ENV,
    Proc,
    adamps_argv,
    free_port,
    port_range,
    stop_together,
)

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
        """In the stages of `adamps up` (trainers, servers, controllers), each stage at once: one
        process after the other, a teardown took the sum of their shutdowns."""
        procs = list(reversed(self.procs))
        trainers = [p for p in procs if p.name.startswith("train")]
        controllers = [p for p in procs if p.name.startswith("controller")]
        others = [p for p in procs if p not in trainers and p not in controllers]
        for stage in (trainers, others, controllers):
            stop_together(stage, timeout=5)


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[ProcessGroup]:
    group = ProcessGroup(tmp_path)
    try:
        yield group
    finally:
        group.stop_all()


@pytest.fixture(autouse=True)
def _collect_cycles(request: pytest.FixtureRequest) -> Iterator[None]:
    """After each multi-process test, the garbage collector's pass over reference cycles: an
    object left unclosed in a cycle (a client whose connections were not closed: a PSClient is
    one, through its pool's callback) is then found in the test that left it, and its
    ResourceWarning names that test. Found later, by chance, it named whatever test ran then
    (issue 39: an unclosed socket reported twice in test_drain, whose client is closed)."""
    yield
    if request.node.get_closest_marker("slow") is not None:
        gc.collect()


@pytest.fixture
def token() -> str:
    return TOKEN


@pytest.fixture
def port() -> int:
    return free_port()


@pytest.fixture(autouse=True)
def _core_invariants_held(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every server a test starts checks its replication core's invariants after each input
    (ADAMPS_DEBUG_CORE=1, set below; adamps/core/replication/invariants.py): a breach its log shows
    in the test's run directory fails the test, even one a failover hid."""
    yield
    root = request.node.funcargs.get("tmp_path")
    for log in Path(root).rglob("*.log") if root is not None else ():
        text = log.read_text(errors="replace")
        if "InvariantViolation" in text:
            line = next(x for x in text.splitlines() if "InvariantViolation" in x)
            pytest.fail(f"{log}: {line}")


def pytest_configure(config: pytest.Config) -> None:
    # The replication core's invariants checked after every input in every server the tests
    # start (a debugging aid: adamps.server.replication.shell.DEBUG_CORE).
    os.environ.setdefault("ADAMPS_DEBUG_CORE", "1")
    # Child processes and BLAS in the test process: one thread each, so tests behave the same on
    # 2 cores as on 64 and do not oversubscribe the CI machine.
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    # A role started without a token on loopback uses this user's local token file: in tests,
    # one of the test session's own, never the developer's ~/.config/adamps/local-token.
    if "ADAMPS_LOCAL_TOKEN_FILE" not in os.environ:
        tmp = tempfile.mkdtemp(prefix="adamps-tests-")
        atexit.register(shutil.rmtree, tmp, True)
        os.environ["ADAMPS_LOCAL_TOKEN_FILE"] = os.path.join(tmp, "local-token")
    # Under pytest-xdist each worker draws ports from a slice of its own (the processes its tests
    # start inherit it): free_port remembers only what its own process handed out, so two
    # workers sharing one range could pick the same port between a pick and the bind.
    worker, count = (
        os.environ.get("PYTEST_XDIST_WORKER"),
        os.environ.get("PYTEST_XDIST_WORKER_COUNT"),
    )
    if worker and count and PORT_RANGE_ENV not in os.environ:
        low, high = port_range()
        i, n = int(worker.removeprefix("gw")), int(count)
        step = (high - low) // n
        os.environ[PORT_RANGE_ENV] = f"{low + i * step}-{low + (i + 1) * step}"
