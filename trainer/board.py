"""Progress boards: where the replicas of one run meet (Adam 3.2.5). Replica 0's warm-start mark
and every replica's last finished epoch; the epoch-end rule that reads them is in
trainer/schedule.py."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from adamps.client import PSClient
from adamps.layout import TensorSpec

BOARD_TENSOR = "adamps.board"


def board_tensor(run: str = "", engine: str = "") -> str:
    """The static-mode board tensor of a training run: in the run's namespace (issue 25); an
    engine other than the numpy one (``torch``) has a board of its own."""
    name = f"{BOARD_TENSOR}.{engine}" if engine else BOARD_TENSOR
    return f"{run}..{name}" if run else name


def board_prefix(run: str = "", engine: str = "") -> str:
    """The controllers' progress keys of a run are "<run>/[<engine>/]<replica>": under the run's
    name, which its token may report (issue 25)."""
    parts = [p for p in (run, engine) if p]
    return "".join(f"{p}/" for p in parts)


# -- boards: where replicas meet (warm start, epochs finished) --------------------------------


class Board:
    """Warm-start mark and per-replica finished epochs, shared by the replicas."""

    def mark_warm(self) -> None:
        raise NotImplementedError

    def warm_done(self) -> bool:
        raise NotImplementedError

    def report(self, epoch: int, progress: float, done: bool) -> None:
        raise NotImplementedError

    def finished(self) -> dict[str, int]:
        """replica -> the last epoch it finished (0: none)."""
        raise NotImplementedError

    def observe(self, sched: Any) -> int:
        """Updates the schedule's last complete epoch from the board; returns it."""
        return int(sched.observe(self.finished()))


class PsBoard(Board):
    """A float32 vector on the parameter servers: element r = the last epoch replica r
    finished, element n = 1 once replica 0's warm start is done. Replicas add to it (SGD with
    lr = -1); every push is applied exactly once, so the counts are exact."""

    def __init__(
        self, client: PSClient, replica: int, n_replicas: int, run: str = "", engine: str = ""
    ) -> None:
        self.client = client
        self.replica = replica
        self.n = n_replicas
        self.tensor = board_tensor(run, engine)
        client.create(
            TensorSpec(self.tensor, (n_replicas + 1,)),
            init={"kind": "zeros"},
            optimizer={"kind": "sgd", "lr": -1.0},
        )
        self._values = self._pull()
        self._last = int(self._values[replica])

    def _pull(self) -> np.ndarray:
        return self.client.pull([self.tensor])[0][self.tensor]

    def _add(self, index: int, amount: float) -> None:
        delta = np.zeros(self.n + 1, np.float32)
        delta[index] = amount
        self.client.push_dense(self.tensor, delta)

    def mark_warm(self) -> None:
        if self._pull()[self.n] < 1:
            self._add(self.n, 1.0)

    def warm_done(self) -> bool:
        return bool(self._pull()[self.n] >= 1)

    def report(self, epoch: int, progress: float, done: bool) -> None:
        if done and epoch > self._last:
            self._add(self.replica, float(epoch - self._last))
            self._last = epoch

    def finished(self) -> dict[str, int]:
        values = self._pull()
        return {str(r): int(values[r]) for r in range(self.n)}


class ControllerBoard(Board):
    """The controllers' /progress (Adam 3.2.5: progress is recorded at the controller). The
    warm-start mark is replica 0's report for epoch 0. With a run name, replicas report as
    "<run>/<replica>" so that runs do not see each other's progress."""

    def __init__(
        self,
        controllers: Sequence[str],
        token: str,
        replica: int,
        run: str = "",
        engine: str = "",
    ) -> None:
        self.controllers = list(controllers)
        self.token = token
        self.prefix = board_prefix(run, engine)
        self.replica = self.prefix + str(replica)
        self._local = threading.local()

    def _ctl(self) -> Any:
        from adamps.client.controller import ControllerClient

        ctl = getattr(self._local, "ctl", None)
        if ctl is None:
            ctl = self._local.ctl = ControllerClient(self.controllers, self.token, retry_for=30.0)
        return ctl

    def mark_warm(self) -> None:
        self._ctl().report_progress(0, self.prefix + "0", 1.0, True)

    def warm_done(self) -> bool:
        replicas = self._ctl().progress(0).get("replicas", {})
        return bool(replicas.get(self.prefix + "0", {}).get("done"))

    def report(self, epoch: int, progress: float, done: bool) -> None:
        self._ctl().report_progress(epoch, self.replica, float(progress), done)

    def finished(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for epoch, replicas in self._ctl().progress().get("epochs", {}).items():
            e = int(epoch)
            if e < 1:
                continue
            for r, p in replicas.items():
                if p.get("done") and r.startswith(self.prefix) and "/" not in r[len(self.prefix) :]:
                    out[r] = max(out.get(r, 0), e)
        return out
