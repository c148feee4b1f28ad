"""Strom's compressed updates (``push_compressed``, a round's ``compressed``; replicated kind
``"c"``, docs/protocol-ps.md) decoded into the parts the owner threads apply: the one place
that turns a shard's wire map (uint32 words or Golomb-Rice bytes, and tau) into
:class:`adamps.server.updates.optim.Signs`, for the push op and for replicated batches alike. The
replicated form is the compressed form the client sent (``wire_form``), checked again by
every copy (a secondary trusts nothing it did not validate)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from adamps.compression import codec
from adamps.server.decode.fields import named_optimizer, only, string
from adamps.server.store.shards import ShardState
from adamps.server.store.store import Store
from adamps.server.updates.bounds import MAX_GRAD
from adamps.server.updates.hyper import push_hyper
from adamps.server.updates.optim import Signs
from adamps.wire.protocol import ALLOWED_DTYPES, ProtocolError, require

#: codes (elements sent) of one compressed push above which it is decoded off the event loop:
#: expanding a full 1 MB shard (262,144 codes) takes about 17 ms here, and a push may name many
#: shards; below this the thread hop would cost more than the decoding (about 4 ms at most)
DECODE_OFF_LOOP = 1 << 16

#: the fields of a ``"c"`` update in each of its two encodings (what ``update`` writes, with
#: ``wire_form``'s; ``o``: only when the push named one): the words, or the Rice stream. One
#: carrying both is refused, as a client's push naming both is (words_of).
WORDS_FIELDS = frozenset({"k", "s", "t", "w", "o"})
RICE_FIELDS = frozenset({"k", "s", "t", "r", "n", "b", "o"})

#: a decoded shard update: (shard, its Signs, the client's map it came from)
Part = tuple[ShardState, Signs, Any]


def _tau(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ProtocolError("bad_request", f"{where}: tau must be a number")
    tau = float(value)
    if not math.isfinite(tau):
        raise ProtocolError("non_finite", f"{where}: tau is {tau}")
    if tau <= 0:
        raise ProtocolError("bad_request", f"{where}: tau must be > 0, got {tau}")
    # Every sent element is +-tau: the gradient bound of a dense push applies to tau itself
    # (issue 28: tau = 1e39 is finite as a double but inf as float32; 1e30 overflowed later).
    if tau > MAX_GRAD:
        raise ProtocolError(
            "bad_request",
            f"{where}: tau {tau:.3g} exceeds {MAX_GRAD:.0e}: values this large could overflow "
            "float32 (docs/protocol-ps.md, 'Finite values')",
            limit=MAX_GRAD,
        )
    return tau


def _int(d: Mapping[str, Any], name: str, where: str) -> int:
    v = d.get(name)
    if isinstance(v, bool) or not isinstance(v, int):
        raise ProtocolError("bad_request", f"{where}: field {name!r} must be an int")
    return v


def _array(d: Mapping[str, Any], name: str, dtype: str, where: str) -> np.ndarray:
    arr = d.get(name)
    if not isinstance(arr, np.ndarray):
        raise ProtocolError("bad_request", f"{where}: field {name!r} must be an array")
    if arr.dtype != ALLOWED_DTYPES[dtype]:
        raise ProtocolError(
            "bad_dtype", f"{where}: field {name!r} must be {dtype}, got {arr.dtype.name}"
        )
    if arr.ndim != 1:
        raise ProtocolError("bad_shape", f"{where}: field {name!r} must be 1-D")
    return arr


def words_of(d: Any, size: int, where: str) -> tuple[np.ndarray, float]:
    """(checked uint32 words, tau) of one shard's compressed update in its client form
    ``{"tau", "words"}`` or ``{"tau", "n", "k", "rice"}``; ProtocolError if malformed."""
    if not isinstance(d, Mapping):
        raise ProtocolError("bad_request", f"{where}: a compressed update must be a map")
    tau = _tau(d.get("tau"), where)
    if "words" in d and "rice" in d:
        # One meaning per update: picking one encoding would silently drop the other's codes.
        raise ProtocolError("bad_request", f"{where}: names both 'words' and 'rice'; send one")
    try:
        if "words" in d:
            words = _array(d, "words", "uint32", where)
            codec.unpack_words(words, size)  # checks sorted, unique, in range
            return words, tau
        if "rice" in d:
            data = _array(d, "rice", "uint8", where)
            idx, neg = codec.rice_decode(data, _int(d, "n", where), _int(d, "k", where), size)
            return codec.pack_words(idx, neg), tau
    except codec.CodecError as exc:
        raise ProtocolError("bad_request", f"{where}: {exc}") from None
    raise ProtocolError("bad_request", f"{where}: needs 'words' or 'rice' (+ 'n', 'k')")


def wire_form(d: Mapping[str, Any]) -> dict[str, Any]:
    """The compact encoding a replicated batch carries (what the client sent, checked):
    ``{"w": words}`` or ``{"r": rice bytes, "n": n, "b": k}``."""
    if "words" in d:
        return {"w": d["words"]}
    return {"r": d["rice"], "n": d["n"], "b": d["k"]}


def update(
    sid: str, tau: float, encoded: dict[str, Any], o: dict[str, Any] | None = None
) -> dict[str, Any]:
    """A compressed update of one shard (Strom), replicated in its compressed form: ``encoded``
    is ``{"w": uint32 words}`` or ``{"r": Golomb-Rice bytes, "n": count, "b": Rice k}``."""
    u: dict[str, Any] = {"k": "c", "s": sid, "t": tau, **encoded}
    if o is not None:
        u["o"] = o
    return u


def replicated(store: Store, u: dict[str, Any]) -> list[tuple[ShardState, Signs]]:
    """A copy's decoding of a ``"c"`` update ``{"s", "t", "w" | "r", "n", "b"[, "o"]}``: tau
    (finite, > 0, bounded), the words or Rice stream, the optimizer its push named."""
    only(u, WORDS_FIELDS if "w" in u else RICE_FIELDS)
    st = store.shard(string(u, "s"))
    client_form: dict[str, Any] = {"tau": u.get("t")}
    if "w" in u:
        client_form["words"] = u["w"]
    else:
        client_form.update(rice=u.get("r"), n=u.get("n"), k=u.get("b"))
    words, tau = words_of(client_form, st.shard.size, f"shard {u.get('s')!r}")
    return [(st, Signs(words, tau, named_optimizer(store, u, st.shard.tensor)))]


def codes(updates: dict[Any, Any]) -> int:
    """The codes a push_compressed's shards declare (Rice ``n``, or the words' count): what
    decoding it costs. A stream that lies about its ``n`` is refused by the decoder's bound
    check before it expands (adamps.compression.codec.rice_decode)."""
    total = 0
    for d in updates.values():
        if not isinstance(d, dict):
            continue
        n, words = d.get("n"), d.get("words")
        if isinstance(n, int) and not isinstance(n, bool) and n > 0:
            total += n
        if isinstance(words, np.ndarray):
            total += words.size
    return total


def decoder(
    store: Store, addressing: Any, msg: dict[str, Any]
) -> tuple[Callable[[], list[Part]], bool]:
    """The checks of a push_compressed (its ``shards``) that need the server's state (role, held
    shards), done now, on the event loop; returns the rest, the decoding of each shard's words
    or Rice stream (pure: safe on a worker thread), and whether that decoding is large enough
    to run off the event loop (more than DECODE_OFF_LOOP codes)."""
    updates = require(msg, "shards", dict)
    if not updates:
        raise ProtocolError("bad_request", "push_compressed needs a non-empty 'shards' map")
    addressing.check_ids(updates)
    shards: list[tuple[str, ShardState, Any]] = []
    for sid, d in updates.items():
        if not isinstance(sid, str):
            raise ProtocolError("bad_request", "field 'shards' must map shard ids to updates")
        shards.append((sid, store.shard(sid), d))

    def decode() -> list[Part]:
        parts = []
        for sid, st, d in shards:
            words, tau = words_of(d, st.shard.size, f"shard {sid!r}")
            parts.append((st, Signs(words, tau), d))
        return parts

    return decode, codes(updates) > DECODE_OFF_LOOP


def with_hyper(parts: list[Part], msg: dict[str, Any], tensors: Any) -> list[Part]:
    """Decoded compressed updates with the hyperparameters `msg` names for their tensors."""
    hyper = push_hyper(msg, tensors)
    if not hyper:
        return parts
    return [
        (st, Signs(u.words, u.tau, hyper[st.shard.tensor][0]) if st.shard.tensor in hyper else u, d)
        for st, u, d in parts
    ]


def wire(
    parts: list[Part],
) -> list[tuple[list[ShardState], Callable[[list[ShardState]], dict[str, Any]]]]:
    """The compact (replication) form of decoded compressed updates: their compressed form
    (and the hyperparameters their push named, `Signs.opt`)."""
    return [([st], lambda sts, u=u, d=d: update(sts[0].id, u.tau, wire_form(d), _o(u)))
            for st, u, d in parts]  # fmt: skip


def _o(u: Any) -> dict[str, Any] | None:
    return None if u.opt is None else u.opt.to_dict()
