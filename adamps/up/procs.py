"""Starting and stopping real processes: used by the tests and by `adamps up`.

Every child is started in its own session (process group), so that stopping it also stops what it
started (worker processes), and a parent that dies takes no orphan with it unnoticed:
``Proc.stop`` sends SIGTERM to the group, waits, then SIGKILL.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from adamps.client.rpc import http_json

#: environment variable naming the pid of the process whose death must end the child
PARENT_ENV = "ADAMPS_DIE_WITH_PARENT"
_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """In a child started by Proc: SIGTERM when the parent process dies (Linux prctl). If the
    parent is already gone (it died between fork and here), exit now."""
    want = os.environ.pop(PARENT_ENV, None)
    if not want or not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != int(want):
        os._exit(1)


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


#: ports free_port handed out in this process: a cluster takes all its ports before it starts
#: a process on any, so "free a moment ago" alone gave one port twice (a controller's Raft port
#: and a server's HTTP port: the server could not bind)
_handed_out: set[int] = set()


#: environment variable "LOW-HIGH": free_port picks only in [LOW, HIGH). The test suite run by
#: several pytest-xdist workers gives each worker its own slice: each worker remembers only its
#: own handed-out ports, so two workers drawing from one range could both pick a port between
#: one's pick and its server's bind (tests/conftest.py)
PORT_RANGE_ENV = "ADAMPS_FREE_PORT_RANGE"


def port_range() -> tuple[int, int]:
    """[low, high) of the ports free_port picks from: below the kernel's ephemeral range, or
    `$ADAMPS_FREE_PORT_RANGE`."""
    lo, _hi = _ephemeral_range()
    low, high = (10_000, lo) if lo > 11_000 else (lo, 65_000)
    want = os.environ.get(PORT_RANGE_ENV)
    if want:
        try:
            a, b = (int(x) for x in want.split("-"))
        except ValueError:
            raise ValueError(
                f"{PORT_RANGE_ENV}={want!r}: expected LOW-HIGH, e.g. 10000-20000"
            ) from None
        if not 1024 <= a < b <= 65_536:
            raise ValueError(f"{PORT_RANGE_ENV}={want!r}: expected 1024 <= LOW < HIGH <= 65536")
        low, high = a, b
    return low, high


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago and that this process has not handed out before,
    chosen below the kernel's ephemeral range: a port the kernel hands out (bind to 0) is also
    what it picks as the source port of outgoing connections, so a server started on it a
    moment later can find it taken. `$ADAMPS_FREE_PORT_RANGE` narrows the range."""
    low, high = port_range()
    for _ in range(200):
        port = random.randrange(low, high)
        if port in _handed_out:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            _handed_out.add(port)
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # crowded: the kernel's choice
        s.bind((host, 0))
        return s.getsockname()[1]


def adamps_argv(*args: str) -> list[str]:
    """The command line of `adamps ARGS...` with this interpreter (works without the console script)."""
    return [sys.executable, "-m", "adamps", *args]


class Proc:
    """One child process with its log file."""

    def __init__(
        self,
        argv: Sequence[str],
        log_path: str | os.PathLike[str],
        env: Mapping[str, str] | None = None,
        name: str | None = None,
    ) -> None:
        self.argv = list(argv)
        self.log_path = Path(log_path)
        self.name = name or Path(self.argv[0]).name
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        full_env = dict(os.environ)
        full_env.setdefault("PYTHONUNBUFFERED", "1")
        # The child asks the kernel for SIGTERM when this process dies (adamps.cli): a parent killed
        # with SIGKILL leaves no orphans behind, although each child runs in its own session.
        full_env[PARENT_ENV] = str(os.getpid())
        if env:
            full_env.update(env)
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()/wait()
        self.popen = subprocess.Popen(
            self.argv,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=full_env,
            start_new_session=True,
        )

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    @property
    def returncode(self) -> int | None:
        return self.popen.poll()

    def wait_http(self, url: str, timeout: float = 30.0) -> None:
        """Waits until GET `url` answers 200; raises (with the log's tail) if the process dies first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive:
                raise RuntimeError(
                    f"{self.name} exited with {self.returncode} before {url} answered:\n{self.tail()}"
                )
            if http_json(url, timeout=1.0)[0] == 200:
                return
            time.sleep(0.05)
        raise TimeoutError(f"{self.name}: {url} did not answer within {timeout}s:\n{self.tail()}")

    def signal(self, sig: int) -> None:
        """Sends `sig` to the process group (the process and its workers)."""
        if self.alive:
            try:
                os.killpg(self.popen.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        """SIGKILL, as a machine failure would."""
        self.signal(signal.SIGKILL)
        self.popen.wait()
        self._log.close()

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM, then SIGKILL after `timeout`; returns the exit code."""
        if self.alive:
            self.signal(signal.SIGCONT)  # a paused process cannot handle SIGTERM
            self.signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.signal(signal.SIGKILL)
                self.popen.wait()
        # Workers of a process that exited may still run in its group.
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self._log.close()
        return self.popen.returncode

    def tail(self, n: int = 40) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])

    def summary(self) -> dict[str, Any]:
        """The last JSON object the process printed on a line of its own (a trainer's figures,
        its last stdout line): the log also holds stderr, where a warning at exit (a shared
        memory segment's resource tracker) may come after it."""
        for line in reversed(self.tail(200).splitlines()):
            if line.startswith("{"):
                try:
                    out = json.loads(line)
                except ValueError:
                    continue
                if isinstance(out, dict):
                    return out
        raise ValueError(f"{self.name} printed no JSON summary; its output ends: {self.tail(5)}")


def stop_together(procs: Sequence[Proc], timeout: float = 10.0) -> None:
    """Stops `procs` at once: SIGTERM to each, then each waited for until one shared deadline
    (SIGKILL after it). A parameter server takes seconds to stop (its final flush): one after
    the other, a test cluster's teardown took the sum of them."""
    for p in procs:
        if p.alive:
            p.signal(signal.SIGCONT)  # a paused process cannot handle SIGTERM
            p.signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for p in procs:
        p.stop(timeout=max(0.1, deadline - time.monotonic()))
