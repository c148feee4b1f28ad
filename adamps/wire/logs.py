"""A log line logged on an event loop is written by a thread of its own, never by the loop.

Every role logs from its event loop (a refused request, a server declared dead, a role change
committed), and writing a line is IO that may wait: stderr is often a pipe (a container's log
collector, `adamps up`'s terminal) that blocks once its reader lags and its 64 KiB buffer is
full, and a file's write may wait for the file system (on ext4 a small append waited 0.13 s
for the journal while other threads of the machine wrote and fsynced: the controllers' Raft
journals, the servers' LMDB). On the loop, such a wait holds every connection of the process
(issue 39's loop-lag probe saw a controller's loop held 0.1-0.25 s during role changes on a
loaded CI machine). So a record logged on a thread that runs an event loop is only queued (its
message and any traceback formatted there, cheaply: `QueueHandler.prepare`), and a
`QueueListener` thread writes it to stderr in the role's format. Any other thread writes its
record at once, as before, unless records are still queued (then it queues too, not to pass
the lines queued before it): a trainer's last log line still comes before the result it
prints. At exit the listener writes what is queued, then stops.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import queue
from logging.handlers import QueueHandler, QueueListener


class OffLoopHandler(logging.Handler):
    """Writes a record with `out` at once, or queues it for the listener thread: on an event
    loop's thread, or while records are queued."""

    def __init__(self, out: logging.Handler, records: queue.SimpleQueue) -> None:
        super().__init__()
        self.out = out
        self.records = records
        self.queued = QueueHandler(records)

    def emit(self, record: logging.LogRecord) -> None:
        if _on_a_loop() or not self.records.empty():
            self.queued.emit(record)
        else:
            self.out.handle(record)


def _on_a_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def setup_logging(level: str = "INFO", role: str = "adamps") -> QueueListener | None:
    """Logs of this process at `level` to stderr, as "<time> <role> <LEVEL> <logger>: <message>",
    those logged on an event loop written by a thread of their own. Like `logging.basicConfig`,
    does nothing where the root logger has a handler already (a test's log capture); returns
    the listener it started."""
    root = logging.getLogger()
    if root.handlers:
        return None
    out = logging.StreamHandler()
    out.setFormatter(logging.Formatter(f"%(asctime)s {role} %(levelname)s %(name)s: %(message)s"))
    records: queue.SimpleQueue[logging.LogRecord] = queue.SimpleQueue()
    listener = QueueListener(records, out)
    root.addHandler(OffLoopHandler(out, records))
    root.setLevel(getattr(logging, level.upper(), logging.INFO))
    listener.start()
    atexit.register(listener.stop)  # writes the records still queued
    return listener
