"""Copies between a model's device and the host, through buffers reused step after step.

The servers speak float32 numpy arrays; a model's parameters may live on any torch device and be
float32, bfloat16 or float16. Two directions:

- **to the host** (gradients, act/err rows, embedding row gradients): ``to_host`` converts a
  tensor to float32 *on its device* (a no-op for float32), then enqueues its copy into this
  stage's host buffer for that key, ``non_blocking`` on CUDA (the buffers are pinned there, so
  the copy is a real asynchronous DMA). ``wait()`` then synchronizes each device that has copies
  in flight **once**: one synchronize per step, not one per tensor. Only after ``wait()`` may the
  arrays be read.
- **to the device** (the servers' values): ``value_buffers`` hands out the host buffers to
  pull into (after waiting for the previous step's copies out of them: a pinned buffer must not be
  rewritten while the device still reads it), ``to_device`` enqueues the ``non_blocking`` copies
  into the parameters and records one event that the next ``value_buffers`` waits for.

A contiguous float32 tensor on the CPU needs no copy at all: ``to_host`` returns a numpy view of its memory
and ``value_buffers`` the parameter's own memory (what adamps.torch always did on the CPU).
Anything else (a CPU bfloat16 parameter, a CUDA one) goes through the buffers: the same code
path on every device, which is what lets the CPU tests cover it.

A buffer is allocated the first time its key is seen, and again only when a larger tensor comes
under that key (capacity doubles: row counts vary per batch); ``allocations`` counts them. The
arrays handed out are views of the buffers: valid until the next call with the same key. A
caller that keeps one longer copies it. One stage belongs to one thread.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import Any

import numpy as np
import torch

#: the parameter dtypes that float32 (what the servers hold) represents exactly
PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def direct(t: torch.Tensor) -> bool:
    """Whether `t` is float32 in CPU memory laid out in row-major order: numpy reads and writes
    it in place. A tensor in another memory format (a conv weight after
    ``model.to(memory_format=torch.channels_last)``) is not: its numpy view is not C-ordered,
    which the servers' arrays are, so it goes through the buffers like a bfloat16 one."""
    return t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous()


def _async(device: torch.device) -> bool:
    """Copies are enqueued (non_blocking) only on CUDA, from and to pinned memory; elsewhere a
    copy is complete when it returns."""
    return device.type == "cuda"


class HostStage:
    """Reusable host buffers for one thread's copies (see the module docstring)."""

    def __init__(self) -> None:
        self._bufs: dict[Hashable, torch.Tensor] = {}
        #: host buffers allocated so far: constant once every key has seen its largest tensor
        self.allocations = 0
        #: device synchronizations waited for (one per ``wait()`` with copies in flight)
        self.syncs = 0
        self._in_flight: set[torch.device] = set()
        #: the events after the last copies out of the value buffers (CUDA, one per device)
        self._values_copied: list[Any] = []
        #: the event after the last copy out of each rows buffer (CUDA)
        self._rows_copied: dict[Hashable, Any] = {}

    def __deepcopy__(self, memo: dict[int, Any]) -> HostStage:
        return HostStage()  # a copied module (a Hogwild twin) gets buffers of its own

    def __reduce__(self) -> tuple[Any, ...]:
        return (HostStage, ())  # a pickled module (torch.save) carries no buffers nor events

    def buffer(self, key: Hashable, n: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
        """`n` elements of the buffer `key` (flat), allocated only when it is too small."""
        buf = self._bufs.get(key)
        if buf is None or buf.numel() < n or buf.dtype != dtype:
            size = n if buf is None or buf.dtype != dtype else max(n, 2 * buf.numel())
            buf = torch.empty(size, dtype=dtype, pin_memory=pin)
            self._bufs[key] = buf
            self.allocations += 1
        return buf[:n]

    # -- device -> host -----------------------------------------------------------------------

    def to_host(self, key: Hashable, t: torch.Tensor | np.ndarray) -> np.ndarray:
        """`t` as a flat float32 array on the host; read it only after ``wait()``. (A numpy
        array, already on the host, is returned as it is, flat.)"""
        if isinstance(t, np.ndarray):
            return np.asarray(t, np.float32).reshape(-1)
        t = t.detach()
        if direct(t):
            return t.reshape(-1).numpy()
        dev = t.device
        if dev.type != "cpu" and t.dtype != torch.float32:
            t = t.to(torch.float32)  # converted on the device: the copy below is a plain DMA
        buf = self.buffer(("host", key), t.numel(), torch.float32, pin=dev.type == "cuda")
        buf.copy_(t.reshape(-1), non_blocking=_async(dev))
        if _async(dev):
            self._in_flight.add(dev)
        return buf.numpy()

    def wait(self) -> None:
        """Waits for every copy ``to_host`` enqueued: one synchronize per device."""
        for dev in self._in_flight:
            torch.cuda.current_stream(dev).synchronize()
            self.syncs += 1
        self._in_flight.clear()

    # -- host -> device -----------------------------------------------------------------------

    def value_buffers(self, params: Iterable[Any]) -> dict[str, np.ndarray]:
        """Server tensor -> the float32 array its values are pulled into (server shape): the
        parameter's own memory when ``direct``, else this stage's host buffer (pinned on CUDA),
        free again once the previous ``to_device`` copies out of it are done."""
        params = list(params)
        for ev in self._values_copied:
            ev.synchronize()
        self._values_copied = []
        out = {}
        for p in params:
            shape = p.shape or (1,)
            if direct(p.param):
                out[p.tensor] = p.param.detach().numpy().reshape(shape)
                continue
            pin = p.param.device.type == "cuda"
            buf = self.buffer(("value", p.tensor), p.param.numel(), torch.float32, pin)
            out[p.tensor] = buf.numpy().reshape(shape)
        return out

    def to_device(self, params: Iterable[Any]) -> None:
        """Copies the value buffers (filled since ``value_buffers``) into the parameters (in
        place), ``non_blocking`` on CUDA, and records the event the next ``value_buffers``
        waits for."""
        enqueued: set[torch.device] = set()
        with torch.no_grad():
            for p in params:
                if direct(p.param):
                    continue  # pulled in place
                dev = p.param.device
                # the buffer itself (pinned on CUDA) rather than a tensor over its numpy view
                src = self._bufs[("value", p.tensor)][: p.param.numel()].reshape(p.param.shape)
                if dev.type != "cpu" and p.param.dtype != torch.float32:
                    src = src.to(dev, non_blocking=_async(dev))  # float32 there, then converted
                p.param.copy_(src, non_blocking=_async(dev))
                if _async(dev):
                    enqueued.add(dev)
        for dev in enqueued:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(dev))
            self._values_copied.append(ev)

    def rows_to_device(
        self, key: Hashable, rows: np.ndarray, device: torch.device, dtype: torch.dtype
    ) -> torch.Tensor:
        """Pulled embedding rows (float32, host) as a new tensor on `device` in `dtype`:
        through a pinned buffer and a ``non_blocking`` copy on CUDA; no copy for float32 on the
        CPU."""
        t = torch.from_numpy(rows)
        if device.type == "cpu":
            return t if dtype == torch.float32 else t.to(dtype)
        ev = self._rows_copied.pop(key, None)
        if ev is not None:  # the previous forward's copy out of this buffer is done
            ev.synchronize()
        buf = self.buffer(("rows", key), t.numel(), torch.float32, pin=device.type == "cuda")
        buf.copy_(t.reshape(-1))
        out = buf.reshape(t.shape).to(device, non_blocking=_async(device))
        if _async(device):
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(device))
            self._rows_copied[key] = ev
        return out if dtype == torch.float32 else out.to(dtype)
