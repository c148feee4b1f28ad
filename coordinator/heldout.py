"""The held-out accuracy of each L-BFGS iterate, for the run's plot and `/status` (issue 26:
`adamps up --algorithm sandblaster` drew an empty plot, as it only knew Downpour's epochs).

After iteration k ends, its iterate x_k is the vector ``x<k % 2>`` beside every parameter tensor
(coordinator/lbfgs.py); this pulls it and measures the model on the source's held-out images
(the same split the trainers hold out). One pull of the model and one forward pass per
iteration, in the optimizer's thread between two iterations.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from adamps.client import PSClient
from adamps.layout import VECTOR_SEP, TensorSpec
from trainer.model import Model


class HeldoutMeter:
    """Measures iterates and appends one JSON line per iteration to `history` (if set)."""

    def __init__(
        self,
        spec: Any,
        source: Any,
        client: PSClient,
        tensors: list[TensorSpec],
        prefix: str,
        history: str = "",
    ) -> None:
        self.model = Model(spec)
        self.x = self.model.prepare(source.test_x)
        self.y = np.asarray(source.test_y)
        self.client = client
        self.tensors = tensors
        self.prefix = prefix
        self.history = Path(history) if history else None

    def measure(self, k: int) -> float:
        """Held-out accuracy of iterate x_k."""
        names = []
        layout = self.client.layout
        for t in self.tensors:
            name = f"{t.name}{VECTOR_SEP}x{k % 2}"
            if name not in layout.tensors:
                layout = self.client.layout = layout.with_tensor(TensorSpec(name, t.shape))
            names.append(name)
        values, _ = self.client.pull(names)
        for t, name in zip(self.tensors, names, strict=True):
            self.model.param(t.name[len(self.prefix) :])[...] = values[name]
        return float(self.model.accuracy(self.x, self.y))

    def record(self, k: int, f: float | None) -> dict[str, Any]:
        """Measures x_k and appends {time, iteration, loss, heldout_accuracy} to the history."""
        rec = {"time": time.time(), "iteration": k, "loss": f, "heldout_accuracy": self.measure(k)}
        if self.history is not None:
            with self.history.open("a") as fh:
                fh.write(json.dumps(rec) + "\n")
        return rec
