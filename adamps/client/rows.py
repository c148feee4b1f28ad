"""The embedding-table half of ``PSClient`` (issue 23): ``create_table``, ``pull_rows``,
``push_rows`` and ``put_rows`` (values: a bulk load), routed by the bucket of each id (``adamps.tables.buckets_of``), one request per
primary, over the data plane as message frames where offered, else over HTTP.

A push follows the dense pushes' client contract: one (client id, seq) for every part; on a
retryable error the routing table is refreshed and only the parts not acknowledged are sent
again, with the same (client id, seq), so each is applied exactly once."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from adamps.client import push_checks as checks
from adamps.client.dataplane import DataPlaneClient
from adamps.client.partial import partial_of
from adamps.client.rpc import RpcError
from adamps.tables import split_by_bucket


def as_ids(ids: Any) -> np.ndarray:
    """`ids` as a 1-D int64 array (integers only: a float id is a caller's bug, never rounded)."""
    a = np.asarray(ids)
    if a.ndim != 1 or (a.size and a.dtype.kind not in "iu"):
        raise TypeError(f"ids must be a 1-D array of integers, got {a.dtype.name} {list(a.shape)}")
    if a.dtype.kind == "u" and a.size and int(a.max()) >= 1 << 63:
        raise TypeError("ids must fit int64")
    return np.ascontiguousarray(a, dtype=np.int64)


class RowsClient:
    """Mixed into PSClient (which provides routing, retries, connections and sequence numbers)."""

    #: table name -> dim, learned at create_table
    tables: dict[str, int]

    def create_table(
        self,
        name: str,
        dim: int,
        init: Mapping[str, Any] | None = None,
        optimizer: Mapping[str, Any] | None = None,
        admission: Mapping[str, Any] | None = None,
        dtype: str | None = None,
    ) -> None:
        """Defines the table on every server (idempotent, as `create`). `dtype`: how the servers
        store its values, "float32" (None: the default), "float16" or "bfloat16" (the rows
        still travel as float32; the optimizer's state stays float32)."""
        fields: dict[str, Any] = {"name": name, "dim": dim}
        if dtype is not None:
            fields["dtype"] = dtype
        for k, v in (("init", init), ("optimizer", optimizer), ("admission", admission)):
            if v is not None:
                fields[k] = dict(v)

        def go(routing: Any) -> None:
            for url in routing.servers():
                self._rpc(url).call("create_table", **fields)

        self._with_retry(go)
        self.tables[name] = dim

    def _groups(
        self, ids: np.ndarray, routing: Any, skip: set[int]
    ) -> list[tuple[str, list[tuple[int, np.ndarray]]]]:
        """(primary url, [(bucket, positions in ids)]) of the buckets not in `skip`, one request
        per server (PSClient._exchange's groups)."""
        groups: dict[str, list[tuple[int, np.ndarray]]] = {}
        for b, pos in split_by_bucket(ids, self.layout.n_buckets).items():
            if b in skip:
                continue
            if b in routing.unavailable:
                raise RpcError("bucket_unavailable", f"bucket {b} has no live copy to serve it")
            route = routing.routes.get(b)
            if route is None:
                raise RpcError("unavailable", f"bucket {b} has no primary in the routing table")
            groups.setdefault(route.primary, []).append((b, pos))
        return list(groups.items())

    def pull_rows(self, table: str, ids: Any) -> np.ndarray:
        """The rows of `ids` ([len(ids), dim] float32). An id never pushed reads as its initial
        value; a pull creates no row."""
        ids = as_ids(ids)
        dim = self.tables.get(table)
        out: np.ndarray | None = None if dim is None else np.empty((len(ids), dim), np.float32)

        def idx(group: list[tuple[int, np.ndarray]]) -> np.ndarray:
            return np.concatenate([p for _, p in group])

        def put(group: list[tuple[int, np.ndarray]], rows: np.ndarray) -> None:
            nonlocal out
            if out is None:
                out = np.empty((len(ids), rows.shape[1]), np.float32)
            out[idx(group)] = rows

        def by_http(url: str, group: list[tuple[int, np.ndarray]]) -> None:
            put(group, self._rpc(url).call("pull_rows", table=table, ids=ids[idx(group)])["rows"])

        def read(dp: DataPlaneClient, group: list[tuple[int, np.ndarray]]) -> None:
            put(group, dp.read_message_reply()["rows"])

        def go(routing: Any) -> None:
            self._exchange(
                self._groups(ids, routing, set()),
                lambda dp, group: dp.send_message("pull_rows", table=table, ids=ids[idx(group)]),
                read,
                by_http,
            )

        if len(ids):
            self._with_retry(go)
        if out is None:
            out = np.empty((0, 0), np.float32)
        return out

    def push_rows(self, table: str, ids: Any, grads: np.ndarray, seq: int | None = None) -> None:
        """Row gradients (``grads[k]`` for ``ids[k]``; duplicate ids are summed) applied by the
        servers' per-row optimizer, exactly once. Checked whole before any server is sent its
        part (push_checks: a NaN row refuses the push everywhere); a push that fails after some
        buckets applied their rows raises PartialPushError naming them. At least one id: an empty
        push is a ValueError here, as the servers refuse it (400 bad_request)."""
        ids = as_ids(ids)
        if not len(ids):
            raise ValueError(
                f"push_rows of table {table!r} needs at least one id, got none: with nothing to "
                "push, do not call it"
            )
        grads = checks.rows(ids, grads, self.tables.get(table))
        self._send_rows("push_rows", "grads", table, ids, grads, seq)

    def put_rows(self, table: str, ids: Any, values: np.ndarray, seq: int | None = None) -> None:
        """Sets the rows of `ids` (distinct) to `values` ([len(ids), dim] float32), their
        optimizer state to its initial value (a bulk load: ``adamps table load``), exactly once,
        through the push path (the same retries: a ``not_durable`` refusal is retried for
        ``retry_for``, only the buckets not applied; after it PartialPushError names them)."""
        ids = as_ids(ids)
        if not len(ids):
            raise ValueError(f"put_rows of table {table!r} needs at least one id, got none")
        if len(np.unique(ids)) != len(ids):
            raise ValueError(f"put_rows of table {table!r}: an id appears more than once")
        values = checks.rows(ids, values, self.tables.get(table))
        self._send_rows("put_rows", "values", table, ids, values, seq)

    def _send_rows(
        self, op: str, field: str, table: str, ids: np.ndarray, arr: np.ndarray, seq: int | None
    ) -> None:
        seq = self.next_seq() if seq is None else seq
        pair = {"client": self.client_id, "seq": seq}
        done: set[int] = set()
        #: bucket -> the server its rows were last sent to
        sent_to: dict[int, str] = {}

        def fields(group: list[tuple[int, np.ndarray]]) -> dict[str, Any]:
            pos = np.concatenate([p for _, p in group])
            return {"table": table, "ids": ids[pos], field: arr[pos]}

        def by_http(url: str, group: list[tuple[int, np.ndarray]]) -> None:
            self._rpc(url).call(op, **fields(group), **pair)
            done.update(b for b, _ in group)

        def read(dp: DataPlaneClient, group: list[tuple[int, np.ndarray]]) -> None:
            dp.read_message_reply()
            done.update(b for b, _ in group)

        def go(routing: Any) -> None:
            groups = self._groups(ids, routing, done)
            sent_to.update((b, url) for url, group in groups for b, _ in group)
            self._exchange(
                groups,
                lambda dp, group: dp.send_message(op, **fields(group), **pair),
                read,
                by_http,
            )

        try:
            self._with_retry(go)
        except Exception as exc:
            buckets = split_by_bucket(ids, self.layout.n_buckets)
            partial = partial_of(exc, op, self.client_id, seq, sent_to, done, buckets)
            if partial is None:
                raise
            raise partial from exc
