"""The fetch thread: Downpour's parameter fetch (DistBelief 4.1), pulled into a staging buffer
in the background; the replica's main thread installs it between two rounds."""

from __future__ import annotations

import threading

import numpy as np

from adamps.client import PSClient
from trainer.loop import Loop
from trainer.model import Model


class Fetcher:
    """Pulls every tensor into a staging buffer when asked; the main thread installs it."""

    def __init__(self, client: PSClient, model: Model) -> None:
        self.client = client
        self.names = [n for n, _ in model.tensors()]
        self.staging = np.zeros(model.n_params, np.float32)
        sl = model.slices()
        self.out = {n: self.staging[sl[n]].reshape(s) for n, s in model.tensors()}
        self._want = threading.Event()
        self._ready = threading.Event()
        self._stop = False
        self.requested_at = 0  #: replica step of the pending request
        self.pending = False
        self.thread = Loop("fetch", self._run)

    def request(self, step: int) -> None:
        self.requested_at = step
        self.pending = True
        self._ready.clear()
        self._want.set()

    def ready(self) -> bool:
        return self.pending and self._ready.is_set()

    def take(self) -> np.ndarray:
        self.pending = False
        return self.staging

    def _run(self) -> None:
        while True:
            self._want.wait()
            self._want.clear()
            if self._stop:
                return
            self.client.pull(self.names, out=self.out)
            self._ready.set()

    def stop(self) -> None:
        self._stop = True
        self._want.set()
