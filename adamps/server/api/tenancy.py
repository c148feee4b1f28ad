"""Runs on a parameter server (issue 25): who a request is, what it may name, and its quotas.

The server learns the runs from the controllers, as it learns its roles: every heartbeat reply
carries the controllers' ``runs_version``; when it differs from the one this server holds, the
server fetches ``GET /auth/runs`` (token hashes, quotas, deletions). A token that is neither the
cluster token nor a known run's makes the server fetch once more (at most every
`MISS_INTERVAL`) before it answers 401, so that a run created a moment ago is served at once.

What a run's token may do: the ops of `RUN_OPS`, on names in its namespace only (403
``forbidden`` naming the namespace); everything else (replication, flush, checkpoints) is the
operator's. Quotas: parameter elements, table rows and memory bytes at create (403
``quota_exceeded``): checked first against the definitions this server holds, then counted by
the controllers across every server (`reserve`, issue 39); push bytes per second on each server
(429 ``rate_limited`` with Retry-After; nothing is applied, the client retries).

Deleting a run drops its tensors here (memory and LMDB records), once the server learns of it.
A standalone server (no controllers) knows no runs: the cluster token only.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from adamps import rowdtype, runs
from adamps.server.storage.persist import Persister
from adamps.server.store.store import Store
from adamps.server.updates.optim import OptimError, Optimizer
from adamps.tables import ROWS_SEP, Admission, TableError
from adamps.wire.protocol import ProtocolError

log = logging.getLogger(__name__)

#: the ops a run's token may call (on its own names)
RUN_OPS = frozenset(
    {
        "create", "pull", "push_dense", "push_fc", "push_compressed", "describe", "list",
        "create_table", "list_tables", "pull_rows", "push_rows", "put_rows", "vec", "vec_dot",
        "clock", "round",
    }
)  # fmt: skip
#: ops whose bytes count against push_bytes_per_s
PUSH_OPS = frozenset(
    {"push_dense", "push_fc", "push_compressed", "push_rows", "put_rows", "vec", "round"}
)
#: fewest seconds between two fetches caused by an unknown token
MISS_INTERVAL = 0.5


def _names(msg: dict[str, Any]) -> list[str]:
    """Every tensor, shard or table name a message names (any op)."""
    out: list[str] = []
    for f in ("name", "tensor", "table"):
        v = msg.get(f)
        if v is not None:
            out.append(v)
    for f in ("tensors", "shards", "layers", "dense_shards", "compressed"):
        v = msg.get(f)
        if isinstance(v, dict):
            out += list(v)
        elif isinstance(v, list):
            out += v
        elif v is not None:
            out.append(v)
    layers = msg.get("layers")
    if isinstance(layers, dict):  # push_fc of a whole round: each layer may name its shards
        for layer in layers.values():
            shards = layer.get("shards") if isinstance(layer, dict) else None
            if isinstance(shards, list):
                out += shards
            elif shards is not None:
                out.append(shards)
    for f in ("rows", "fetch_rows"):  # a round's tables (roundop.py)
        entries = msg.get(f)
        if isinstance(entries, list):
            out += [x.get("table") for x in entries if isinstance(x, dict)]
    return out


def _elems(shape: Any) -> int:
    if not isinstance(shape, list) or not all(
        isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape
    ):
        return 0  # the create's own validation refuses it, with the reason
    n = 1
    for s in shape:
        n *= s
    return n


class Tenancy:
    """The runs this server knows and the checks of each request (event-loop thread)."""

    def __init__(
        self, token: str, store: Store, persister: Persister, registry: CollectorRegistry
    ) -> None:
        self.token = token.encode()
        self.store = store
        self.persister = persister
        #: token hash -> run name
        self.by_hash: dict[str, str] = {}
        #: run -> its record ({"token_hash", "quotas", "version"})
        self.runs: dict[str, dict[str, Any]] = {}
        #: the controllers' runs_version this table reflects (None: never fetched)
        self.version: int | None = None
        #: fetches GET /auth/runs (set by a server under controllers)
        self.fetch: Callable[[], Awaitable[dict[str, Any]]] | None = None
        #: asks the controllers to count a new definition against its run's size quotas
        #: (run, name, cost; set by a server under controllers)
        self.use: Callable[[str, str, dict[str, int]], Awaitable[Any]] | None = None
        self._fetching: asyncio.Task | None = None
        self._last_miss = -1e9
        #: run -> bytes of its pushes admitted here (for `adamps status`)
        self.pushed: dict[str, int] = {}
        #: run -> its push-rate limiter
        self.rates: dict[str, runs.PushRate] = {}
        self.m_push_bytes = Counter(
            "adamps_run_push_bytes",
            "bytes of pushes admitted, by run",
            ["run"],
            registry=registry,
        )
        self.m_refused = Counter(
            "adamps_run_refused",
            "requests of a run's token refused, by run and reason (namespace or a quota)",
            ["run", "reason"],
            registry=registry,
        )
        registry.register(_RunCollector(self))
        self.m_quota = Gauge(
            "adamps_run_quota",
            "a run's quota (param_elems, table_rows, push_bytes_per_s)",
            ["run", "quota"],
            registry=registry,
        )

    # -- learning the runs ------------------------------------------------------------------------

    def on_heartbeat(self, reply: dict[str, Any]) -> None:
        v = reply.get("runs_version")
        if isinstance(v, int) and v != self.version:
            self._refresh_soon()

    def _refresh_soon(self) -> asyncio.Task | None:
        if self.fetch is None:
            return None
        if self._fetching is None or self._fetching.done():
            self._fetching = asyncio.ensure_future(self._refresh())
        return self._fetching

    async def _refresh(self) -> None:
        assert self.fetch is not None
        try:
            gone = self.learn(await self.fetch())
            if gone:  # LMDB's write off the event loop (the persister is thread-safe)
                loop = asyncio.get_running_loop()
                await loop.run_in_executor(None, self.persister.forget_tensors, gone)
        except Exception as exc:  # the next heartbeat tries again
            log.warning("could not fetch the runs from the controllers: %s", exc)

    def learn(self, table: dict[str, Any]) -> list[str]:
        """Takes the controllers' run table; drops the tensors of deleted runs from memory and
        returns the names whose LMDB records go too (`Persister.forget_tensors`)."""
        gone: list[str] = []
        recs = table.get("runs") or {}
        self.runs = {n: dict(r) for n, r in recs.items()}
        self.by_hash = {r["token_hash"]: n for n, r in self.runs.items()}
        self.rates = {n: r for n, r in self.rates.items() if n in self.runs}
        for n, r in self.runs.items():
            for q in runs.QUOTAS:
                if q in r["quotas"]:
                    self.m_quota.labels(n, q).set(r["quotas"][q])
        dead = set()
        for name, version in table.get("deleted") or []:
            rec = self.runs.get(name)
            if rec is None or int(rec.get("version", 0)) < int(version):
                dead.add(name)
                gone += self.drop_run(name)
        # Before the next loop step: an update of theirs in a round in flight is refused alone.
        self.store.deleted_runs = frozenset(dead)
        self.version = int(table.get("runs_version", 0))
        return gone

    def drop_run(self, run: str) -> list[str]:
        """Frees a deleted run's tensors and tables in memory; returns the names of their LMDB
        records (definitions and shards) to delete. Idempotent."""
        for quota in runs.QUOTAS:
            try:
                self.m_quota.remove(run, quota)
            except KeyError:
                pass
        names = [n for n in self.store.tensors if runs.run_of(n) == run]
        tables = [n for n in self.store.tables.tables if runs.run_of(n) == run]
        if not names and not tables:
            return []
        dropped = self.store.forget_tensors(names)
        dropped += sum(self.store.tables.forget(n) for n in tables)
        log.warning(
            "run %s was deleted: dropped its %d tensors and %d tables (%d held shards) from "
            "memory and LMDB",
            run,
            len(names),
            len(tables),
            dropped,
        )
        # A table's records: its definition "<table>#rows" and row shards "<table>#rows/<b>".
        return names + [n + ROWS_SEP[:-1] for n in tables]

    # -- who calls --------------------------------------------------------------------------------

    def known(self, token: str) -> runs.Principal | None:
        raw = token.strip().encode("utf-8", "surrogateescape")
        if hmac.compare_digest(raw, self.token):
            return runs.Principal()
        name = self.by_hash.get(runs.token_hash(token)) if self.runs else None
        return None if name is None else runs.Principal(name)

    async def authenticate(self, header: str | None) -> runs.Principal:
        """The principal of `Authorization: Bearer <token>`; 401 if none is known (after one
        fetch from the controllers, at most every MISS_INTERVAL)."""
        scheme, _, given = (header or "").partition(" ")
        if scheme.lower() != "bearer" or not given.strip():
            raise ProtocolError(
                "unauthorized", "missing token: send 'Authorization: Bearer <token>'"
            )
        who = self.known(given)
        if who is None:
            task = self._fetching  # a fetch in flight may bring this token: wait for it
            if (task is None or task.done()) and (
                time.monotonic() - self._last_miss >= MISS_INTERVAL
            ):
                self._last_miss = time.monotonic()
                task = self._refresh_soon()
            if task is not None and not task.done():
                await asyncio.shield(task)
            who = self.known(given)
        if who is None:
            raise ProtocolError("unauthorized", "wrong cluster token, or no run has this token")
        return who

    def authenticate_now(self, token: Any) -> runs.Principal:
        """The same without waiting (the data plane's frame parser is synchronous): an unknown
        token starts a fetch and is refused; the client's HTTP calls (creates) come first."""
        who = self.known(token) if isinstance(token, str) else None
        if who is None:
            if time.monotonic() - self._last_miss >= MISS_INTERVAL:
                self._last_miss = time.monotonic()
                self._refresh_soon()
            raise ProtocolError(
                "unauthorized", "missing or wrong cluster token (or unknown run token) in the meta"
            )
        return who

    # -- what it may do ---------------------------------------------------------------------------

    def check(self, who: runs.Principal, op: str, msg: dict[str, Any], nbytes: int) -> None:
        """Raises unless `who` may send `msg`: op and names (namespace), then the quotas."""
        run = who.run
        if run is None:
            return
        if op not in RUN_OPS:
            self._refuse(run, "op")
            raise ProtocolError(
                "forbidden",
                f"op {op!r} is the operator's (the cluster token); run {run!r}'s token may "
                f"call {sorted(RUN_OPS)}",
                run=run,
            )
        if op == "clock" and msg.get("run") != run:
            # a run's step clocks are its own: another run's would hold back or release that
            # run's replicas (the consistency modes, adamps/server/api/clockops.py)
            self._refuse(run, "namespace")
            raise ProtocolError(
                "forbidden",
                f"run {run!r}'s token reports step clocks only for run {run!r}, not "
                f"{msg.get('run')!r}",
                run=run,
            )
        outside = who.outside(_names(msg))
        if outside is not None:
            self._refuse(run, "namespace")
            raise ProtocolError(
                "forbidden",
                f"run {run!r}'s token may only name tensors and tables in its namespace "
                f"{runs.namespace(run)!r}; {outside!r} is outside it",
                namespace=runs.namespace(run),
                run=run,
            )
        quotas = self.runs.get(run, {}).get("quotas", {})
        if op == "create" and "param_elems" in quotas:
            self._check_elems(run, msg, quotas["param_elems"])
        if op == "create_table" and "table_rows" in quotas:
            self._check_rows(run, msg, quotas["table_rows"])
        if op in PUSH_OPS:
            self.check_rate(run, nbytes, quotas)

    async def reserve(self, who: runs.Principal, op: str, msg: dict[str, Any]) -> None:
        """Before a run's new tensor or table is created here: the controllers count what it
        holds per copy against the run's size quotas, summed over every server (issue 39: each
        server checked only its own definitions, so a run could hold its quota on each)."""
        run = who.run
        if run is None or op not in ("create", "create_table") or self.use is None:
            return
        quotas = self.runs.get(run, {}).get("quotas", {})
        if not any(q in quotas for q in runs.SIZE_QUOTAS):
            return
        name = msg.get("name")
        defined = self.store.tensors if op == "create" else self.store.tables.tables
        if not isinstance(name, str) or name in defined:
            return  # a repeated create allocates nothing; a bad name is the create's to refuse
        cost = self._cost(op, msg)
        if cost is None:
            if op == "create_table" and "memory_bytes" in quotas:
                self._refuse(run, "memory_bytes")
                raise ProtocolError(
                    "quota_exceeded",
                    f"run {run!r} has a memory_bytes quota: a table needs admission.max_rows",
                    quota="memory_bytes",
                    limit=quotas["memory_bytes"],
                    run=run,
                )
            return  # the create's own checks refuse it
        try:
            await self.use(run, name, cost)
        except ProtocolError as exc:
            if exc.code == "quota_exceeded":
                self._refuse(run, str(exc.extra.get("quota", "quota")))
            raise
        except (ConnectionError, TimeoutError, OSError) as exc:
            raise ProtocolError(
                "unavailable",
                f"the controllers did not answer ({exc}): run {run!r}'s quotas cannot be "
                "checked; retry",
            ) from None

    def _cost(self, op: str, msg: dict[str, Any]) -> dict[str, int] | None:
        """What the definition in `msg` holds per copy (runs.tensor_cost, runs.table_cost);
        None when it is malformed (the create refuses it with the reason) or unbounded."""
        try:
            opt = Optimizer.from_dict(msg.get("optimizer") or {"kind": "sgd"})
            if op == "create":
                n = _elems(msg.get("shape"))
                return runs.tensor_cost(n, opt.state_size(n)) if n else None
            adm = Admission.from_dict(msg.get("admission") or {})
            dim = msg.get("dim")
            if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
                return None
            width = adm.filter_width if adm.admit_after > 1 else None
            n_buckets = self.store.layout.n_buckets
            vb = rowdtype.itemsize(rowdtype.check(msg.get("dtype") or "float32"))
            return runs.table_cost(
                adm.max_rows, dim, opt.row_state_width(dim), width, n_buckets, value_bytes=vb
            )
        except (OptimError, TableError, TypeError, ValueError):
            return None

    def _check_elems(self, run: str, msg: dict[str, Any], quota: int) -> None:
        if msg.get("name") in self.store.tensors:
            return  # a repeated create allocates nothing
        have = sum(t.spec.size for n, t in self.store.tensors.items() if runs.run_of(n) == run)
        asked = _elems(msg.get("shape"))
        if have + asked > quota:
            self._refuse(run, "param_elems")
            raise ProtocolError(
                "quota_exceeded",
                f"run {run!r} holds {have} parameter elements; {msg.get('name')!r} would add "
                f"{asked}, past its quota param_elems = {quota}",
                quota="param_elems",
                limit=quota,
                run=run,
            )

    def _check_rows(self, run: str, msg: dict[str, Any], quota: int) -> None:
        tables = self.store.tables.tables
        if msg.get("name") in tables:
            return
        adm = msg.get("admission")
        rows = adm.get("max_rows") if isinstance(adm, dict) else None
        have = sum(
            t.spec.admission.max_rows or 0 for n, t in tables.items() if runs.run_of(n) == run
        )
        if not isinstance(rows, int) or isinstance(rows, bool) or have + rows > quota:
            self._refuse(run, "table_rows")
            raise ProtocolError(
                "quota_exceeded",
                f"run {run!r} has a table_rows quota of {quota} ({have} given to its tables): "
                "a table needs admission.max_rows within what is left, got "
                f"{rows!r}",
                quota="table_rows",
                limit=quota,
                run=run,
            )

    def check_rate(
        self, run: str | None, nbytes: int, quotas: dict[str, Any] | None = None
    ) -> None:
        if run is None:
            return
        quotas = self.runs.get(run, {}).get("quotas", {}) if quotas is None else quotas
        rate = quotas.get("push_bytes_per_s")
        if rate is not None:
            limiter = self.rates.get(run)
            if limiter is None or limiter.rate != rate:
                limiter = self.rates[run] = runs.PushRate(float(rate))
            wait = limiter.take(nbytes, time.monotonic())
            if wait > 0:
                self._refuse(run, "push_bytes_per_s")
                raise ProtocolError(
                    "rate_limited",
                    f"run {run!r} pushed past its quota push_bytes_per_s = {rate:g} on this "
                    f"server; retry in {wait:.2f} s",
                    quota="push_bytes_per_s",
                    limit=rate,
                    retry_after=round(wait, 3),
                    run=run,
                )
        self.m_push_bytes.labels(run).inc(nbytes)
        self.pushed[run] = self.pushed.get(run, 0) + nbytes

    def filter_reply(self, who: runs.Principal, op: str, reply: dict[str, Any]) -> dict[str, Any]:
        """A run's `list` and `list_tables` show its own names only."""
        if who.run is None or op not in ("list", "list_tables"):
            return reply
        key = "tensors" if op == "list" else "tables"
        return {**reply, key: [d for d in reply.get(key, []) if runs.run_of(d["name"]) == who.run]}

    def _refuse(self, run: str, reason: str) -> None:
        self.m_refused.labels(run, reason).inc()

    def status(self) -> dict[str, Any]:
        per: dict[str, dict[str, int]] = {}
        for n, t in list(self.store.tensors.items()):
            r = runs.run_of(n)
            if r is not None:
                d = per.setdefault(
                    r, {"tensors": 0, "param_elems": 0, "held_bytes": 0, "pushed_bytes": 0}
                )
                d["tensors"] += 1
                d["param_elems"] += t.spec.size
                d["held_bytes"] += sum(4 * st.shard.size for st in list(t.shards.values()))
        for r, d in per.items():
            d["pushed_bytes"] = self.pushed.get(r, 0)
        return {"runs_version": self.version, "runs": per}


class _RunCollector(Collector):
    """Per run, at scrape time (the event loop serves /metrics): its tensors and parameter
    elements defined on this server, held shards and their bytes."""

    def __init__(self, tenancy: Tenancy) -> None:
        self.tenancy = tenancy

    def collect(self) -> Iterator[GaugeMetricFamily]:
        per = self.tenancy.status()["runs"]
        families = {
            "tensors": GaugeMetricFamily(
                "adamps_run_tensors", "tensors of a run defined on this server", labels=["run"]
            ),
            "param_elems": GaugeMetricFamily(
                "adamps_run_param_elems",
                "parameter elements of a run's tensors defined on this server",
                labels=["run"],
            ),
            "held_bytes": GaugeMetricFamily(
                "adamps_run_held_bytes",
                "bytes of a run's shards held in memory by this server (values)",
                labels=["run"],
            ),
        }
        for run, d in sorted(per.items()):
            for key, fam in families.items():
                fam.add_metric([run], d[key])  # (pushed_bytes: the counter above has it)
        yield from families.values()
