"""Downpour SGD (DistBelief 4.1) for one worker of a torch replica: the rule, not the loop.

Each step a worker brings the gradient of every parameter (dense, from ``p.grad`` or
``torch.autograd.grad``) and the activation/error rows its ``nn.Linear`` layers recorded
(adamps/torch/hooks.py). It

1. applies the step locally (``p -= local_lr * g``, in place, without locks: the Hogwild
   workers of a replica share the parameters), so the replica progresses between fetches;
2. adds the gradient to what it will push (dense sums; the rows of each linear weight);
3. every ``n_push`` steps pushes, per tensor, the smaller form: a linear weight's k activation
   and error rows when ``k * (M + N) < M * N`` (the server computes ``e.T @ a``), else the dense
   sum (for a linear weight ``e.T @ a`` computed here, which is its gradient); with a compressor,
   Strom's threshold-quantized update when that is smaller (adamps/compression/error_feedback.py);
4. every ``n_fetch`` steps replaces the parameters by the servers' values, plus the gradient it
   has not sent yet (the compressor's residuals): local progress the servers do not have. A
   fetch due at a step that pushes rides the push's round (its values read after the push is
   applied): with ``n_push = n_fetch = 1`` a step is one request per server, not two.

With ``staleness="auto"`` (the default) each push's server lr is divided by ``1 + tau``, tau
the updates other workers applied between this worker's last two fetches (the shards' versions
the fetches return; before two fetches, ``$WORLD_SIZE - 1``: adamps/core/staleness.py), for
every tensor but those under plain SGD (``staleness.divides``: its step is the gradient's). One
worker alone has tau 0: its lr is unchanged. ``"off"``: every push at the group's lr.

Units: the servers apply ``w -= lr * g`` (SGD) to a pushed gradient ``g``, and ``W -= lr *
e.T @ a`` to act/err rows (adamps/server/updates/optim.py): both are gradients here, never deltas. So
with one worker, SGD at the local rate, ``n_fetch = n_push = 1`` and no compression, the
parameters after each step equal ``torch.optim.SGD``'s on the same batches.

With ``asynchronous=True`` (the CLI's trainers) pushes and fetches are carried out in order by
a background thread per worker, so computing never waits on the network (Adam 3.2: the
trainer's communication is off the compute path); a full queue (two items) blocks the worker,
which bounds how far it runs ahead of what the servers acknowledged. A fetch installs the
servers' values directly into the shared parameters when it arrives (a Hogwild race, like every
other update of the replica's copy). The synchronous default keeps the exact equivalence above.

A worker's pushes carry the replica's client id and fresh sequence numbers: each one is applied
exactly once, also when it is retried after a failover.

A step is checked whole first (issue 39): every gradient, the linear layers' activation/error
rows and the embedding tables' row gradients (kept by their hooks for the step) must be finite
and within the servers' bound. Otherwise the step raises ``RpcError("non_finite")`` (or
``bad_request``) before anything changes: no local step, nothing accumulated, nothing pushed.
Then the rows are pushed, and the step goes on as above.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from adamps.client import push_checks
from adamps.client.round import use_act_err
from adamps.core.staleness import StalenessMeter, check_mode, initial_tau, staleness_lr
from adamps.torch import launch_env
from adamps.torch.hooks import ActErrCapture, probe_for, rows_agree
from adamps.torch.params import Param
from adamps.torch.remote import RemoteModel, server_shape
from adamps.torch.staging import HostStage, direct


@dataclass
class PushCounts:
    """Totals of one replica (all workers); written under ``lock``."""

    pushes: int = 0
    fetches: int = 0
    bytes_pushed: int = 0
    #: bytes the linear weights' pushes took / would have taken as dense gradients
    fc_bytes: int = 0
    fc_dense_bytes: int = 0
    forms: dict[str, int] = field(default_factory=lambda: {"fc": 0, "dense": 0, "compressed": 0})
    #: steps at which a linear layer's rows were not its gradient (a penalty on the weight in
    #: the loss, ...): the layer pushed its gradient
    rows_disagreed: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


def replica_stats(counts: PushCounts, client: Any) -> dict[str, Any]:
    """What ``DownpourOptimizer.stats()`` returns: the replica's pushes and fetches, and the
    retries and failovers its client rode through (adamps/client/failovers.py)."""
    with counts.lock:
        out: dict[str, Any] = {
            "pushes": counts.pushes, "fetches": counts.fetches,
            "bytes_pushed": counts.bytes_pushed, "forms": dict(counts.forms),
            "rows_disagreed": counts.rows_disagreed,
        }  # fmt: skip
    events = list(client.failovers.events)
    out["retries"] = client.retries
    out["failovers"] = client.failovers.count
    out["last_failover"] = (
        None
        if not events
        else {"bucket": events[-1].bucket, "old": events[-1].old, "new": events[-1].new,
              "stalled_s": round(events[-1].stalled_s, 3)}
    )  # fmt: skip
    return out


class WorkerDownpour:
    """One worker's accumulation, push and fetch schedule. Owned by that worker's thread."""

    def __init__(
        self,
        remote: RemoteModel,
        params: Sequence[Param],
        capture: ActErrCapture | None,
        *,
        local_lr: float,
        n_push: int = 1,
        n_fetch: int = 1,
        compressor: Any = None,
        counts: PushCounts | None = None,
        asynchronous: bool = False,
        tables: Sequence[Any] = (),
        staleness: str = "auto",
    ) -> None:
        if n_push < 1 or n_fetch < 1:
            raise ValueError(f"n_push and n_fetch must be >= 1, got {n_push}, {n_fetch}")
        #: "auto": a push's lr divided by 1 + its measured staleness; "off": the group's lr
        self.staleness = check_mode(staleness)
        self.meter = StalenessMeter(initial_tau(launch_env.world_size()))
        #: this worker's pushes of the model's tensors since its last fetch
        self._pushed = 0
        self.remote = remote
        self.params = list(params)
        self.capture = capture
        self.fc = set(capture.layers) if capture is not None else set()
        self.local_lr = float(local_lr)
        self.n_push = n_push
        self.n_fetch = n_fetch
        self.compressor = compressor
        #: the model's adamps embedding modules whose row gradients the step pushes
        self.tables = list(tables)
        self.counts = counts if counts is not None else PushCounts()
        self.steps = 0
        self._dense: dict[str, np.ndarray] = {}
        self._rows: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
        #: the background thread's work ("push", parts) / ("fetch",), with asynchronous=True
        self._q: queue.Queue[tuple[Any, ...] | None] | None = (
            queue.Queue(maxsize=2) if asynchronous else None
        )
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._fetch_queued = False
        #: host buffers of the gradients going up (this worker's thread) and of the values
        #: coming down (the thread that fetches): adamps/torch/staging.py
        self.stage_up = HostStage()
        self.stage_down = HostStage()
        self._probes: dict[tuple[str, torch.device], torch.Tensor] = {}

    def _probe(self, tensor: str, a: torch.Tensor) -> torch.Tensor:
        """The linear weight's fixed random vector for ``rows_agree``, on the rows' device."""
        key = (tensor, a.device)
        v = self._probes.get(key)
        if v is None:
            v = self._probes[key] = probe_for(tensor, a.shape[1], a.device)
        return v

    def _to_host(
        self,
        grads: Mapping[str, torch.Tensor | None],
        rows: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
        tables: Sequence[tuple[Any, list[tuple[np.ndarray, torch.Tensor]]]],
    ) -> tuple[
        dict[str, np.ndarray],
        dict[str, tuple[np.ndarray, np.ndarray]],
        list[tuple[Any, list[tuple[np.ndarray, np.ndarray]]]],
    ]:
        """The step's gradients, act/err rows and table row gradients as float32 host arrays
        (adamps/torch/staging.py): views of float32 CPU tensors, else copies enqueued into
        this worker's reused host buffers and waited for once. The gradients' arrays are valid
        until the next step; the act/err rows' are the step's own (they wait for the push)."""
        up = self.stage_up
        host = {t: up.to_host(("grad", t), g) for t, g in grads.items() if g is not None}
        host_rows = {
            t: (up.to_host(("act", t), a), up.to_host(("err", t), e)) for t, (a, e) in rows.items()
        }
        # the rows go only where they are the gradient (adamps/torch/hooks.py, rows_agree)
        agree = {
            t: up.to_host(("agree", t), rows_agree(g, a, e, self._probe(t, a)))
            for t, (a, e) in rows.items()
            if (g := grads.get(t)) is not None
        }
        host_tables = [
            (m, [(u, up.to_host(("rows", m.table, i), g)) for i, (u, g) in enumerate(tg)])
            for m, tg in tables
        ]
        up.wait()
        for t, ok in agree.items():
            if not ok[0]:
                del host_rows[t]  # the layer pushes its gradient
                with self.counts.lock:
                    self.counts.rows_disagreed += 1
        for t, (a, e) in rows.items():
            if t not in host_rows:
                continue
            ha, he = host_rows[t]
            if not direct(a):  # views of the stage's buffers, but kept until the push: copied
                ha, he = ha.copy(), he.copy()
            host_rows[t] = (ha.reshape(a.shape), he.reshape(e.shape))
        host_tables = [
            (m, [(u, h.reshape(g.shape)) for (u, h), (_, g) in zip(htg, tg, strict=True)])
            for (m, htg), (_, tg) in zip(host_tables, tables, strict=True)
        ]
        return host, host_rows, host_tables

    def step(self, grads: Mapping[str, torch.Tensor | None]) -> None:
        """One minibatch's gradients (server tensor -> gradient; None: no gradient)."""
        # A sparse gradient (``nn.Embedding(sparse=True)``) goes as its dense equivalent: the
        # servers apply dense updates, and for the rows it leaves out a dense zero is what
        # torch.optim's SGD and Adagrad do with the sparse one (per-row updates of a large
        # table are adamps.torch.Embedding's).
        grads = {t: g.to_dense() if g is not None and g.is_sparse else g for t, g in grads.items()}
        rows_t = self.capture.take_tensors() if self.capture is not None else {}
        # a .grad the loop changed after backward (clipping) is pushed as it is, not the rows
        rows_t = {t: r for t, r in rows_t.items() if not self.capture.edited(t, grads.get(t))}  # type: ignore[union-attr]
        tables_t = [(t, t.take_grads()) for t in self.tables]
        # every gradient of the step to the host (on a device: one synchronize for them all)
        host, rows, table_grads = self._to_host(grads, rows_t, tables_t)
        self._check(host, rows, table_grads)
        #: the tables' row gradients of this step (server table -> (ids, grads)): they ride
        #: this step's round, every step (the next forward pulls the rows they update)
        row_grads = dict(got for t, tg in table_grads if (got := t.round_rows(tg)) is not None)
        with torch.no_grad():
            for p in self.params:
                g = grads.get(p.tensor)
                if g is None:
                    continue
                p.param.add_(g, alpha=-self.local_lr)  # Hogwild: no lock
                if p.tensor in self.fc and p.tensor in rows and self._keep_rows(p, rows):
                    continue
                gn = host[p.tensor].reshape(server_shape(p))
                acc = self._dense.get(p.tensor)
                if acc is None:
                    self._dense[p.tensor] = gn.astype(np.float32, copy=True)
                else:
                    acc += gn
        self.steps += 1
        if row_grads and self._q is not None:
            # Asynchronous pushes stay behind: the rows go now, alone, so that the next
            # forward reads them (as before: a table's rows are never pushed late).
            self.remote.push([], row_grads)
            row_grads = {}
        fetch = self.steps % self.n_fetch == 0
        if self.steps % self.n_push == 0:
            # a fetch due at the same step rides the push's round (one request per server)
            fetch = not self.push(row_grads, fetch=fetch) and fetch
        elif row_grads:
            self._do(("push", [], row_grads))
        if fetch:
            self.fetch()

    def _keep_rows(self, p: Param, rows: Mapping[str, tuple[np.ndarray, np.ndarray]]) -> bool:
        """Whether a fully connected layer's rows of this step are kept to be sent as activation
        and error vectors (the round client's rule on every row held for the next push); when
        they would be the larger form, the layer's update goes as its dense gradient: autograd's
        own ``W.grad`` (which is ``e.T @ a``), not a second product of the same rows, plus the
        rows held from earlier steps, summed once."""
        held = self._rows.get(p.tensor, [])
        k = rows[p.tensor][0].shape[0] + sum(r[0].shape[0] for r in held)
        if use_act_err(k, *self.remote.layout.tensors[p.tensor].shape):
            self._rows.setdefault(p.tensor, []).append(rows[p.tensor])
            return True
        if held:
            del self._rows[p.tensor]
            self._dense[p.tensor] = sum(_outer(a, e) for a, e in held)
        return False

    def _check(
        self,
        grads: Mapping[str, np.ndarray],
        rows: Mapping[str, tuple[np.ndarray, np.ndarray]],
        table_grads: Sequence[tuple[Any, list[tuple[np.ndarray, np.ndarray]]]],
    ) -> None:
        """Every gradient of the step finite and bounded (push_checks.bounded: one min and one
        max each), before anything is applied anywhere."""
        for p in self.params:
            g = grads.get(p.tensor)
            if g is not None:
                push_checks.bounded(f"the gradient of {p.name!r}", g)
        for tensor, (a, e) in rows.items():
            push_checks.bounded(f"the activations into {tensor!r}", a)
            push_checks.bounded(f"the errors out of {tensor!r}", e)
        for t, tg in table_grads:
            for _ids, g in tg:
                push_checks.bounded(f"the row gradients of table {t.table!r}", g)

    def parts(self) -> list[tuple[Any, ...]]:
        """What a push sends, in gradient units, before compression; clears the accumulators."""
        parts: list[tuple[Any, ...]] = []
        c = self.counts
        for tensor, rows in self._rows.items():
            a = np.concatenate([r[0] for r in rows]) if len(rows) > 1 else rows[0][0]
            e = np.concatenate([r[1] for r in rows]) if len(rows) > 1 else rows[0][1]
            shape = self.remote.layout.tensors[tensor].shape
            dense_bytes = 4 * shape[0] * shape[1]
            with c.lock:
                c.fc_dense_bytes += dense_bytes
            if use_act_err(a.shape[0], *shape):  # the round client's rule, both engines'
                parts.append(("fc", tensor, np.ascontiguousarray(a), np.ascontiguousarray(e)))
            else:
                parts.append(("dense", tensor, _outer(a, e)))
        for tensor, g in self._dense.items():
            if tensor in self.fc:  # a layer sent dense: what its vectors would have replaced
                shape = self.remote.layout.tensors[tensor].shape
                with c.lock:
                    c.fc_dense_bytes += 4 * shape[0] * shape[1]
            parts.append(("dense", tensor, g))
        self._rows = {}
        self._dense = {}
        return parts

    def push(
        self, rows: Mapping[str, tuple[np.ndarray, np.ndarray]] | None = None, fetch: bool = False
    ) -> bool:
        """Sends what accumulated since the last push (nothing if nothing did), and `rows`
        (table -> (ids, grads)) in the same round; with `fetch`, that round also answers the
        parameters' values, installed as ``fetch`` installs them. Returns whether the fetch
        was carried (or, asynchronously, queued) with the push."""
        parts = self.parts()
        if not (parts or rows):
            return False
        if fetch and self._q is not None:
            if self._fetch_queued:  # a fetch is already queued: it reads the newest values
                fetch = False
            self._fetch_queued = self._fetch_queued or fetch
        self._do(("push", parts, rows or {}, fetch))
        return fetch

    def fetch(self) -> None:
        """The servers' values into the shared parameters, plus this worker's unsent residuals."""
        if self._q is not None:
            if self._fetch_queued:  # one pending fetch is enough: it reads the newest values
                return
            self._fetch_queued = True
        self._do(("fetch",))

    def flush(self) -> None:
        """Pushes a partial accumulation and waits until every queued push is acknowledged."""
        self.push()
        if self._q is not None:
            self._q.join()
        self._raise()

    def close(self) -> None:
        """Flushes and stops the background thread."""
        try:
            self.flush()
        finally:
            if self._thread is not None and self._q is not None:
                self._q.put(None)
                self._thread.join(60)
                self._thread = None

    # -- carrying out pushes and fetches -----------------------------------------------------------

    def _do(self, item: tuple[Any, ...]) -> None:
        if self._q is None:
            self._carry(item)
            return
        self._raise()
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="downpour-io", daemon=True)
            self._thread.start()
        self._q.put(item)

    def _raise(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def _loop(self) -> None:
        assert self._q is not None
        while True:
            item = self._q.get()
            try:
                if item is None:
                    return
                if self._error is None:  # after a failure: drain, the worker raises it
                    self._carry(item)
            except BaseException as exc:  # noqa: BLE001 - raised in the worker's thread
                self._error = exc
            finally:
                self._q.task_done()

    def _carry(self, item: tuple[Any, ...]) -> None:
        if item[0] == "push":
            self._send(item[1], item[2], len(item) > 3 and item[3])
        else:
            self._fetch_queued = False
            self._pull()

    def _send(
        self,
        parts: list[tuple[Any, ...]],
        rows: Mapping[str, tuple[np.ndarray, np.ndarray]],
        fetch: bool = False,
    ) -> None:
        if self.compressor is not None and parts:
            parts, _ = self.compressor.compress(parts)
        scale = staleness_lr(1.0, self.meter.tau) if self.staleness == "auto" else 1.0
        if fetch:  # the residuals after this push's compression, as a fetch after it reads
            self._fetch_queued = False
            versions: dict[str, list[int]] = {}
            got = (self.params, self.stage_down, self._residuals(), versions)
            nbytes = self.remote.push(parts, rows, fetch=got, lr_scale=scale)
            self._pushed += bool(parts)  # the values were read after this push was applied
            self.meter.fetched(versions, self._pushed)
            self._pushed = 0
        else:
            nbytes = self.remote.push(parts, rows, lr_scale=scale)
            self._pushed += bool(parts)
        c = self.counts
        with c.lock:
            c.pushes += bool(parts)  # (a round of rows alone is not a push of the model's)
            c.fetches += fetch
            c.bytes_pushed += nbytes
            for kind, name, *arrays in parts:
                c.forms[kind] = c.forms.get(kind, 0) + 1
                if name in self.fc:
                    c.fc_bytes += (
                        arrays[0].nbytes if kind == "compressed" else sum(x.nbytes for x in arrays)
                    )

    def _residuals(self) -> dict[str, np.ndarray]:
        """The local progress a fetch keeps: the compressor's unsent residuals, as steps."""
        residuals = {}
        if self.compressor is not None:
            for p in self.params:
                tc = self.compressor.tensors.get(p.tensor)
                if tc is not None:
                    residuals[p.tensor] = np.float32(-self.local_lr) * tc.residual
        return residuals

    def _pull(self) -> None:
        versions = self.remote.pull(self.params, self.stage_down, self._residuals())
        self.meter.fetched(versions, self._pushed)
        self._pushed = 0
        with self.counts.lock:
            self.counts.fetches += 1


def _outer(a: np.ndarray, e: np.ndarray) -> np.ndarray:
    """e.T @ a with torch's threads (the ones the user set), not numpy's BLAS pool, whose
    threads spin beside torch's on a busy machine: 20-50x the wall time of this product."""
    return (torch.from_numpy(e).T @ torch.from_numpy(a)).numpy()
