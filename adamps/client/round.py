"""The Downpour round client, one for both engines (issue 36 item 2): a replica's round is one
request per server (the ``round`` op, docs/protocol-ps.md), and its answer carries the rows the
replica fetches next (ps-lite's ZPushPull shape).

A round carries everything the replica sends (fully connected layers' activation and error
vectors, dense deltas of other tensors, Strom's compressed updates, embedding tables' row
gradients) and names the rows it
fetches. Everything is checked whole before anything is sent (push_checks). Each bucket's writes
ride the request to its primary under the round's one (client id, seq); on a retryable error the
routing table is refreshed and only what was not answered is sent again, under the same pair, so
every bucket applies its part exactly once, rows included, also across a failover. A bucket whose
writes were acknowledged but whose fetch was not answered is asked again for its fetch alone.

A round larger than the servers' request limits (``max_body``, ``max_shards_per_request``) is
sent the older way, in parts (``_push_round_parts``, ``push_compressed``, ``push_rows``,
``pull_rows``), each exactly once under its own pair.

``adamps.client.prefetch.RowPipeline`` pipelines tables' rows over rounds (PERSIA, Monolith):
the next batch's rows are fetched while the current batch computes, with a bound on their
staleness (its docstring, docs/training.md "Pipelined rows").

``use_act_err`` is the one rule, for both engines, for when a fully connected layer's update
travels as vectors.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from adamps.client import push_checks as checks
from adamps.client.dataplane import DataPlaneClient
from adamps.client.partial import partial_of
from adamps.client.parts import PER_SHARD, Limits
from adamps.client.rows import as_ids
from adamps.client.rpc import RpcError
from adamps.layout import Shard
from adamps.tables import split_by_bucket


def use_act_err(k: int, m: int, n: int) -> bool:
    """Send a fully connected M x N layer's k activation and error vectors instead of its
    update (Adam 3.2.6): when they are smaller, k * (M + N) < M * N."""
    return k * (m + n) < m * n


def _nbytes(update: Mapping[str, Any]) -> int:
    """A compressed update's payload bytes (its words or Rice stream)."""
    return sum(
        len(v) if isinstance(v, bytes | bytearray) else int(getattr(v, "nbytes", 8))
        for v in update.values()
    )


class _Bucket:
    """What one round sends to (and asks of) one bucket."""

    __slots__ = ("shards", "rows", "fetch", "values")

    def __init__(self) -> None:
        #: the dense and fc shards of this bucket
        self.shards: list[Shard] = []
        #: table -> positions in that table's ids (rows pushed)
        self.rows: dict[str, np.ndarray] = {}
        #: table -> positions in that table's fetched ids
        self.fetch: dict[str, np.ndarray] = {}
        #: the dense shards whose values this bucket answers (``fetch``)
        self.values: list[Shard] = []


class RoundClient:
    """Mixed into PSClient (routing, retries, connections, sequence numbers, limits)."""

    def round(
        self,
        fc: Mapping[str, tuple[np.ndarray, np.ndarray]] | None = None,
        dense: Mapping[str, np.ndarray] | None = None,
        rows: Mapping[str, tuple[Any, np.ndarray]] | None = None,
        fetch_rows: Mapping[str, Any] | None = None,
        seq: int | None = None,
        compressed: Mapping[str, Mapping[str, Any]] | None = None,
        hyper: Mapping[str, Mapping[str, Any]] | None = None,
        fetch: Mapping[str, np.ndarray] | None = None,
        fetch_versions: dict[str, list[int]] | None = None,
    ) -> dict[str, np.ndarray]:
        """One round: `fc` (layer -> (a [k, N], e [k, M])), `dense` (tensor -> delta), `rows`
        (table -> (ids, grads), duplicate ids summed) and `compressed` (shard id -> Strom
        update, as push_compressed's) applied exactly once under one (client id,
        seq); returns the rows of `fetch_rows` (table -> ids) read after this round's writes
        (table -> [len(ids), dim] float32). One request per server when it fits the servers'
        limits. `hyper` (tensor -> optimizer hyperparameters, torch's names): the updates of
        those tensors are applied with them (docs/protocol-ps.md, "hyper": a scheduler's lr);
        each request carries the entries of the tensors it updates. `fetch` (tensor -> a
        C-contiguous float32 array of its shape): filled with the tensors' values read after
        this round's writes, in the same requests (a synchronous Downpour step's push and fetch
        in one request per server, not a round and a pull each). `fetch_versions`, when given, is
        filled with those tensors' shard versions as ``pull`` returns them (tensor -> per shard:
        the updates it has applied)."""
        hyper = dict(hyper or {})
        vecs = {n: checks.fc(self.layout, n, a, e) for n, (a, e) in (fc or {}).items()}
        by_id = self._dense_by_shard(dense or {})
        signs = dict(compressed or {})
        if signs:
            checks.compressed(self.layout, signs)
        pushed: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        for t, (ids, grads) in (rows or {}).items():
            ids = as_ids(ids)
            if len(ids):  # a batch without ids has no row to push
                pushed[t] = (ids, checks.rows(ids, grads, self.tables.get(t)))
        wanted = {t: as_ids(ids) for t, ids in (fetch_rows or {}).items()}
        out: dict[str, np.ndarray] = {}
        for t, ids in list(wanted.items()):
            if not len(ids):
                out[t] = np.empty((0, self.tables.get(t, 0)), np.float32)
                del wanted[t]
        values = dict(fetch or {})
        for t, arr in values.items():
            spec = self.layout.tensors.get(t)
            if spec is None:
                raise ValueError(f"fetch: unknown tensor {t!r}")
            if arr.dtype != np.float32 or arr.size != spec.size or not arr.flags.c_contiguous:
                raise ValueError(f"fetch: {t!r} needs a C-contiguous float32 array of {spec.shape}")
        if not (vecs or by_id or signs or pushed or wanted or values):
            return out
        seq = self.next_seq() if seq is None else seq
        layer_of = {s.id: n for n in vecs for s in self.layout.shards_of[n]}
        twice = sorted(set(signs) & (set(by_id) | set(layer_of)) | (set(by_id) & set(layer_of)))
        if twice:
            raise ValueError(f"a round names shards twice (one update each): {twice[:5]}")
        shards = [s for n in vecs for s in self.layout.shards_of[n]]
        shards += [self.layout.shards[sid] for sid in by_id]
        shards += [self.layout.shards[sid] for sid in signs]
        size = sum(int(by_id[s.id].nbytes) if s.id in by_id else 0 for s in shards)
        size += sum(_nbytes(u) for u in signs.values())
        size += sum(a.nbytes + e.nbytes for a, e in vecs.values()) + PER_SHARD * len(shards)
        size += sum(i.nbytes + g.nbytes for i, g in pushed.values())
        size += sum(i.nbytes + 4 * i.size * self.tables.get(t, 0) for t, i in wanted.items())
        size += sum(
            4 * arr.size + PER_SHARD * len(self.layout.shards_of[t]) for t, arr in values.items()
        )
        #: whether the round is too large for one request per server (decided once, before
        #: anything is sent, from the limits of the primaries it goes to)
        in_parts: bool | None = None

        buckets: dict[int, _Bucket] = {}
        for s in shards:
            buckets.setdefault(self.layout.bucket_of[s.id], _Bucket()).shards.append(s)
        for t, (ids, _g) in pushed.items():
            for b, pos in split_by_bucket(ids, self.layout.n_buckets).items():
                buckets.setdefault(b, _Bucket()).rows[t] = pos
        for t, ids in wanted.items():
            for b, pos in split_by_bucket(ids, self.layout.n_buckets).items():
                buckets.setdefault(b, _Bucket()).fetch[t] = pos
        for t in values:
            for s in self.layout.shards_of[t]:
                buckets.setdefault(self.layout.bucket_of[s.id], _Bucket()).values.append(s)
        writes = {b for b, u in buckets.items() if u.shards or u.rows}
        reads = {b for b, u in buckets.items() if u.fetch or u.values}
        #: buckets whose writes were acknowledged / whose fetch was answered
        written: set[int] = set()
        fetched: set[int] = set()
        #: bucket -> the server its writes were last sent to (PartialPushError)
        sent_to: dict[int, str] = {}
        pair = {"client": self.client_id, "seq": seq}

        def request(group: list[int]) -> tuple[dict[str, Any], list[Any]]:
            """The round's fields for `group` (its buckets), each fetch's positions and the
            shards whose values it asks for."""
            layers: dict[str, dict[str, Any]] = {}
            ids_: list[str] = []
            comp: dict[str, dict[str, Any]] = {}
            row_pos: dict[str, list[np.ndarray]] = {}
            fetch_pos: dict[str, list[np.ndarray]] = {}
            fetch_shards: list[Shard] = []
            for b in group:
                u = buckets[b]
                if b not in written:
                    for s in u.shards:
                        if s.id in signs:
                            comp[s.id] = dict(signs[s.id])
                            continue
                        name = layer_of.get(s.id)
                        if name is None:
                            ids_.append(s.id)
                            continue
                        a, e = vecs[name]
                        layer = layers.setdefault(name, {"a": a, "e": e, "shards": []})
                        layer["shards"].append(s.id)
                    for t, pos in u.rows.items():
                        row_pos.setdefault(t, []).append(pos)
                if b not in fetched:
                    for t, pos in u.fetch.items():
                        fetch_pos.setdefault(t, []).append(pos)
                    fetch_shards += u.values
            f: dict[str, Any] = {}
            if layers:
                f["layers"] = layers
            if ids_:  # one array for all: the server decodes and bounds it once
                f["dense_shards"] = ids_
                f["dense"] = np.concatenate([by_id[i].reshape(-1) for i in ids_])
            if comp:
                f["compressed"] = comp
            named = {s.tensor for b in group if b not in written for s in buckets[b].shards}
            if hyper and named & hyper.keys():
                f["hyper"] = {t: dict(hyper[t]) for t in sorted(named & hyper.keys())}
            if row_pos:
                f["rows"] = []
                for t, ps in row_pos.items():
                    pos = np.concatenate(ps)
                    ids, grads = pushed[t]
                    f["rows"].append({"table": t, "ids": ids[pos], "grads": grads[pos]})
            order = [(t, np.concatenate(ps)) for t, ps in fetch_pos.items()]
            if order:
                f["fetch_rows"] = [{"table": t, "ids": wanted[t][pos]} for t, pos in order]
            if fetch_shards:
                f["fetch_shards"] = [s.id for s in fetch_shards]
            return f, [order, fetch_shards]

        def answered(group: list[int], reply: dict[str, Any], plan: list[Any]) -> None:
            order, fetch_shards = plan
            got = reply.get("fetched") or []
            if len(got) != len(order):
                raise RpcError("bad_reply", f"round: {len(order)} fetches, {len(got)} answered")
            vals = reply.get("values") or []
            if len(vals) != len(fetch_shards) or any(
                np.size(v) != s.size for v, s in zip(vals, fetch_shards, strict=False)
            ):
                raise RpcError("bad_reply", f"round: {len(fetch_shards)} shards' values asked")
            for (t, pos), r in zip(order, got, strict=True):
                res = out.get(t)
                if res is None:
                    res = out[t] = np.empty((len(wanted[t]), r.shape[1]), np.float32)
                res[pos] = r
            vers = reply.get("value_versions") or []
            if len(vers) != len(fetch_shards):
                raise RpcError("bad_reply", f"round: {len(fetch_shards)} shards' versions asked")
            for s, v, n in zip(fetch_shards, vals, vers, strict=True):
                values[s.tensor].reshape(-1)[s.start : s.stop] = np.asarray(v).reshape(-1)
                if fetch_versions is not None:
                    fetch_versions.setdefault(s.tensor, [0] * len(self.layout.shards_of[s.tensor]))[
                        s.index
                    ] = int(n)
            written.update(b for b in group if b in writes)
            fetched.update(b for b in group if b in reads)

        def go(routing: Any) -> None:
            groups: dict[str, list[int]] = {}
            for b in buckets:
                if (b in writes and b not in written) or (b in reads and b not in fetched):
                    if b in routing.unavailable:
                        raise RpcError("bucket_unavailable", f"bucket {b} has no live copy")
                    route = routing.routes.get(b)
                    if route is None:
                        raise RpcError("unavailable", f"bucket {b} has no primary in the table")
                    groups.setdefault(route.primary, []).append(b)
            nonlocal in_parts
            if in_parts is None:
                limits = Limits.tightest(self._limits(u) for u in groups)
                in_parts = size > limits.budget() or len(shards) > limits.max_shards
            if in_parts:
                return
            sent_to.update((b, url) for url, g in groups.items() for b in g if b in writes)
            plans = {url: request(g) for url, g in groups.items()}

            def send(dp: DataPlaneClient, url: str) -> bool:
                return dp.send_message("round", **plans[url][0], **pair)

            def read(dp: DataPlaneClient, url: str) -> None:
                answered(groups[url], dp.read_message_reply(), plans[url][1])

            def by_http(url: str, _url: str) -> None:
                f, order = plans[url]
                answered(groups[url], self._rpc(url).call("round", **f, **pair), order)

            self._exchange([(url, url) for url in groups], send, read, by_http)

        try:
            self._with_retry(go)
        except Exception as exc:
            short = {b for b in writes if b not in written}
            partial = partial_of(exc, "round", self.client_id, seq, sent_to, written, short)
            if partial is None:
                raise
            raise partial from exc
        if in_parts:
            self._round_in_parts(vecs, by_id, signs, pushed, wanted, seq, out, hyper)
            if values:
                self.pull(list(values), out=values)  # type: ignore[attr-defined]
        return out

    def _round_in_parts(
        self,
        vecs: Mapping[str, tuple[np.ndarray, np.ndarray]],
        by_id: Mapping[str, np.ndarray],
        signs: Mapping[str, Mapping[str, Any]],
        pushed: Mapping[str, tuple[np.ndarray, np.ndarray]],
        wanted: Mapping[str, np.ndarray],
        seq: int,
        out: dict[str, np.ndarray],
        hyper: Mapping[str, Mapping[str, Any]],
    ) -> dict[str, np.ndarray]:
        """A round too large for one request per server: the dense half in parts under `seq`
        (push_fc rounds), the compressed updates in a push_compressed, each table's rows in a
        push_rows, then the fetches."""
        if vecs or by_id:
            self._push_round_parts(vecs, by_id, seq, hyper)
        if signs:
            self.push_compressed(signs, hyper=hyper)
        for t, (ids, grads) in pushed.items():
            self.push_rows(t, ids, grads)
        for t, ids in wanted.items():
            out[t] = self.pull_rows(t, ids)
        return out

    def _push_round_parts(
        self,
        vecs: Mapping[str, tuple[np.ndarray, np.ndarray]],
        by_id: Mapping[str, np.ndarray],
        seq: int | None,
        hyper: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> None:
        """fc vectors and dense shards as ``push_fc`` rounds, cut into parts within the
        servers' limits (PSClient._push), under one seq; each with the `hyper` of its tensors."""
        layer_of = {s.id: n for n in vecs for s in self.layout.shards_of[n]}
        shards = [s for n in vecs for s in self.layout.shards_of[n]]
        shards += [self.layout.shards[sid] for sid in by_id]

        def fields(group: list[Shard]) -> dict[str, Any]:
            layers: dict[str, dict[str, Any]] = {}
            ids = []
            for s in group:
                name = layer_of.get(s.id)
                if name is None:
                    ids.append(s.id)
                    continue
                a, e = vecs[name]
                layers.setdefault(name, {"a": a, "e": e, "shards": []})["shards"].append(s.id)
            f: dict[str, Any] = {"layers": layers}
            if ids:
                f["dense_shards"] = ids
                f["dense"] = np.concatenate([by_id[i].reshape(-1) for i in ids])
            named = {s.tensor for s in group} & (hyper or {}).keys()
            if named:
                f["hyper"] = {t: dict(hyper[t]) for t in sorted(named)}  # type: ignore[index]
            return f

        self._push(
            "push_fc",
            shards,
            fields,
            seq,
            size_of=lambda s: int(by_id[s.id].nbytes) if s.id in by_id else 0,
            fixed=sum(a.nbytes + e.nbytes for a, e in vecs.values()),  # every part carries them
        )
