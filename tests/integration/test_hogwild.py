"""Hogwild workers (Project Adam 3.2.1-3.2.2): real worker processes (and threads) sharing one
parameter buffer without locks; clean stops, no orphans, errors surfaced."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from trainer.hogwild import MODES, Hogwild, HogwildError
from trainer.local import train_local

REPO = Path(__file__).resolve().parents[2]


def _counter_factory(worker_id: int, params: np.ndarray):
    """Each worker owns element worker_id and adds the task to it one unit at a time; it
    reports what it sees in the other workers' elements."""

    def handle(task: int) -> list[float]:
        for _ in range(task):
            params[worker_id] += 1.0
        return params.tolist()

    return handle


def _failing_factory(worker_id: int, params: np.ndarray):
    def handle(task: str) -> None:
        if task == "raise":
            raise ValueError(f"bad task for worker {worker_id}")
        if task == "exit" and worker_id == 1:
            os._exit(3)

    return handle


def _accumulating_factory(worker_id: int, params: np.ndarray, buffers: dict[str, np.ndarray]):
    """A Downpour-like step: update the weights and add the same delta to an accumulator."""

    def handle(task: int) -> None:
        for _ in range(task):
            params[:] += 1.0
            buffers["delta"][:] += 1.0
        buffers["steps"][worker_id] += task

    return handle


def _broken_factory(worker_id: int, params: np.ndarray):
    raise RuntimeError("cannot build the step function")


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_workers_share_one_buffer(mode: str) -> None:
    init = np.zeros(4, np.float32)
    with Hogwild(_counter_factory, 2, init, mode=mode) as pool:
        first = pool.run([5, 7])
        np.testing.assert_array_equal(pool.params, [5, 7, 0, 0])
        # each worker sees the other's earlier updates in its own view of the buffer
        second = pool.run([1, 1])
        assert second[0][1] >= 7 and second[1][0] >= 5
        assert first[0][0] == 5 and first[1][1] == 7
        pool.params[3] = 42.0  # the owner may write too (e.g. fetched parameters)
        assert pool.run([0, 0])[1][3] == 42.0
        pids = pool.pids()
    assert len(pids) == (2 if mode == "process" else 0)
    assert not any(_alive(pid) for pid in pids), "a worker outlived close()"
    np.testing.assert_array_equal(pool.params, [6, 8, 0, 42])  # readable after close
    np.testing.assert_array_equal(init, 0)  # the caller's array was copied, not shared


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_extra_shared_buffers(mode: str) -> None:
    with Hogwild(
        _accumulating_factory,
        2,
        np.full(3, 10.0, np.float32),
        mode=mode,
        buffers={"delta": 3, "steps": 2},
    ) as pool:
        assert sorted(pool.buffers) == ["delta", "steps"]
        np.testing.assert_array_equal(pool.buffers["delta"], 0)
        pool.run([4, 6])
        np.testing.assert_array_equal(pool.buffers["steps"], [4, 6])
        # lock-free: concurrent += may lose an update, never invent one
        assert 0 < pool.buffers["delta"][0] <= 10 and 10 < pool.params[0] <= 20
        pool.buffers["delta"][:] = 0.0  # the owner drains the accumulator
        pool.run([1, 0])
        np.testing.assert_array_equal(pool.buffers["delta"], 1)
    np.testing.assert_array_equal(pool.buffers["steps"], [5, 6])


@pytest.mark.slow
def test_worker_errors_are_raised_and_the_pool_still_closes() -> None:
    with Hogwild(_failing_factory, 2, np.zeros(2, np.float32)) as pool:
        with pytest.raises(HogwildError, match="bad task for worker"):
            pool.run(["raise", "raise"])
        assert pool.run(["ok", "ok"]) == [None, None]  # no stale replies from the failed round
        with pytest.raises(HogwildError, match="worker 1 died"):
            pool.run(["ok", "exit"])
        with pytest.raises(HogwildError, match="died or hung"):
            pool.run(["ok", "ok"])
        pids = pool.pids()
    assert not any(_alive(pid) for pid in pids)


@pytest.mark.slow
def test_a_factory_failure_stops_the_start() -> None:
    with pytest.raises(HogwildError, match="cannot build"):
        Hogwild(_broken_factory, 2, np.zeros(2, np.float32))


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="mode"):
        Hogwild(_counter_factory, 1, np.zeros(2, np.float32), mode="fiber")
    with pytest.raises(ValueError, match="float32"):
        Hogwild(_counter_factory, 1, np.zeros(2, np.float64), mode="thread")
    with pytest.raises(ValueError, match="other than 'params'"):
        Hogwild(_counter_factory, 1, np.zeros(2, np.float32), mode="thread", buffers={"params": 1})
    with Hogwild(_counter_factory, 2, np.zeros(2, np.float32), mode="thread") as pool:
        with pytest.raises(ValueError, match="one task per worker"):
            pool.run([1])


@pytest.mark.slow
def test_workers_exit_when_their_parent_is_killed(tmp_path: Path) -> None:
    script = tmp_path / "parent.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import sys, time
            sys.path.insert(0, {str(REPO)!r})
            import numpy as np
            from trainer.hogwild import Hogwild

            def factory(worker_id, params):
                return lambda task: task

            if __name__ == "__main__":
                pool = Hogwild(factory, 2, np.zeros(8, np.float32))
                print(pool._shm.name, *pool.pids(), flush=True)
                time.sleep(120)
            """
        )
    )
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        shm_name, *pids = parent.stdout.readline().split()
        worker_pids = [int(p) for p in pids]
        assert len(worker_pids) == 2 and all(_alive(p) for p in worker_pids)
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 15
        while any(_alive(p) for p in worker_pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(p) for p in worker_pids), "orphaned Hogwild workers"
        # the resource tracker of the dead parent frees the shared segment
        while Path("/dev/shm", shm_name.lstrip("/")).exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not Path("/dev/shm", shm_name.lstrip("/")).exists(), "leaked shared memory"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        parent.stdout.close()


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_hogwild_training_learns_mnist() -> None:
    """Two processes train adam-mnist on one shared buffer: one epoch is well above chance."""
    _, results = train_local("adam-mnist", epochs=1, batch=8, lr=0.03, workers=2)
    assert results[0].images == 4000
    assert results[0].accuracy >= 0.85, results


def test_thread_mode_training_step_function() -> None:
    """The same step function, as threads: all batches are applied to the one buffer."""
    from trainer.local import sgd_worker_factory
    from trainer.model import Model

    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (32, 28, 28), dtype=np.uint8)
    labels = rng.integers(0, 10, 32)
    model = Model("adam-mnist")
    model.init_params(0)
    factory = functools.partial(sgd_worker_factory, model.spec, images, labels, 0.01)
    batches = [np.arange(i, i + 4) for i in range(0, 32, 4)]
    with Hogwild(factory, 2, model.params, mode="thread") as pool:
        out = pool.run([batches[0::2], batches[1::2]])
        assert [o[1] for o in out] == [4, 4] and sum(o[2] for o in out) == 32
        assert not np.array_equal(pool.params, model.params)
