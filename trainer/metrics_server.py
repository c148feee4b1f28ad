"""The trainer's /metrics, /status and /healthz (Downpour and Sandblaster trainers alike). Its own
module: trainer/main.py starts a Sandblaster trainer (trainer/sandblaster.py), which serves
this too, so it lived in main.py as an import cycle (issue 26)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from adamps.wire import web as aweb


class MetricsServer:
    """/metrics, /status and /healthz of the trainer, served by aiohttp in a daemon thread
    (the training loop itself is synchronous)."""

    def __init__(self, registry: Any, token: str, status: Any, host: str, port: int) -> None:
        self.port = port
        self._loop = asyncio.new_event_loop()
        self._runner: Any = None
        started = threading.Event()
        errors: list[BaseException] = []

        def run() -> None:
            asyncio.set_event_loop(self._loop)
            try:
                app = aweb.make_app(registry=registry, token=token, status=status)
                self._runner = self._loop.run_until_complete(aweb.serve(app, host, port))
                self.port = self._runner.addresses[0][1]
            except BaseException as exc:  # noqa: BLE001 - reported to the constructor
                errors.append(exc)
                started.set()
                return
            started.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, name="metrics", daemon=True)
        self._thread.start()
        started.wait(30)
        if errors:
            raise errors[0]

    def close(self) -> None:
        if self._runner is not None:
            fut = asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop)
            try:
                fut.result(5)
            except Exception:  # noqa: BLE001 - shutting down anyway
                pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
