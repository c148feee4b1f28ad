"""The fields each parameter-server op takes, declared once, and the one check that refuses any
other (docs/protocol-ps.md, "Operations").

A field the server does not know was ignored: a `round` with `fetch_row` for `fetch_rows`, or a
`vec` `scale` carrying `x`, was answered 200 and silently did nothing for the misspelled part.
Every request of an op listed here is checked against its list before its handler runs, on
`POST /rpc` and on the data port (whose message ops carry the same messages), so a typo is a
`400 bad_request` naming the op and the field, and nothing is applied. A field's type and value
are still the handler's (its decoder's) to check; this only says which names exist.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from adamps.server.storage.catalog import CREATE_FIELDS
from adamps.wire.protocol import ENVELOPE, check_message, only_fields

#: the exactly-once pair of a write (docs/protocol-ps.md, "Clients of a replicated cluster", 5)
_PAIR = ("client", "seq")

#: op -> the fields its /rpc message (and a data-plane message op's meta) takes
RPC_FIELDS: dict[str, frozenset[str]] = {
    k: frozenset(v)
    for k, v in {
        "create": CREATE_FIELDS,
        "create_tensors": ("tensors",),
        "pull": ("tensors", "shards"),
        "push_dense": ("tensor", "delta", "shards", "hyper", *_PAIR),
        "push_fc": (
            "tensor",
            "a",
            "e",
            "shards",
            "layers",
            "dense_shards",
            "dense",
            "hyper",
            *_PAIR,
        ),
        "push_compressed": ("shards", "hyper", *_PAIR),
        "round": (
            "layers",
            "dense_shards",
            "dense",
            "compressed",
            "rows",
            "fetch_rows",
            "fetch_shards",
            "hyper",
            *_PAIR,
        ),
        "flush": (),
        "list": (),
        "describe": ("name",),
        "vec": ("kind", "shards", "y", "x", "alpha", "values", "offset", *_PAIR),
        "vec_dot": ("shards", "x", "y"),
        "create_table": ("name", "dim", "init", "optimizer", "admission", "dtype"),
        "list_tables": (),
        "pull_rows": ("table", "ids", "dim"),
        "push_rows": ("table", "ids", "grads", "dim", *_PAIR),
        "put_rows": ("table", "ids", "values", "dim", *_PAIR),
        "ckpt_read": ("bucket", "cut", "since"),
        "ckpt_install": ("bucket", "shards", "rows", "force", *_PAIR),
        "ckpt_hold": ("cut", "seconds"),
        "ckpt_release": ("cut", "drop"),
        "clock": ("run", "replica", "mode", "step", "phase", "join", "expect", "wait"),
        "debug_fail": (),
    }.items()
}

#: the data port's own frames (their payload is raw float32, not a message): their meta's fields
FRAME_FIELDS: dict[str, frozenset[str]] = {
    "push_dense": frozenset({"tensor", "shards", *_PAIR}),
    "pull": frozenset({"tensor", "shards"}),
}


def check_fields(op: str, msg: Mapping[str, Any], table: Mapping[str, frozenset[str]]) -> None:
    """Refuses a request of `op` naming a field its op does not take (`table[op]`); an op not
    in `table` (a replication peer op, checked by its own decoder) is not checked here."""
    takes = table.get(op)
    if takes is not None:
        only_fields(msg, f"op {op!r}", takes | ENVELOPE, op=op)


def check_frame(meta: Mapping[str, Any], ops: Collection[str]) -> str:
    """A data-plane frame's envelope and op (protocol.check_message), then its fields: those
    of the frame (push_dense, pull), or of the /rpc message a message op's meta is."""
    op = check_message(meta, ops)
    check_fields(op, meta, FRAME_FIELDS if op in FRAME_FIELDS else RPC_FIELDS)
    return op
