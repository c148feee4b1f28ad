"""adamps/wire/logs.py's handler: a record logged on an event loop is written by the listener's
thread; one logged elsewhere at once by its own thread (a trainer's last log line comes before
the result it prints), unless records are still queued (it does not pass them).
tests/system/test_log_off_loop.py checks a real controller whose log pipe is not read."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from logging.handlers import QueueListener

from adamps.wire.logs import OffLoopHandler


class Written(logging.Handler):
    """Each record's message and the thread that wrote it."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[tuple[str, str]] = []
        self.gate = threading.Event()
        self.gate.set()

    def emit(self, record: logging.LogRecord) -> None:
        self.gate.wait(10)
        self.lines.append((record.getMessage(), threading.current_thread().name))


def _logger(handler: logging.Handler) -> logging.Logger:
    log = logging.getLogger(f"test_logs_off_loop.{id(handler)}")
    log.propagate = False
    log.setLevel(logging.INFO)
    log.addHandler(handler)
    return log


def test_on_a_loop_queued_elsewhere_at_once_and_in_order() -> None:
    out = Written()
    records: queue.SimpleQueue = queue.SimpleQueue()
    listener = QueueListener(records, out)
    listener.start()
    log = _logger(OffLoopHandler(out, records))
    try:
        log.info("direct")
        assert out.lines == [("direct", threading.current_thread().name)]

        async def on_the_loop() -> None:
            out.gate.clear()  # the writer waits (a pipe nobody reads)
            log.info("from the loop")  # returns at once: queued
            log.info("from the loop, again")

        asyncio.run(on_the_loop())
        log.info("after")  # queued too: it must not pass the two before it
        out.gate.set()
    finally:
        listener.stop()
    assert [m for m, _ in out.lines] == ["direct", "from the loop", "from the loop, again", "after"]
    me = threading.current_thread().name
    assert all(t != me for _, t in out.lines[1:]), out.lines  # the listener's thread wrote them
