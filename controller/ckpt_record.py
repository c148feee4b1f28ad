"""The controllers' replicated record of periodic checkpoints (issue 24): pure, no clock, no IO.

The schedule lives in the Raft state, not in a leader's memory: when the last checkpoint
finished, how many there were, which one a leader began. Whichever node leads next reads it
and knows whether one is due, so a leader killed in the middle of a checkpoint delays the
schedule by one leader election, not by an interval; its half-written directory has no
manifest and is never used (adamps/checkpoint/series.py).
"""

from __future__ import annotations

from typing import Any

#: summary fields a completed checkpoint records (adamps.checkpoint.series.summary) and their types
DONE_FIELDS: dict[str, type | tuple[type, ...]] = {
    "name": str,
    "bytes": int,
    "written_bytes": int,
    "seconds": (int, float),
    "consistent": bool,
    "started": (int, float),
}
#: optional summary fields (absent in entries of earlier releases)
OPTIONAL_FIELDS: dict[str, type | tuple[type, ...]] = {"hold_ms": (int, float)}


def empty() -> dict[str, Any]:
    return {"count": 0, "last": None, "begun": None}


def due(record: dict[str, Any], interval: float, now: float) -> bool:
    """A periodic checkpoint is due: periodic checkpoints are on and the last one finished
    `interval` ago (or there was none)."""
    if interval <= 0:
        return False
    last = record.get("last")
    return last is None or now - float(last["finished"]) >= interval


def apply(
    record: dict[str, Any], action: str, fields: dict[str, Any], now: float
) -> dict[str, Any]:
    """Applies one entry to `record` (in place); the result (``ok`` false, with an error, for
    a malformed entry: a replicated method never raises)."""
    if not isinstance(fields, dict):
        return {"ok": False, "error": "bad_request", "message": "fields must be an object"}
    if action == "begin":
        name = fields.get("name")
        if not isinstance(name, str):
            return {"ok": False, "error": "bad_request", "message": "begin needs a name"}
        record["begun"] = {"name": name, "at": now, "term": fields.get("term")}
        return {"ok": True, "begun": name}
    if action == "done":
        for key, kind in DONE_FIELDS.items():
            if not isinstance(fields.get(key), kind):
                return {"ok": False, "error": "bad_request", "message": f"done needs {key!r}"}
        for key, kind in OPTIONAL_FIELDS.items():
            if key in fields and not isinstance(fields[key], kind):
                return {"ok": False, "error": "bad_request", "message": f"bad {key!r}"}
        record["count"] += 1
        record["last"] = {
            **{k: fields[k] for k in DONE_FIELDS},
            **{k: fields[k] for k in OPTIONAL_FIELDS if k in fields},
            "finished": now,
        }
        if (record.get("begun") or {}).get("name") == fields["name"]:
            record["begun"] = None
        return {"ok": True, "count": record["count"]}
    return {"ok": False, "error": "bad_request", "message": f"unknown action {action!r}"}


class CheckpointRecord:
    """ClusterModel's checkpoint entries (a mixin: the model's state is one pickled object)."""

    def checkpoint_record(self) -> dict[str, Any]:
        # A model restored from a dump written before issue 24 has no record yet.
        rec = self.__dict__.get("checkpoints")
        if rec is None:
            rec = self.__dict__["checkpoints"] = empty()
        return rec

    def x_checkpoint(self, action: str, fields: dict[str, Any], now: float) -> dict[str, Any]:
        now = self._tick(now)  # type: ignore[attr-defined]  (BucketRules)
        return apply(self.checkpoint_record(), action, fields, now)
