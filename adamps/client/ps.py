"""The client library of the parameter servers: routing, retries, exactly-once pushes.

A ``PSClient`` knows the model's layout (tensors -> shards -> buckets, adamps.layout) and a routing
table (bucket -> primary server). It splits each pull and push by server, sends the parts, and joins
the answers. The routing table comes from a ``RoutingSource``: the controllers' table (any
controller answers it), or a static list of servers each holding its configured buckets.

Every push carries (client id, sequence number). On "not primary", "unavailable" or a connection
error the client refreshes its routing table and retries the same (client id, seq) until its
deadline: a server that already applied the push recognises it and does not apply it again, also
after a failover, so a retried push is applied exactly once.

A push is checked whole before any part is sent (``push_checks``: finite, shapes, dtypes, ids):
a bad one is refused with nothing applied anywhere. One that fails after some buckets
acknowledged their parts raises ``PartialPushError`` (``partial``) naming them (issue 39).

Pulls and dense pushes go over a server's binary data plane when it offers one (``data_port`` in
its ``GET /status``; ``adamps.server.api.dataplane``), else over HTTP: the same operations, checks,
error codes and exactly-once (client id, seq) whichever transport (docs/protocol-ps.md, "Binary
data plane"). ``push_fc`` and ``push_compressed`` travel there as message frames (their arrays out
of band). ``data_plane=False`` forces HTTP.

Thread-safe: each thread gets its own keep-alive connections (trainers pull and push from
background threads).
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np

from adamps.client import push_checks as checks
from adamps.client import retry
from adamps.client.dataplane import DataPlaneClient
from adamps.client.exchange import Counts, exchange
from adamps.client.failovers import FailoverLog
from adamps.client.partial import PartialPushError, partial_of  # noqa: F401 - re-exported
from adamps.client.parts import HEADROOM, PER_SHARD, Limits, Unit, chunk, pack, plan_push
from adamps.client.pool import DataPlanePool
from adamps.client.retry import RetryPolicy
from adamps.client.round import RoundClient
from adamps.client.routing import (  # noqa: F401 - re-exported: where they were before
    ControllerRouting,
    Route,
    Routing,
    RoutingSource,
    StaticRouting,
    normalize_url,
    routing_from_table,
)
from adamps.client.rows import RowsClient
from adamps.client.rpc import RpcError, SyncRpc
from adamps.layout import Layout, Shard, TensorSpec

log = logging.getLogger(__name__)

#: error codes after which a refreshed routing table may lead to success
RETRYABLE = frozenset(
    {
        "not_primary",
        "primary_changed",
        "stale_epoch",
        "unavailable",
        "bucket_unavailable",
        "not_durable",  # nothing applied; the controllers move the bucket to a durable server
        "held",  # nothing applied; a consistent checkpoint's cut holds writes for a moment
        "timeout",
        "no_quorum",
        "rate_limited",  # a run's push_bytes_per_s quota (issue 25): nothing applied; backs off
    }
)

T = TypeVar("T")


def _dense_bytes(s: Shard) -> int:
    return 4 * s.size


#: payload bytes of one data-plane frame of a pull or push (a request is cut into frames of
#: about this size on bucket boundaries, several in flight per connection: the server applies
#: one while the next arrives). Over HTTP a request stays whole (each costs a round trip).
#: 4 MiB, not 1 MiB (issue 27): every frame costs both sides a fixed amount of Python (the
#: server's loop about 0.4 ms a frame here), and with 1 MiB frames that fixed cost, not the
#: bytes, was most of a push's CPU. A 4 MB push to one server is one frame: its CPU per GB
#: fell by about 45% on the server and 25% on the client (benchmarks/ps_apply.py's
#: PSClient push, on a loaded 2-core machine); larger requests still go out as frames in flight.
FRAME_BYTES = 4 << 20
#: the same for a pull's frames: 1 MiB. A pull's cost on the server is its reply's write, which
#: a larger frame does not make cheaper (no payload to receive and check): in Python 3.11
#: asyncio copies what a first send does not take into a bytearray and moves the rest down
#: after every partial send, more for a larger reply; smaller frames keep it pipelined.
PULL_FRAME_BYTES = 1 << 20
#: shards whose entries (PER_SHARD bytes each) a frame has room for beside its FRAME_BYTES
FRAME_SHARDS = 64


def _flat(rounds: Mapping[str, Sequence[T]]) -> Iterator[tuple[str, T]]:
    """Each server's requests, in order (exchange pipelines them per server)."""
    for url, reqs in rounds.items():
        for req in reqs:
            yield url, req


def retryable(exc: BaseException) -> bool:
    """Whether a refreshed routing table may lead to success after `exc`: every failure to get
    an answer (the outcome is unknown: the same (client, seq) settles it), and the codes above."""
    if isinstance(exc, RpcError):
        return exc.code in RETRYABLE
    return isinstance(exc, ConnectionError | TimeoutError)


class PSClient(RoundClient, RowsClient):
    """Pull and push whole tensors of a model held by the parameter servers, and rows of its
    embedding tables (rows_client.py)."""

    def __init__(
        self,
        routing: RoutingSource,
        layout: Layout,
        token: str | None = None,
        *,
        client_id: str | None = None,
        timeout: float = 35.0,  # above the servers' push_timeout (30 s): their 504 comes first
        retry_for: float = 30.0,
        data_plane: bool = True,
        frame_bytes: int = FRAME_BYTES,
    ) -> None:
        self.source = routing
        self.layout = layout
        self.token = token if token is not None else os.environ.get("ADAMPS_TOKEN")
        #: identifies this client's pushes for deduplication; unique per PSClient
        self.client_id = client_id or f"{uuid.uuid4().hex[:12]}-{os.getpid()}"
        self.timeout = timeout
        self.retry_for = retry_for
        self._seq = itertools.count(1)
        self._local = threading.local()
        self._lock = threading.Lock()
        self._routing: Routing | None = None
        #: every connection of every thread, so that close() can close them all
        self._all_rpcs: list[SyncRpc] = []
        self.retries = 0
        #: primaries that changed under this client's calls (logged once each, counted)
        self.failovers = FailoverLog()
        #: pulls and dense pushes over the servers' data ports where offered (else HTTP)
        self.data_plane = data_plane
        #: payload bytes of a push's data-plane frame (FRAME_BYTES; pulls: PULL_FRAME_BYTES)
        self.frame_bytes = frame_bytes
        self._dp = DataPlanePool(
            self.token, timeout, lambda url: self._rpc(url).get_json("/status")
        )
        #: requests sent over the data plane and over HTTP (dp_requests, http_requests)
        self._counts = Counts()
        #: server base URL -> its request limits (max_body, max_shards_per_request)
        self._server_limits: dict[str, Limits] = {}
        #: embedding table name -> dim (create_table)
        self.tables = {}

    # -- plumbing --------------------------------------------------------------------------------

    def _rpc(self, url: str) -> SyncRpc:
        conns = getattr(self._local, "conns", None)
        if conns is None:
            conns = self._local.conns = {}
        rpc = conns.get(url)
        if rpc is None:
            rpc = conns[url] = SyncRpc(url, self.token, self.timeout)
            with self._lock:
                self._all_rpcs.append(rpc)
        return rpc

    def routing(self, refresh: bool = False) -> Routing:
        routing = self._routing
        if routing is None or refresh:
            routing = self._routing = self.source.fetch(self._rpc)
        return routing

    def _primary(self, shard: Shard, routing: Routing) -> str:
        bucket = self.layout.bucket_of[shard.id]
        route = routing.routes.get(bucket)
        if bucket in routing.unavailable:
            raise RpcError("bucket_unavailable", f"bucket {bucket} has no live copy to serve it")
        if route is None:
            raise RpcError("unavailable", f"bucket {bucket} has no primary in the routing table")
        return route.primary

    def _by_server(self, shards: Iterable[Shard], routing: Routing) -> dict[str, list[Shard]]:
        groups: dict[str, list[Shard]] = {}
        for s in shards:
            groups.setdefault(self._primary(s, routing), []).append(s)
        return groups

    def _with_retry(self, fn: Any) -> Any:
        """Runs fn(routing) until it succeeds (adamps.client.retry's policy within `retry_for`),
        re-reading the routing table before every attempt after a retryable error."""
        before, t0 = self._routing, time.monotonic()
        out = retry.call(
            RetryPolicy(self.retry_for),
            lambda n: fn(self.routing(refresh=n > 1)),
            retryable,
            on_retry=self._on_retry,
        )
        after = self._routing
        if before is not None and after is not None and after is not before:
            # the buckets this client reads and writes: its tensors', every one with tables
            used = None if self.tables else set(self.layout.bucket_of.values())
            self.failovers.observe(before, after, time.monotonic() - t0, used)
        return out

    def _on_retry(self, exc: BaseException, _attempt: int) -> None:
        self.retries += 1
        log.debug("retrying after %s", exc)

    # -- model definition ------------------------------------------------------------------------

    def create(
        self,
        spec: TensorSpec,
        init: Mapping[str, Any] | None = None,
        optimizer: Mapping[str, Any] | None = None,
    ) -> None:
        """Creates the tensor on every server (idempotent: creating it again with the same
        definition is fine). Initial values are derived from a seeded description, so every
        replica starts identical."""
        if spec.name not in self.layout.tensors:
            self.layout = self.layout.with_tensor(spec)
        fields: dict[str, Any] = {"name": spec.name, "shape": list(spec.shape)}
        if init is not None:
            fields["init"] = dict(init)
        if optimizer is not None:
            fields["optimizer"] = dict(optimizer)

        def go(routing: Routing) -> None:
            for b in self.layout.buckets_of_tensor(spec.name):
                if b not in routing.routes:
                    raise RpcError("unavailable", f"bucket {b} has no primary in the routing table")
            # Every server, not only the current replicas: copies move between servers, and a
            # server that holds the definition needs only the values from a state transfer.
            for url in routing.servers():
                self._rpc(url).call("create", **fields)

        self._with_retry(go)

    # -- pull ------------------------------------------------------------------------------------

    def pull(
        self, names: Sequence[str], out: Mapping[str, np.ndarray] | None = None
    ) -> tuple[dict[str, np.ndarray], dict[str, list[int]]]:
        """The current values of tensors `names` (into `out` arrays when given) and their per-shard
        version counters."""
        result = {n: (out[n] if out is not None and n in out else np.empty(self.layout.tensors[n].shape, np.float32))
                  for n in names}  # fmt: skip
        versions: dict[str, list[int]] = {n: [0] * len(self.layout.shards_of[n]) for n in names}
        shards = [s for n in names for s in self.layout.shards_of[n]]

        def flat(s: Shard) -> np.ndarray:
            return result[s.tensor].reshape(-1)[s.start : s.stop]

        def by_http(url: str, group: list[Shard]) -> None:
            reply = self._rpc(url).call("pull", shards=[s.id for s in group])
            for s in group:
                flat(s)[:] = reply["shards"][s.id].reshape(-1)
                versions[s.tensor][s.index] = int(reply["versions"][s.id])

        def read(dp: DataPlaneClient, group: list[Shard]) -> None:
            got = dp.read_pull_reply([flat(s) for s in group])  # straight into the results
            for s, v in zip(group, got, strict=True):
                versions[s.tensor][s.index] = int(v)

        def go(routing: Routing) -> None:
            # Each server's shards in requests under its limits (issue 30), pipelined.
            parts = {}
            for url, group in self._by_server(shards, routing).items():
                lim = self._frame_limits(url, frame=PULL_FRAME_BYTES)
                parts[url] = chunk(group, _dense_bytes, lim.budget(), lim.max_shards)
            self._exchange(
                _flat(parts),
                lambda dp, group: dp.send_pull_shards([s.id for s in group]),
                read,
                by_http,
            )

        self._with_retry(go)
        return result, versions

    @property
    def dp_requests(self) -> int:
        """Requests (frames) sent over the data plane."""
        return self._counts.dp

    @property
    def http_requests(self) -> int:
        """Requests sent over HTTP."""
        return self._counts.http

    def _frame_limits(self, url: str, fixed: int = 0, frame: int | None = None) -> Limits:
        """The limits a request to `url` is cut by: its own, and over its data plane frames of
        about `frame` bytes (default `frame_bytes`), pipelined (not for requests that repeat `fixed` bytes in every
        part, like push_fc's a and e: cutting would multiply them)."""
        lim = self._limits(url)
        if fixed or not self.data_plane or not self._dp.port(url):
            return lim
        # (room for the entries of the shards it holds too: 4 shards of 1 MiB fill 4 MiB)
        room = (frame or self.frame_bytes) + HEADROOM + FRAME_SHARDS * PER_SHARD
        return Limits(min(lim.max_body, room), lim.max_shards)

    def _limits(self, url: str) -> Limits:
        """`url`'s request limits, from its `GET /status` (asked once per server)."""
        with self._lock:
            got = self._server_limits.get(url)
        if got is None:
            got = Limits.of_status(self._rpc(url).get_json("/status"))
            with self._lock:
                self._server_limits[url] = got
        return got

    # -- push ------------------------------------------------------------------------------------

    def next_seq(self) -> int:
        return next(self._seq)

    def push_dense(self, name: str, delta: np.ndarray, seq: int | None = None) -> None:
        """w -= lr * delta on the servers (lr and optimizer of the tensor). Applied exactly once."""
        self.push_dense_many({name: delta}, seq)

    def push_dense_many(self, deltas: Mapping[str, np.ndarray], seq: int | None = None) -> None:
        """Dense deltas of several whole tensors in one request per server (a push of the conv
        layers and every bias costs one round trip, not one per tensor). Applied exactly once."""
        self._push_shards(self._dense_by_shard(deltas), seq)

    def _dense_by_shard(self, deltas: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Whole tensors' deltas, every one checked (push_checks), cut into their shards."""
        checked = {name: checks.dense(self.layout, name, d) for name, d in deltas.items()}
        by_id: dict[str, np.ndarray] = {}
        for name, delta in checked.items():
            parts = self.layout.split(name, delta)
            for s, part in zip(self.layout.shards_of[name], parts, strict=True):
                by_id[s.id] = part
        return by_id

    def push_shards(self, deltas: Mapping[str, np.ndarray], seq: int | None = None) -> None:
        """Dense deltas of individual shards (shard id -> values of the shard's shape), grouped
        into one push_dense per server; all parts carry the same (client id, seq), so a retry
        after a partial failure re-sends only what was not acknowledged, exactly once."""
        self._push_shards(checks.shards(self.layout, deltas), seq)

    def _push_shards(self, deltas: Mapping[str, np.ndarray], seq: int | None) -> None:
        self._push(
            "push_dense",
            [self.layout.shards[sid] for sid in deltas],
            lambda group: {"shards": {s.id: deltas[s.id] for s in group}},
            seq,
            stream=lambda dp, group, **f: dp.send_push_shards(
                [s.id for s in group], [deltas[s.id] for s in group], **f
            ),
            size_of=lambda s: int(np.asarray(deltas[s.id]).nbytes),
        )

    def push_compressed(
        self,
        updates: Mapping[str, Mapping[str, Any]],
        seq: int | None = None,
        hyper: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> None:
        """Compressed updates of individual shards (Strom; shard id -> ``{"tau", "words"}`` or
        ``{"tau", "n", "k", "rice"}``, see docs/protocol-ps.md ``push_compressed``), grouped
        into one request per server under one (client id, seq): applied exactly once; with
        the `hyper` (tensor -> hyperparameters) of their tensors."""
        checks.compressed(self.layout, updates)

        def fields(group: Sequence[Shard]) -> dict[str, Any]:
            f: dict[str, Any] = {"shards": {s.id: dict(updates[s.id]) for s in group}}
            named = {s.tensor for s in group} & (hyper or {}).keys()
            if named:
                f["hyper"] = {t: dict(hyper[t]) for t in sorted(named)}  # type: ignore[index]
            return f

        self._push(
            "push_compressed",
            [self.layout.shards[sid] for sid in updates],
            fields,
            seq,
            size_of=lambda s: sum(
                len(v) if isinstance(v, bytes | bytearray) else int(getattr(v, "nbytes", 8))
                for v in updates[s.id].values()
            ),
        )

    def push_fc(self, name: str, a: np.ndarray, e: np.ndarray, seq: int | None = None) -> None:
        """W -= lr * e.T @ a for a fully connected layer's M x N weight, computed by the servers
        from k activation vectors `a` (k x N) and error vectors `e` (k x M). Applied exactly once."""
        a, e = checks.fc(self.layout, name, a, e)
        self._push(
            "push_fc",
            self.layout.shards_of[name],
            lambda group: {"tensor": name, "a": a, "e": e, "shards": [s.id for s in group]},
            seq,
            fixed=a.nbytes + e.nbytes,  # every part carries a and e
        )

    def push_round(
        self,
        fc: Mapping[str, tuple[np.ndarray, np.ndarray]],
        dense: Mapping[str, np.ndarray],
        seq: int | None = None,
    ) -> None:
        """A trainer's round of fc vectors (as `push_fc`) and dense deltas (as
        `push_dense_many`): `round` (adamps/client/round.py) without rows or fetches, one
        request per server, applied exactly once under one (client id, seq)."""
        self.round(fc, dense, seq=seq)

    def _push(
        self,
        op: str,
        shards: Sequence[Shard],
        fields: Any,
        seq: int | None,
        stream: Any = None,
        size_of: Callable[[Shard], int] = lambda _s: 0,
        fixed: int = 0,
    ) -> None:
        """Push `op` of `shards` with `fields(group)` (over HTTP) or `stream(conn, group,
        client=, seq=)` (over the data plane where offered; by default the same message as a
        message frame). One request per primary under one (client id, seq) when it fits the
        server's limits, else parts (adamps/client/parts.py: `size_of` a shard's payload
        bytes, `fixed` the bytes every part repeats); after a partial failure only the
        unacknowledged parts are sent again, each with its own pair."""
        seq = self.next_seq() if seq is None else seq
        done: set[str] = set()
        if stream is None:  # a message frame: the /rpc message, its arrays out of band

            def stream(dp: DataPlaneClient, group: list[Shard], **f: Any) -> bool:
                return dp.send_message(op, **fields(group), **f)

        #: the push's units, planned once (a retry sends the same parts under the same pairs)
        units: list[Unit] = []
        #: first shard id of a request sent in this round -> its pair
        pairs: dict[str, dict[str, Any]] = {}
        #: bucket -> the server its part was last sent to (PartialPushError)
        sent_to: dict[int, str] = {}

        def by_http(url: str, group: list[Shard]) -> None:
            self._rpc(url).call(op, **fields(group), **pairs[group[0].id])
            done.update(s.id for s in group)

        def read(dp: DataPlaneClient, group: list[Shard]) -> None:
            dp.read_push_reply()
            done.update(s.id for s in group)

        def go(routing: Routing) -> None:
            if not units:
                urls = {self._primary(s, routing) for s in shards}
                limits = Limits.tightest(self._limits(u) for u in urls)
                units.extend(plan_push(shards, self.layout.bucket_of, size_of, limits, fixed))
            per_server: dict[str, list[Unit]] = {}
            for u in units:
                if u.shards[0].id not in done:
                    per_server.setdefault(self._primary(u.shards[0], routing), []).append(u)
            # Frames of one pair may split a server's request by bucket: each bucket applies
            # the pair once (docs/protocol-ps.md, "client and seq"), whatever frame carries it.
            rounds = {
                url: pack(us, size_of, self._frame_limits(url, fixed), fixed)
                for url, us in per_server.items()
            }
            groups = []
            for url, req in _flat(rounds):
                group = [s for u in req for s in u.shards]
                pairs[group[0].id] = {"client": self.client_id + req[0].client_suffix, "seq": seq}
                sent_to.update((u.bucket, url) for u in req)
                groups.append((url, group))
            self._exchange(
                groups, lambda dp, group: stream(dp, group, **pairs[group[0].id]), read, by_http
            )

        try:
            self._with_retry(go)
        except Exception as exc:
            # Some buckets may have applied their parts: the caller learns which (issue 39)
            short = {u.bucket for u in units if any(s.id not in done for s in u.shards)}
            applied = {u.bucket for u in units} - short
            partial = partial_of(exc, op, self.client_id, seq, sent_to, applied, short)
            if partial is None:
                raise
            raise partial from exc

    def _exchange(
        self, groups: Iterable[tuple[str, Any]], send: Any, read: Any, by_http: Any
    ) -> None:
        """Requests (server URL, group; each server's in order): over the data plane to every
        server that offers one, pipelined per connection (adamps/client/exchange.py), else over
        HTTP. Every reply sent for is read (or its connection dropped) before the first error
        is raised."""
        exchange(self._dp if self.data_plane else None, groups, send, read, by_http, self._counts)

    def close(self) -> None:
        """Closes every thread's connections (call when no thread uses the client any more)."""
        with self._lock:
            rpcs, self._all_rpcs = self._all_rpcs, []
        for rpc in rpcs:
            rpc.close()
        self._dp.close()

    def __enter__(self) -> PSClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
