"""The start-up every role shares (`adamps controller|ps|dataserver|train`): its argument parser
from its configuration dataclass, the configuration itself (flags > environment > TOML >
defaults), logging, and the lock on its data directory. A bad value stops the process with a
message naming it and exit code 2."""

from __future__ import annotations

import argparse
import errno
import fcntl
import logging
import os
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from adamps import config
from adamps.security import tls
from adamps.wire import logs

C = TypeVar("C")


def role_parser(prog: str, description: str, cls: type) -> argparse.ArgumentParser:
    """The parser of `adamps <role>`: one flag per field of the role's configuration."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    config.add_arguments(parser, cls)
    tls.add_arguments(parser)
    return parser


def run_role(
    parser: argparse.ArgumentParser,
    cls: type[C],
    section: str,
    argv: Sequence[str] | None,
    serve: Callable[[C], int],
    log_name: Callable[[C], str] | None = None,
) -> int:
    """Parses `argv`, loads the `[section]` configuration, sets up logging (named `log_name(cfg)`,
    default the section), then runs `serve(cfg)` and returns its exit code."""
    args = parser.parse_args(sys.argv[1:] if argv is None else list(argv))
    try:
        cfg: Any = config.load(cls, section, args)
        # one [tls] table for every role: this process's listeners and its clients alike
        tls.install(tls.load(args))
        if tls.enabled():  # every role listens (at least /healthz): it needs its certificate
            tls.server_context()
    except config.ConfigError as exc:
        print(f"{parser.prog}: {exc}", file=sys.stderr)
        return 2
    logs.setup_logging(cfg.log_level, log_name(cfg) if log_name else section)
    try:
        if getattr(cfg, "data_dir", ""):  # one process per data directory (below)
            lock_data_dir(cfg.data_dir, section)
        return serve(cfg)
    except OSError as exc:
        # a directory or address the role cannot use (a data dir it cannot create, a port in
        # use): one line naming it, not a traceback; the traceback at debug level
        log = logging.getLogger(section)
        log.error("%s cannot run: %s", parser.prog, exc)
        log.debug("the error", exc_info=True)
        return 1


# -- one process per data directory ----------------------------------------------------------
#
# One process per data directory: a role that keeps state on disk (a parameter server's LMDB, a
# controller's Raft journal) holds a lock on ``DATA_DIR/adamps.lock`` for as long as it runs.
#
# The same `adamps ps --data-dir run/ps1` typed twice (with another port, or the first one still
# running in another terminal) opened the same LMDB environment in two servers, each flushing its
# own copies over the other's, and two controllers on one directory shared a Raft journal. The
# second one now stops at once naming the directory and the process that holds it.
#
# A POSIX record lock (``fcntl.lockf``): the kernel releases it when the process dies, however it
# dies (SIGKILL included), so a restart after a crash is never refused; it is not inherited by
# forked children (a controller forks to write its Raft dumps), so a child outliving its parent
# never keeps the directory.

LOCK_NAME = "adamps.lock"

#: the descriptors of the locks this process holds (closing one would release its lock)
_held: dict[str, int] = {}


class DataDirInUse(OSError):
    """The directory is locked by another process (the message names it and that process)."""


def lock_data_dir(data_dir: str | os.PathLike[str], role: str) -> None:
    """Locks `data_dir` (made if missing) for this process, or raises DataDirInUse. A second
    call for the same directory in the same process is a no-op (POSIX locks are per process:
    the in-process test clusters start several roles in one process)."""
    path = Path(data_dir)
    path.mkdir(parents=True, exist_ok=True)
    key = str(path.resolve())
    if key in _held:
        return
    fd = os.open(path / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        holder = _holder(fd)
        os.close(fd)
        if exc.errno not in (errno.EACCES, errno.EAGAIN):
            raise
        raise DataDirInUse(
            f"data directory {path} is in use by another process ({holder}); stop it first, or "
            "give this one its own --data-dir",
        ) from None
    _held[key] = fd
    # Who holds it, for the message above: written on a thread of its own, because a write to
    # a stalled disk (a frozen or failing filesystem) blocks until the disk comes back, and a
    # server must start and serve its reads meanwhile (tests/chaos/test_storage_faults.py).
    threading.Thread(
        target=_note_holder, args=(fd, role), name="data-dir-lock", daemon=True
    ).start()


def _note_holder(fd: int, role: str) -> None:
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {role}\n".encode(), 0)
    except OSError:
        pass  # only the message of a second process loses its pid


def _holder(fd: int) -> str:
    try:
        pid, _, role = os.pread(fd, 200, 0).decode(errors="replace").strip().partition(" ")
    except OSError:
        return "pid unknown"
    return f"adamps {role}, pid {pid}" if pid.isdigit() else "pid unknown"
