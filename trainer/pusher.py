"""The push thread: sends the queued rounds to the parameter servers, in order.

Per tensor it sends what ``push_parts`` (trainer/packing.py) chose: fc vectors or the dense
delta, rescaled from the workers' units (``-local_lr * gradient``) to gradients; with
``--compress`` the compressor (adamps/compression/error_feedback.py) may replace any part by Strom's threshold-
quantized update. Markers in the queue (callables) run here in order, so a marker runs once
every push queued before it is acknowledged.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from adamps.client import PSClient
from trainer.metrics import TrainerMetrics
from trainer.packing import PushItem, push_parts
from trainer.push_queue import PushQueue


class Pusher:
    """The push thread's work (``loop`` is its target). Its counters are written by that
    thread only; the main thread reads them once it has stopped."""

    def __init__(
        self,
        client: PSClient,
        queue: PushQueue,
        metrics: TrainerMetrics,
        local_lr: float,
        shapes: Mapping[str, tuple[int, ...]],
        compressor: Any = None,
    ) -> None:
        self.client = client
        self.queue = queue
        self.m = metrics
        self.inv = -1.0 / local_lr  #: workers' units -> gradients
        self.shapes = dict(shapes)
        #: Strom's compression with a residual per tensor, with --compress
        self.compressor = compressor
        #: array payload bytes pushed (dense deltas, vectors, compressed updates)
        self.bytes_pushed = 0
        #: pushes (queue items sent, each one or more rounds of the workers)
        self.pushes = 0
        #: elements sent / elements offered by the compressor (None without --compress)
        self.sent_fraction: float | None = None
        self._comp_totals = [0, 0]  #: elements sent, elements offered to the compressor

    def loop(self) -> None:
        """Until a None item: push items, run markers."""
        while True:
            item = self.queue.get()
            try:
                if item is None:
                    return
                if callable(item):
                    item()
                    continue
                self.push(item)
            finally:
                self.queue.done()
                self.m.queue.set(len(self.queue))

    def push(self, item: PushItem) -> None:
        """One item: its fc vectors, dense deltas and compressed updates (with --compress) in
        one round, one request per server (``PSClient.round``)."""
        client = self.client
        dense: dict[str, np.ndarray] = {}
        fc: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        compressed: dict[str, dict[str, Any]] = {}
        parts = push_parts(item, self.inv, self.shapes)
        self.pushes += 1
        if self.compressor is not None:
            parts, st = self.compressor.compress(parts)
            self._count_compression(st)
        for kind, name, *arrays in parts:
            if kind == "fc":
                fc[name] = (arrays[0], arrays[1])
                self.m.pushes.labels("fc").inc()
            elif kind == "compressed":
                compressed.update(arrays[0].shards)
                self.m.bytes_pushed.labels(kind).inc(arrays[0].nbytes)
                self.bytes_pushed += arrays[0].nbytes
                continue
            else:
                dense[name] = arrays[0]
            nbytes = sum(x.nbytes for x in arrays)
            self.m.bytes_pushed.labels(kind).inc(nbytes)
            self.bytes_pushed += nbytes
        if fc or dense or compressed:
            # one round, one request per server (adamps/client/round.py), checked whole first
            client.round(fc, dense, compressed=compressed)
            if dense:
                self.m.pushes.labels("dense").inc()
            if compressed:
                self.m.pushes.labels("compressed").inc()

    def _count_compression(self, st: Any) -> None:
        assert self.compressor is not None
        m = self.m
        for form, n in st.choices.items():
            m.comp_choices.labels(form).inc(n)
        m.comp_saved.inc(max(0, st.bytes_uncompressed - st.bytes_sent))
        m.comp_sent.inc(st.sent_elements)
        m.comp_elements.inc(st.elements)
        if st.elements:
            m.comp_fraction.set(st.sent_elements / st.elements)
        self._comp_totals[0] += st.sent_elements
        self._comp_totals[1] += st.elements
        self.sent_fraction = self._comp_totals[0] / max(1, self._comp_totals[1])
        for name, tc in self.compressor.tensors.items():
            m.comp_residual.labels(name).set(tc.residual_norm())
            m.comp_tau.labels(name).set(tc.last_tau)
