"""Hogwild (Project Adam 3.2.1-3.2.2): several workers update one shared copy of the weights
without locks.

The weights are one flat float32 buffer. In the default "process" mode it lives in
``multiprocessing.shared_memory`` and each worker is a spawned process with its own interpreter,
so the workers' numpy glue code runs in parallel; in "thread" mode the workers are threads of
this process sharing an ordinary array. benchmarks/trainer.py measures both. From 1 to 2
workers on 2 vCPUs (adam-mnist, quiet machine), processes scaled 1.54x (batch 1), 1.90x
(batch 8) and 2.01x (batch 32); threads 0.69x, 1.14x and 1.40x: the GIL serialises the many
small numpy calls between the BLAS calls, so threads only gain at large batches. Hence
processes by default.

Usage::

    with Hogwild(factory, n_workers=2, params=initial) as pool:
        results = pool.run([task_for_worker0, task_for_worker1])
        pool.params  # the shared weights, live

``factory(worker_id, params)`` runs once inside each worker and returns its step function
``handle(task) -> result``; ``params`` is the worker's view of the shared buffer. Extra shared
float32 buffers (e.g. an accumulator of deltas a Downpour push thread drains) are asked for
with ``buffers={"name": size}``: the factory is then called as
``factory(worker_id, params, buffers)`` and the owner sees them as ``pool.buffers``. In process
mode factory, tasks and results are pickled, so the factory must be importable (a module-level
function or a functools.partial of one). Each worker's BLAS is pinned to ``blas_threads``
threads: two workers on two cores with two BLAS threads each would oversubscribe the cores.

Workers stop on ``close()``; a process worker also stops by itself within about a second when
its parent dies, so a SIGKILLed trainer leaves no orphans behind.
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing as mp
import queue
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from multiprocessing import shared_memory
from typing import Any

import numpy as np
from threadpoolctl import threadpool_limits

MODES = ("process", "thread")
#: chosen by benchmarks/trainer.py (see the module docstring)
DEFAULT_MODE = "process"

Handle = Callable[[Any], Any]
#: factory(worker_id, params) or, with extra buffers, factory(worker_id, params, buffers)
WorkerFactory = Callable[..., Handle]

_STOP = "__hogwild_stop__"
_POLL_S = 0.5  # how often an idle worker checks that its parent is still alive


def _release(shm: shared_memory.SharedMemory) -> None:
    """Close a segment's mapping, or, while numpy views of it are alive, hand the mapping
    over to them (it is unmapped with the last view) instead of raising BufferError now or
    from SharedMemory.__del__ later."""
    try:
        shm.close()
    except BufferError:
        shm._buf = None  # type: ignore[attr-defined]
        shm._mmap = None  # type: ignore[attr-defined]


class HogwildError(RuntimeError):
    """A worker failed (its traceback is in the message) or died."""


def _views(flat: np.ndarray, sizes: dict[str, int]) -> dict[str, np.ndarray]:
    """Consecutive named pieces of one flat buffer."""
    out, offset = {}, 0
    for name, size in sizes.items():
        out[name] = flat[offset : offset + size]
        offset += size
    return out


def _serve(
    worker_id: int,
    factory: WorkerFactory,
    arrays: dict[str, np.ndarray],
    tasks: Any,
    results: Any,
    parent_alive: Callable[[], bool],
) -> None:
    """A worker's loop: build the step function, then run tasks until told to stop."""
    try:
        extra = {k: v for k, v in arrays.items() if k != "params"}
        if extra:
            handle = factory(worker_id, arrays["params"], extra)
        else:
            handle = factory(worker_id, arrays["params"])
    except BaseException:
        results.put((worker_id, "error", traceback.format_exc()))
        return
    results.put((worker_id, "ready", None))
    while True:
        try:
            task = tasks.get(timeout=_POLL_S)
        except queue.Empty:
            if not parent_alive():
                return
            continue
        if isinstance(task, str) and task == _STOP:
            return
        try:
            results.put((worker_id, "ok", handle(task)))
        except BaseException:
            results.put((worker_id, "error", traceback.format_exc()))


def _process_main(
    worker_id: int,
    shm_name: str,
    sizes: dict[str, int],
    factory: WorkerFactory,
    tasks: Any,
    results: Any,
    blas_threads: int,
) -> None:
    threadpool_limits(blas_threads)
    # Attaching registers the name with the resource tracker again; a spawned child shares
    # its parent's tracker, whose registry is a set, so that is a no-op (unregistering here
    # would make the parent's unlink fail), and the parent's unlink stays the one release.
    shm = shared_memory.SharedMemory(name=shm_name)
    flat = np.ndarray((sum(sizes.values()),), dtype=np.float32, buffer=shm.buf)
    arrays = _views(flat, sizes)
    parent = mp.parent_process()
    try:
        _serve(
            worker_id,
            factory,
            arrays,
            tasks,
            results,
            lambda: parent is None or parent.is_alive(),
        )
    finally:
        del flat, arrays
        gc.collect()
        _release(shm)


class Hogwild:
    """N workers sharing one flat float32 parameter buffer, updated without locks.

    The pool object is used from one thread. ``params`` may be read or overwritten by that
    thread at any time (e.g. with parameters fetched from a parameter server); the workers
    see the change at once, as they see each other's updates.
    """

    def __init__(
        self,
        factory: WorkerFactory,
        n_workers: int,
        params: np.ndarray,
        mode: str = DEFAULT_MODE,
        blas_threads: int = 1,
        start_timeout: float = 60.0,
        buffers: dict[str, int] | None = None,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if n_workers < 1:
            raise ValueError("n_workers must be >= 1")
        params = np.asarray(params)
        if params.ndim != 1 or params.dtype != np.float32:
            raise ValueError("params must be a flat float32 array")
        buffers = dict(buffers or {})
        if "params" in buffers or any(int(v) < 0 for v in buffers.values()):
            raise ValueError("extra buffers need sizes >= 0 and a name other than 'params'")
        sizes = {"params": params.size, **{k: int(v) for k, v in buffers.items()}}
        total = sum(sizes.values())
        self.mode = mode
        self.n_workers = n_workers
        self._shm: shared_memory.SharedMemory | None = None
        self._limits: Any = None
        self._workers: list[Any] = []
        self._tasks: list[Any] = []
        self._results: Any = None
        self.buffers: dict[str, np.ndarray] = {}
        self._closed = False
        self._broken = False  # a worker died or timed out: its round's replies are unknown
        if mode == "process":
            ctx = mp.get_context("spawn")  # fork is unsafe once the trainer runs threads
            self._shm = shared_memory.SharedMemory(create=True, size=max(total * 4, 1))
            flat = np.ndarray((total,), np.float32, buffer=self._shm.buf)
            flat[...] = 0.0
            arrays = _views(flat, sizes)
            self._results = ctx.Queue()
            self._tasks = [ctx.Queue() for _ in range(n_workers)]
            for i in range(n_workers):
                proc = ctx.Process(
                    target=_process_main,
                    args=(
                        i,
                        self._shm.name,
                        sizes,
                        factory,
                        self._tasks[i],
                        self._results,
                        blas_threads,
                    ),
                    name=f"hogwild-{i}",
                    daemon=True,
                )
                self._workers.append(proc)
        else:
            # threadpoolctl's limit is process wide: it holds for the pool's lifetime
            self._limits = threadpool_limits(blas_threads)
            arrays = _views(np.zeros(total, np.float32), sizes)
            self._results = queue.Queue()
            self._tasks = [queue.Queue() for _ in range(n_workers)]
            for i in range(n_workers):
                thread = threading.Thread(
                    target=_serve,
                    args=(i, factory, arrays, self._tasks[i], self._results, lambda: True),
                    name=f"hogwild-{i}",
                    daemon=True,
                )
                self._workers.append(thread)
        #: the shared weights (a copy of the initial values), live while the pool is open
        self.params: np.ndarray = arrays["params"]
        self.params[...] = params
        #: the extra shared buffers, zero-initialised
        self.buffers = {k: v for k, v in arrays.items() if k != "params"}
        try:
            for w in self._workers:
                w.start()
            self._collect(["ready"] * n_workers, start_timeout)
        except BaseException:
            self.close()
            raise

    def pids(self) -> list[int]:
        """Process ids of the workers (empty in thread mode)."""
        return [w.pid for w in self._workers] if self.mode == "process" else []

    def _collect(self, expected: list[str], timeout: float | None) -> list[Any]:
        """Wait for every worker's reply to the current round. A failed task is raised only
        once the other workers have replied, so no stale reply is left for the next round."""
        out: list[Any] = [None] * len(expected)
        errors: list[str] = []
        pending = set(range(len(expected)))
        deadline = None if timeout is None else time.monotonic() + timeout
        while pending:
            try:
                wid, kind, value = self._results.get(timeout=_POLL_S)
            except queue.Empty:
                for i in sorted(pending):
                    if not self._workers[i].is_alive():
                        self._broken = True
                        code = getattr(self._workers[i], "exitcode", None)
                        raise HogwildError(f"worker {i} died (exit code {code})") from None
                if deadline is not None and time.monotonic() > deadline:
                    self._broken = True
                    raise HogwildError(f"workers {sorted(pending)} timed out") from None
                continue
            pending.discard(wid)
            if kind == "error":
                errors.append(f"worker {wid} failed:\n{value}")
            elif kind != expected[wid]:
                errors.append(f"worker {wid}: expected {expected[wid]}, got {kind}")
            else:
                out[wid] = value
        if errors:
            raise HogwildError("\n".join(errors))
        return out

    def run(self, tasks: Sequence[Any], timeout: float | None = None) -> list[Any]:
        """Give task i to worker i (all run concurrently); return their results in order."""
        if self._closed or self._broken:
            raise HogwildError("the pool is closed" if self._closed else "a worker died or hung")
        if len(tasks) != self.n_workers:
            raise ValueError(f"need one task per worker ({self.n_workers}), got {len(tasks)}")
        for q, task in zip(self._tasks, tasks, strict=True):
            q.put(task)
        return self._collect(["ok"] * self.n_workers, timeout)

    def close(self, timeout: float = 5.0) -> None:
        """Stop the workers (terminating any that do not stop in time) and free the buffer."""
        if self._closed:
            return
        self._closed = True
        for q, w in zip(self._tasks, self._workers, strict=False):
            if w.is_alive():
                q.put(_STOP)
        deadline = time.monotonic() + timeout
        for w in self._workers:
            with contextlib.suppress(AssertionError):  # a worker that never started
                w.join(max(0.0, deadline - time.monotonic()))
        if self.mode == "process":
            for w in self._workers:
                if w.is_alive():
                    w.terminate()
                    w.join(2.0)
                if w.is_alive():
                    w.kill()
                    w.join(2.0)
            for q in self._tasks:
                # the workers are gone: never block on flushing a task nobody will read
                q.cancel_join_thread()
                q.close()
            if self._results is not None:
                self._results.close()
            if self._shm is not None:
                # the final values stay readable after close, out of shared memory
                if hasattr(self, "params"):
                    self.params = np.array(self.params)
                self.buffers = {k: np.array(v) for k, v in self.buffers.items()}
                gc.collect()
                _release(self._shm)
                self._shm.unlink()
                self._shm = None
        elif self._limits is not None:
            self._limits.restore_original_limits()
            self._limits = None

    def __enter__(self) -> Hogwild:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
