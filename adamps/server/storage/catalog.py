"""The tensors a parameter server defines: ``create`` (idempotent, persisted before it returns),
``list`` and ``describe``, the reload of every saved tensor at start, and the definitions copied
between replicas of a bucket (``definition``, ``ensure``)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import numpy as np

from adamps.config import ConfigError
from adamps.layout import LayoutError, TensorSpec, split_tensor
from adamps.server.config import PsConfig
from adamps.server.storage import memtrim
from adamps.server.storage.persist import Persister
from adamps.server.storage.tablecatalog import TableCatalog
from adamps.server.store.initial import INIT_KINDS, initial_values, normalize_init
from adamps.server.store.shards import TensorState
from adamps.server.store.store import Store
from adamps.server.updates import bounds
from adamps.server.updates.optim import OptimError, Optimizer, initial_state
from adamps.wire import limits
from adamps.wire.protocol import ProtocolError, only_fields, require

log = logging.getLogger("adamps.server.api.app")

#: most definitions one ``create_tensors`` takes (a restore sends more in several calls)
MAX_CREATE_TENSORS = 1024
#: the fields of a definition: `create`'s, and each entry of `create_tensors`' list
CREATE_FIELDS = ("name", "shape", "init", "optimizer")


class TensorCatalog:
    """Definitions of tensors: the store's and LMDB's. Event-loop thread (and start-up) only."""

    def __init__(self, cfg: PsConfig, store: Store, persister: Persister) -> None:
        self.cfg = cfg
        self.store = store
        self.persister = persister
        #: the sequence number of the next definition (orders them in LMDB)
        self._seq = 0
        #: the embedding tables' definitions (tablecatalog.py), numbered by the same counter
        self.tables = TableCatalog(cfg, store, persister, self.next_seq)
        #: one create's allocation at a time (op_create)
        self._creating = asyncio.Lock()

    def next_seq(self) -> int:
        self._seq += 1
        return self._seq - 1

    def load(self) -> None:
        """Reloads every tensor this server saved: definitions, values, accumulators, versions."""
        n = 0
        for saved in self.persister.load():
            meta = saved.meta
            self._seq = max(self._seq, meta["seq"] + 1)
            if "table" in meta:  # an embedding table's definition and row shards
                self.tables.load(meta, saved.shards, saved.rows)
                continue
            spec = TensorSpec.from_dict(meta["spec"])
            opt = Optimizer.from_dict(meta["optimizer"])
            saved_max = meta.get("max_shard_elems", self.cfg.max_shard_elems)
            if saved_max != self.cfg.max_shard_elems:
                raise ConfigError(
                    f"{self.persister.path} holds tensor {spec.name!r} cut with max_shard_elems="
                    f"{saved_max}, but this server is configured with {self.cfg.max_shard_elems}; "
                    "the shard layout must not change under existing data"
                )
            values = None
            missing = [
                sid
                for sid in self._shards_of(spec)
                if self.store.holds_id(sid) and sid not in saved.shards
            ]
            if missing and meta["init"]["kind"] != "zeros":  # (zeros: written as a definition)
                # A bucket newly assigned to this server and never flushed here: its shards start
                # from the tensor's init (given values: zeros) until replication brings state.
                log.warning(
                    "tensor %s: no saved state for %d held shards (%s...); they start from init",
                    spec.name,
                    len(missing),
                    missing[0],
                )
                if meta["init"]["kind"] == "values":
                    values = np.zeros(spec.shape, dtype=np.float32)
            self.store.define(spec, opt, meta["init"], values, saved.shards)
            self._seq = max(self._seq, meta["seq"] + 1)
            n += 1
        if n:
            log.info(
                "reloaded %d tensors, %d held shards from %s",
                n,
                len(self.store.shards),
                self.persister.path,
            )
        memtrim.trim()  # the records read are parsed into the arrays: their heap goes back

    def _shards_of(self, spec: TensorSpec) -> list[str]:
        return [s.id for s in split_tensor(spec, self.store.layout.max_shard_elems)]

    # -- ops ----------------------------------------------------------------------------------------

    def check(
        self, msg: dict[str, Any]
    ) -> tuple[TensorSpec, Optimizer, dict[str, Any], np.ndarray | None]:
        """A create's definition, checked whole (raises the 4xx naming the problem)."""
        name = require(msg, "name", str)
        # Sizes by arithmetic before anything is allocated (issue 12: [2^32] with Adagrad asked
        # for 32 GiB); a create that only repeats an existing definition allocates nothing.
        shape = limits.check_shape(require(msg, "shape", list), self.cfg.max_tensor_elems)
        spec = TensorSpec(name, shape)
        init_in = require(msg, "init", dict, default={"kind": "zeros"})
        opt = Optimizer.from_dict(require(msg, "optimizer", dict, default={"kind": "sgd"}))
        opt.check_for_tensor()
        bounds.check_optimizer(opt)
        init = normalize_init(init_in, spec.shape)
        bounds.check_init(init, init_in.get("values"))
        return spec, opt, init, init_in.get("values")

    async def op_create(self, msg: dict[str, Any]) -> dict[str, Any]:
        spec, opt, init, values = await _off_loop_if_values(self.check, msg)
        name = spec.name
        # One create at a time draws, allocates and writes its values, on a worker thread: a
        # tensor of max_tensor_elems with Adagrad is 512 MiB, which held the event loop for
        # seconds (issue 39); the lock admits them one by one against max_server_elems.
        async with self._creating:
            if name not in self.store.tensors:
                self._check_server_room(spec)
                meta = self._meta(spec, opt, init)
                own = await asyncio.to_thread(self._prepare, spec, opt, init, values, meta)
                if own is not None and name not in self.store.tensors:
                    created, t = self._define(spec, opt, init, values, own)
                    return {"created": created, "tensor": self._describe(t)}
            created, t = self._define(spec, opt, init, values)
        return {"created": created, "tensor": self._describe(t)}

    def _meta(self, spec: TensorSpec, opt: Optimizer, init: dict[str, Any]) -> dict[str, Any]:
        """A new definition's LMDB record (it takes the next sequence number)."""
        return {
            "spec": spec.to_dict(),
            "optimizer": opt.to_dict(),
            "init": init,
            "seq": self.next_seq(),
            "max_shard_elems": self.cfg.max_shard_elems,
        }

    def _prepare(
        self,
        spec: TensorSpec,
        opt: Optimizer,
        init: dict[str, Any],
        values: np.ndarray | None,
        meta: dict[str, Any],
    ) -> dict[str, tuple[int, np.ndarray, np.ndarray | None]] | None:
        """A worker thread: the initial values and accumulators of the shards held now, written
        to LMDB with the definition before the tensor exists in memory (so no push or flush of
        it can come first). Returns them for `Store.define(own=True)`.

        A tensor of zeros is written as its definition alone: a restart derives its zero shards
        and fresh optimizer state from it (the reload's "start from init"), exactly as written.
        Its shards are untouched zero pages until written, so the create that precedes a
        restore's install costs neither a pass over the model nor a write of it to disk
        (issue 38 item 7: it was half a restore's time)."""
        out, recs = self._initial(spec, opt, init, values)
        if not self.persister.write_tensor(meta, recs, only_new=True):
            return None  # a peer's definition came first (ensure): op_create compares with it
        return out

    def _initial(
        self,
        spec: TensorSpec,
        opt: Optimizer,
        init: dict[str, Any],
        values: np.ndarray | None,
    ) -> tuple[dict[str, tuple[int, np.ndarray, np.ndarray | None]], list[Any]]:
        """`_prepare`'s state of the shards held now, and the records it writes (none for a
        tensor of zeros)."""
        zeros = init["kind"] == "zeros"
        whole = None if zeros else initial_values(spec.shape, init, values).reshape(-1)
        out: dict[str, tuple[int, np.ndarray, np.ndarray | None]] = {}
        for s in split_tensor(spec, self.store.layout.max_shard_elems):
            if not self.store.holds_id(s.id):  # (a racy read: Store.define fills the rest)
                continue
            acc = initial_state(opt, s.size) if opt.has_accumulator else None
            val = (
                np.zeros(s.shape, np.float32)
                if whole is None
                else whole[s.start : s.stop].copy().reshape(s.shape)
            )
            out[s.id] = (0, val, acc)
        recs = [] if zeros else [(sid, v, val, a) for sid, (v, val, a) in out.items()]
        return out, recs

    # -- create_tensors: many definitions in one call ----------------------------------------------

    async def op_create_tensors(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Several definitions in one call, each `create`'s fields (a restore's: issue 38 item
        7, one request, one synced LMDB commit and one worker-thread pass per server instead
        of one of each per tensor). Checked whole first: a bad definition is its 4xx naming it
        (``tensors[3] ('w'): ...``), a name given twice ``bad_request``, an existing name with
        another definition ``exists``, too many elements for this server ``too_large``, and
        then nothing is created. Idempotent as `create` is: -> ``{created: [names], tensors}``."""
        raw = require(msg, "tensors", list)
        if not raw:
            raise ProtocolError("bad_request", "field 'tensors' lists no definition")
        if len(raw) > MAX_CREATE_TENSORS:
            raise ProtocolError(
                "too_large",
                f"field 'tensors' lists {len(raw)} definitions; at most {MAX_CREATE_TENSORS} "
                "a call",
                limit=MAX_CREATE_TENSORS,
            )
        checked = await _off_loop_if_values(self._check_all, raw)
        async with self._creating:
            new, pending = [], 0
            for c in checked:
                if self._existing(*c) is None:
                    pending += self._check_server_room(c[0], pending)
                    new.append(c)
            metas = [self._meta(spec, opt, init) for spec, opt, init, _v in new]
            own = await asyncio.to_thread(self._prepare_many, new, metas) if new else []
            # Laid out at once (Store.define then finds each in the layout), not rebuilt per
            # tensor: that held the event loop 2.7 s for 500 tensors
            self.store.layout = self.store.layout.with_tensors(c[0] for c in new)
            created = []
            for c, o in zip(new, own, strict=True):
                fresh = o is not None and c[0].name not in self.store.tensors
                if self._define(*c, o if fresh else None)[0]:
                    created.append(c[0].name)
        return {"created": created, "tensors": len(checked)}

    def _check_all(self, raw: list[Any]) -> list[tuple[Any, ...]]:
        """`check` of every definition of a create_tensors, a name given twice refused."""
        checked = []
        names: set[str] = set()
        for i, d in enumerate(raw):
            if not isinstance(d, dict):
                raise ProtocolError("bad_request", f"tensors[{i}] must be a map of create's fields")
            # a misspelled field (`optimiser`) was ignored: the tensor made with the defaults
            only_fields(d, f"op 'create_tensors': tensors[{i}]", CREATE_FIELDS, op="create_tensors")
            try:
                c = self.check(d)
            except ProtocolError as exc:
                what = f"tensors[{i}] ({d.get('name')!r}): {exc.message}"
                raise ProtocolError(exc.code, what, **exc.extra) from None
            except (LayoutError, OptimError, ValueError) as exc:
                raise ProtocolError(
                    "bad_request", f"tensors[{i}] ({d.get('name')!r}): {exc}"
                ) from None
            if c[0].name in names:
                raise ProtocolError(
                    "bad_request", f"tensors[{i}]: tensor {c[0].name!r} named twice"
                )
            names.add(c[0].name)
            checked.append(c)
        return checked

    def _prepare_many(
        self, new: list[tuple[Any, ...]], metas: list[dict[str, Any]]
    ) -> list[dict[str, tuple[int, np.ndarray, np.ndarray | None]] | None]:
        """`_prepare` of each new definition, written in one transaction (a worker thread)."""
        got = [self._initial(*c) for c in new]
        wrote = self.persister.write_tensors(
            [(meta, recs) for meta, (_out, recs) in zip(metas, got, strict=True)], only_new=True
        )
        return [out if ok else None for (out, _r), ok in zip(got, wrote, strict=True)]

    def _check_server_room(self, spec: TensorSpec, pending: int = 0) -> int:
        """The shards of `spec` this server would hold fit in max_server_elems, beside
        `pending` elements of definitions being created with it; returns their elements."""
        held = sum(st.shard.size for st in self.store.shards.values()) + self.tables.sketch_cells()
        held += pending
        if limits.shard_count(spec.shape, self.store.layout.max_shard_elems) > (1 << 20):
            raise ProtocolError("too_large", f"tensor {spec.name!r} would have too many shards")
        new = sum(
            s.size
            for s in split_tensor(spec, self.store.layout.max_shard_elems)
            if self.store.holds(s)
        )
        if held + new > self.cfg.max_server_elems:
            raise ProtocolError(
                "too_large",
                f"tensor {spec.name!r} would put {held + new} elements on this server; "
                f"the limit is {self.cfg.max_server_elems}",
                limit=self.cfg.max_server_elems,
            )
        return new

    def _define(
        self,
        spec: TensorSpec,
        opt: Optimizer,
        init: dict[str, Any],
        values: np.ndarray | None,
        prepared: dict[str, tuple[int, np.ndarray, np.ndarray | None]] | None = None,
    ) -> tuple[bool, TensorState]:
        """Defines a tensor unless an identical one exists (then False); a different one with the
        same name is `exists`. Persists the definition and initial state before returning
        (`prepared`: `_prepare` made and persisted them, off the loop)."""
        name = spec.name
        existing = self._existing(spec, opt, init)
        if existing is not None:
            return False, existing
        if prepared is not None:
            t = self.store.define(spec, opt, init, values, prepared, own=True)
            late = [st for st in t.shards.values() if st.id not in prepared]
            if late:  # a bucket held since _prepare read the holdings (rare)
                self.persister.write_tensor(
                    self._meta(spec, opt, init),
                    [(st.id, st.version, st.value, st.accum) for st in t.shards.values()],
                )
        else:
            t = self.store.define(spec, opt, init, values)
            # Written before the caller yields, so no push to the new shards is queued yet and
            # no later flush can be overtaken by this version-0 write. (A peer's definition,
            # state transfer: `ensure`.)
            self.persister.write_tensor(
                self._meta(spec, opt, init),
                [(st.id, st.version, st.value, st.accum) for st in t.shards.values()],
            )
        log.info(
            "created tensor %s %s (%d held shards, %s)",
            name,
            list(spec.shape),
            len(t.shards),
            opt.kind,
        )
        return True, t

    def _existing(
        self, spec: TensorSpec, opt: Optimizer, init: dict[str, Any], _values: Any = None
    ) -> TensorState | None:
        """The tensor of that name if its definition is this one; None if there is none;
        ``exists`` if there is another."""
        existing = self.store.tensors.get(spec.name)
        if existing is None:
            return None
        wanted = {
            "name": spec.name,
            "shape": list(spec.shape),
            "dtype": spec.dtype,
            "optimizer": opt.to_dict(),
            "init": init,
        }
        if existing.describe() == wanted:
            return existing
        raise ProtocolError(
            "exists",
            f"tensor {spec.name!r} exists with a different definition",
            existing=existing.describe(),
        )

    def definition(self, name: str) -> dict[str, Any]:
        """The definition of a tensor as plain data (what `create` compares; `list` returns)."""
        return self.store.tensor(name).describe()

    def ensure(self, d: dict[str, Any]) -> bool:
        """Defines a tensor from a peer's definition (definition) unless it exists here;
        True if it was created. A definition of kind `values` carries only the digest: such a
        tensor starts at zeros here, for the state transfer that follows to overwrite."""
        return self._define(*self._peer_definition(d))[0]

    async def ensure_off_loop(self, d: dict[str, Any]) -> bool:
        """`ensure`, a new tensor's values drawn, allocated and written on a worker thread, as
        a create's: a joining copy defines the tensors of the snapshot it fetched before it
        installs it (a 128 MiB tensor held its event loop, issue 39)."""
        spec, opt, init, values = self._peer_definition(d)
        async with self._creating:
            if spec.name not in self.store.tensors:
                meta = self._meta(spec, opt, init)
                own = await asyncio.to_thread(self._prepare, spec, opt, init, values, meta)
                if own is not None and spec.name not in self.store.tensors:
                    return self._define(spec, opt, init, values, own)[0]
        return self.ensure(d)

    def _peer_definition(
        self, d: dict[str, Any]
    ) -> tuple[TensorSpec, Optimizer, dict[str, Any], np.ndarray | None]:
        # A peer's definition passed the same limit at its create: a larger one is not ours.
        shape = limits.check_shape(require(d, "shape", list), self.cfg.max_tensor_elems)
        spec = TensorSpec(require(d, "name", str), shape)
        opt = Optimizer.from_dict(require(d, "optimizer", dict))
        init = dict(require(d, "init", dict))
        if init.get("kind") not in INIT_KINDS:
            raise ProtocolError("bad_request", f"unknown init kind {init.get('kind')!r}")
        values = np.zeros(spec.shape, np.float32) if init["kind"] == "values" else None
        return spec, opt, init, values

    async def op_list(self, msg: dict[str, Any]) -> dict[str, Any]:
        return {"tensors": [t.describe() for t in self.store.tensors.values()]}

    async def op_describe(self, msg: dict[str, Any]) -> dict[str, Any]:
        return self._describe(self.store.tensor(require(msg, "name", str)))

    def _describe(self, t: Any) -> dict[str, Any]:
        d = t.describe()
        d["shards"] = [
            {
                "id": s.id,
                "bucket": self.store.layout.bucket_of[s.id],
                "rows": [s.row_start, s.row_stop],
                "held": s.index in t.shards,
                "version": t.shards[s.index].version if s.index in t.shards else None,
                # the optimizer of the last update applied here (a scheduler's lr shows here)
                "applied": _applied(t.shards.get(s.index)),
            }
            for s in t.layout_shards
        ]
        return d


def _applied(st: Any) -> dict[str, Any] | None:
    """A held shard's last applied optimizer as data (a racy read of an immutable object)."""
    opt = None if st is None else st.applied
    return None if opt is None else opt.to_dict()


def _has_values(x: Any) -> bool:
    """A create (or a list of them) carrying initial values inline."""
    if isinstance(x, list):
        return any(_has_values(d) for d in x)
    return isinstance(x, dict) and isinstance(x.get("init"), dict) and "values" in x["init"]


async def _off_loop_if_values(check: Any, arg: Any) -> Any:
    """`check(arg)`, on a worker thread when initial values ride inline: their finiteness and
    bounds are a pass over every element (three 16M-element tensors held the event loop 0.28 s);
    a definition without values is checked in place (microseconds)."""
    if _has_values(arg):
        return await asyncio.to_thread(check, arg)
    return check(arg)
