"""A role's log lines are written by a thread of their own, never by the thread that logs them.

Every role logs from its event loop (a refused request, a server declared dead, a role change
committed), and writing a line is IO that may wait: stderr is often a pipe (a container's log
collector, `adamps up`'s terminal) that blocks once its reader lags and its 64 KiB buffer is
full, and a file's write may wait for the file system (on ext4 a small append waited 0.13 s
for the journal while other threads of the machine wrote and fsynced: the controllers' Raft
journals, the servers' LMDB). On the loop, such a wait holds every connection of the process
(issue 39's loop-lag probe saw a controller's loop held 0.1-0.25 s during role changes on a
loaded CI machine). So the root logger's one handler only queues the record
(`logging.handlers.QueueHandler`: the message and any traceback are formatted there, on the
caller's thread, cheaply), and a `QueueListener` thread writes it to stderr in the role's
format. At exit the listener writes what is queued, then stops.
"""

from __future__ import annotations

import atexit
import logging
import queue
from logging.handlers import QueueHandler, QueueListener


def setup_logging(level: str = "INFO", role: str = "adamps") -> QueueListener | None:
    """Logs of this process at `level` to stderr, as "<time> <role> <LEVEL> <logger>: <message>",
    written by a thread of their own. Like `logging.basicConfig`, does nothing where the root
    logger has a handler already (a test's log capture); returns the listener it started."""
    root = logging.getLogger()
    if root.handlers:
        return None
    out = logging.StreamHandler()
    out.setFormatter(logging.Formatter(f"%(asctime)s {role} %(levelname)s %(name)s: %(message)s"))
    records: queue.SimpleQueue[logging.LogRecord] = queue.SimpleQueue()
    listener = QueueListener(records, out)
    root.addHandler(QueueHandler(records))
    root.setLevel(getattr(logging, level.upper(), logging.INFO))
    listener.start()
    atexit.register(listener.stop)  # writes the records still queued
    return listener
