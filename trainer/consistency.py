"""A replica's side of the consistency modes (issue 25; adamps/core/stepclock.py has the rule,
adamps/server/api/clockops.py the servers' side).

``--consistency async`` (the default) is Downpour as it was: nothing here runs. Under ``sync``
and ``ssp:S`` the replica works in lock step with the servers' clocks: after each round (one
step: ``--workers 1 --n-push 1`` make a step one minibatch) it waits until the round's push is
acknowledged, reports the step to every parameter server (op ``clock``), which holds the answer
until the mode allows the next step, then fetches the parameters and installs them before the
next round. The Downpour background fetches are off (the gate fetches every step).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np

from adamps.client.rpc import RpcError, SyncRpc

log = logging.getLogger(__name__)


class StepGate:
    """Called by the replica's main thread after each round is queued (``after_round``)."""

    def __init__(self, replica: Any, params: np.ndarray, pusher: Any) -> None:
        cfg = replica.cfg
        self.replica = replica
        self.params = params
        self.pusher = pusher  #: the push thread (a Loop): waiting on a dead one is pointless
        self.mode = cfg.consistency or "async"
        self.run = cfg.run or "default"
        self.name = getattr(replica, "replica_id", None) or str(cfg.replica)
        #: a static run starts with its n_replicas (the servers hold step 1 for them)
        self.expect = [] if cfg.elastic else [str(i) for i in range(cfg.n_replicas)]
        self.timeout = cfg.wait_timeout
        self.clock = 0  #: the last step reported (acknowledged pushes)
        self.staleness = 0  #: the largest staleness the servers answered
        self._rpcs: dict[str, SyncRpc] = {}
        self.slowdown = cfg.slowdown
        self._round_started = time.perf_counter()
        model = replica.model
        self.names = [n for n, _ in model.tensors()]
        self.staging = np.zeros(model.n_params, np.float32)
        sl = model.slices()
        self.views = {n: self.staging[sl[n]].reshape(s) for n, s in model.tensors()}

    def _servers(self) -> list[str]:
        return list(self.replica.client.routing().servers())

    def _call(self, url: str, **fields: Any) -> dict[str, Any]:
        """The clock op on one server, asked again while the server holds the step back."""
        rpc = self._rpcs.get(url)
        if rpc is None:
            rpc = self._rpcs[url] = SyncRpc(url, self.replica.cfg.token, timeout=30.0)
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                fields.setdefault("step", self.clock)
                return rpc.call(
                    "clock", run=self.run, replica=self.name, mode=self.mode, expect=self.expect,
                    **fields,
                )  # fmt: skip
            except (OSError, RpcError) as exc:
                if isinstance(exc, RpcError) and (exc.http_status or 500) < 500:
                    raise  # 409: the run is live in another mode; 400: a bug
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"step {self.clock + 1} not released in time: {exc}"
                    ) from exc
                if self.replica._stopping.is_set():
                    raise KeyboardInterrupt from exc
                log.debug("%s: %s", url, exc)
                if isinstance(exc, OSError):  # a server down or restarting: not a busy loop
                    time.sleep(0.2)

    def join(self) -> None:
        """Before the first step: the clock this replica continues from (a new replica joins
        at the slowest live clock, a restarted one at its own)."""
        got = [self._call(url, join=True)["step"] for url in self._servers()]
        self.clock = max(got, default=0)
        self.replica.schedule.step = max(self.replica.schedule.step, self.clock)
        log.info("consistency %s: run %r, replica %s starts at step %d", self.mode, self.run,
                 self.name, self.clock + 1)  # fmt: skip
        self._fetch()

    def _fetch(self) -> None:
        """Fetches and installs the parameters for step clock + 1; under sync, then waits until
        every live replica has fetched them too (before anyone pushes that step)."""
        replica = self.replica
        replica.client.pull(self.names, out=self.views)
        replica._install(self.params, self.staging)
        if self.mode == "sync":
            for url in self._servers():
                self._call(url, step=self.clock + 1, phase="fetched")

    def after_round(self) -> None:
        """The round's push acknowledged, the step reported and released, the parameters of the
        next step fetched and installed."""
        replica = self.replica
        if self.slowdown > 1:  # a test flag: this replica takes slowdown x as long per step
            time.sleep((self.slowdown - 1) * (time.perf_counter() - self._round_started))
        if not replica.pushq.join(self.timeout, self.pusher.is_alive):
            self.pusher.check()
            raise TimeoutError("pushes not acknowledged in time")
        self.clock += 1
        for url in self._servers():
            got = self._call(url, step=self.clock, phase="pushed")
            self.staleness = max(self.staleness, int(got["staleness"]))
        replica.last_staleness = self.staleness
        self._fetch()
        self._round_started = time.perf_counter()
