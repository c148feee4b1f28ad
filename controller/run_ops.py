"""Runs on the controllers (issue 25): create, delete, and a run's part of the layout.

A part of :class:`controller.state.ClusterModel` like the other mixins: plain, deterministic, no
clock, no IO, never raises on bad input (it answers a refusal). Every change is one replicated
entry, ``write_tenancy(op, name, fields, now)``: one method for all three operations, because a
new replicated method must sort last by name (tests/core/test_raft_method_ids.py).

The record of a run: ``{"token_hash", "quotas", "consistency", "created", "usage"}``; the token
itself is never here (adamps/runs.py). ``usage`` maps each tensor and table the run created to
what it holds per copy (``op == "usage"``, asked by a server before it creates one): the run's
size quotas are held against its total across every server (issue 39), not per server. ``runs_version`` grows with every change: the servers' heartbeat
replies carry it, and a server whose copy is older fetches the table again.

The layout is the cluster's one layout: a run sets only the tensors of its namespace in it
(``op == "layout"``), so two runs' replicas 0 never overwrite each other's, and the run's
parameter-element quota is checked against the run's whole part of the layout. Deleting a run
removes its tensors from the layout too; the servers drop its shards when they learn of it.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

from adamps import runs
from controller.cluster_rules import refusal

log = logging.getLogger("controller.state")


def _elems(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


class RunOps:
    """Runs: the records and their replicated operations (the Raft apply thread only)."""

    # Models pickled by an earlier release have no run fields: these defaults stand in.
    runs: dict[str, dict[str, Any]]
    runs_version: int

    def runs_table(self) -> dict[str, dict[str, Any]]:
        if "runs" not in self.__dict__:
            self.runs, self.runs_version = {}, 0
        return self.runs

    def write_tenancy(
        self, op: str, name: str, fields: dict[str, Any], now: float
    ) -> dict[str, Any]:
        now = self._tick(now)  # type: ignore[attr-defined]
        table = self.runs_table()
        if op == "create":
            return self._create_run(table, name, fields, now)
        rec = table.get(name)
        if rec is None and op == "layout" and fields.get("operator"):
            # `adamps train --run NAME` with the cluster token, NAME never created: its tensors
            # are namespaced all the same, and its part replaces only its part (no quota).
            rec = {"quotas": {}}
        if rec is None:
            return refusal("not_found", f"no run {name!r}")
        if op == "delete":
            return self._delete_run(table, name, now)
        if op == "layout":
            return self._set_run_layout(rec, name, fields.get("layout") or {}, now)
        if op == "usage":
            return self._use(rec, name, fields.get("name"), fields.get("cost"))
        return refusal("bad_request", f"no run operation {op!r}")

    def _use(self, rec: dict[str, Any], run: str, name: Any, cost: Any) -> dict[str, Any]:
        """Records what tensor or table `name` of run `run` holds per copy (issue 39): a
        server asks before it creates one for a run with size quotas, so the run's total over
        every server is held against its quotas here. The same name at the same cost again
        (the client creates on every server) changes nothing."""
        if not isinstance(name, str) or not runs.in_namespace(name, run):
            return refusal("forbidden", f"{name!r} is outside run {run!r}'s namespace")
        if not isinstance(cost, dict) or any(
            k not in runs.SIZE_QUOTAS or isinstance(v, bool) or not isinstance(v, int) or v < 0
            for k, v in cost.items()
        ):
            return refusal("bad_request", f"a cost maps {list(runs.SIZE_QUOTAS)} to ints >= 0")
        usage = rec.setdefault("usage", {})
        if name in usage:
            if usage[name] == cost:
                return {"ok": True, "run": run, "name": name, "recorded": False}
            return refusal(
                "exists",
                f"{name!r} of run {run!r} is defined with another size ({usage[name]}) "
                "elsewhere in the cluster",
                existing=usage[name],
            )
        if len(usage) >= runs.MAX_RUN_NAMES:
            return refusal(
                "too_large", f"run {run!r} defines {runs.MAX_RUN_NAMES} names, the most a run may"
            )
        over = runs.over_quota(usage, name, cost, rec["quotas"])
        if over is not None:
            quota, limit, total = over
            return refusal(
                "quota_exceeded",
                f"run {run!r} would hold {total} {quota} across the cluster with {name!r} "
                f"(its quota {quota} is {limit})",
                quota=quota,
                limit=limit,
                asked=total,
            )
        usage[name] = dict(cost)
        return {"ok": True, "run": run, "name": name, "recorded": True}

    def _create_run(
        self, table: dict[str, dict[str, Any]], name: str, fields: dict[str, Any], now: float
    ) -> dict[str, Any]:
        if name in table:
            return refusal("exists", f"run {name!r} exists; delete it first or choose a new name")
        if len(table) >= runs.MAX_RUNS:
            return refusal("too_large", f"the cluster keeps at most {runs.MAX_RUNS} runs")
        table[name] = {
            "token_hash": str(fields["token_hash"]),
            "quotas": dict(fields.get("quotas") or {}),
            "consistency": str(fields.get("consistency") or "async"),
            "created": now,
        }
        self.runs_version += 1
        table[name]["version"] = self.runs_version
        log.warning("run %s created (quotas %s)", name, table[name]["quotas"] or "none")
        return {"ok": True, "run": self.run_view(name)}

    def _delete_run(
        self, table: dict[str, dict[str, Any]], name: str, now: float
    ) -> dict[str, Any]:
        del table[name]
        self.runs_version += 1
        dropped: list[str] = []
        layout = self.layout  # type: ignore[attr-defined]
        if layout is not None:
            keep = [t for t in layout["tensors"] if runs.run_of(t["name"]) != name]
            dropped = [t["name"] for t in layout["tensors"] if runs.run_of(t["name"]) == name]
            if dropped:
                self.layout = {**layout, "tensors": keep}
                self.layout_version += 1  # type: ignore[attr-defined]
        deleted = self.__dict__.setdefault("deleted_runs", [])
        deleted.append({"run": name, "at": now, "version": self.runs_version})
        del deleted[:-64]  # the servers need only the recent ones (and the version)
        log.warning("run %s deleted: its %d layout tensors go", name, len(dropped))
        return {"ok": True, "run": name, "deleted": True, "tensors": dropped}

    def _set_run_layout(
        self, rec: dict[str, Any], name: str, layout: dict[str, Any], now: float
    ) -> dict[str, Any]:
        if layout.get("n_buckets") != self.n_buckets:  # type: ignore[attr-defined]
            return refusal(
                "conflict",
                f"layout has {layout.get('n_buckets')} buckets, the cluster {self.n_buckets}",  # type: ignore[attr-defined]
            )
        mine = list(layout.get("tensors") or [])
        outside = runs.Principal(name).outside([t.get("name") for t in mine])
        if outside is not None:
            return refusal(
                "forbidden",
                f"tensor {outside!r} is outside run {name!r}'s namespace {runs.namespace(name)!r}",
                namespace=runs.namespace(name),
            )
        quota = rec["quotas"].get("param_elems")
        total = sum(_elems(t["shape"]) for t in mine)
        if quota is not None and total > quota:
            return refusal(
                "quota_exceeded",
                f"run {name!r}'s layout has {total} parameter elements; its quota param_elems "
                f"is {quota}",
                quota="param_elems",
                limit=quota,
                asked=total,
            )
        current = self.layout  # type: ignore[attr-defined]
        others = [] if current is None else current["tensors"]
        others = [t for t in others if runs.run_of(t["name"]) != name]
        base = current or {k: v for k, v in layout.items() if k != "tensors"}
        if base.get("max_shard_elems") != layout.get("max_shard_elems"):
            return refusal(
                "conflict",
                f"the cluster's layout cuts shards of {base.get('max_shard_elems')} elements, "
                f"this one {layout.get('max_shard_elems')}",
            )
        merged = {**base, "tensors": others + copy.deepcopy(mine)}
        if merged != current:
            self.layout = merged
            self.layout_version += 1  # type: ignore[attr-defined]
        return {"ok": True, "layout_version": self.layout_version}  # type: ignore[attr-defined]

    # -- views -------------------------------------------------------------------------------------

    def run_view(
        self, name: str, tensors: list[dict[str, Any]] | None = None
    ) -> dict[str, Any] | None:
        """A run's record as shown (no token, no hash), with its part of the layout (`tensors`:
        that part, when the caller already picked it out)."""
        rec = self.runs_table().get(name)
        if rec is None:
            return None
        if tensors is None:
            layout = self.layout or {"tensors": []}  # type: ignore[attr-defined]
            tensors = [t for t in layout["tensors"] if runs.run_of(t["name"]) == name]
        elems = sum(_elems(t["shape"]) for t in tensors)
        return {
            "name": name,
            "namespace": runs.namespace(name),
            "quotas": dict(rec["quotas"]),
            "consistency": rec["consistency"],
            "created": rec["created"],
            "tensors": len(tensors),
            "param_elems": elems,
            "bytes": 4 * elems,
            # what its tensors and tables hold per copy, counted at their creates (issue 39)
            "usage": {
                q: sum(c.get(q, 0) for c in rec.get("usage", {}).values()) for q in runs.SIZE_QUOTAS
            },
        }

    def run_views(self) -> list[dict[str, Any]]:
        """Every run's view, the layout grouped by run once: a scan of the whole layout per run
        (4096 tensors, 128 runs) held a controller's event loop 0.1-0.14 s (issue 39)."""
        by_run: dict[str | None, list[dict[str, Any]]] = {}
        for t in (self.layout or {"tensors": []})["tensors"]:  # type: ignore[attr-defined]
            by_run.setdefault(runs.run_of(t["name"]), []).append(t)
        return [self.run_view(n, by_run.get(n, [])) for n in sorted(self.runs_table())]  # type: ignore[misc]

    def runs_auth(self) -> dict[str, Any]:
        """What the servers need: each run's token hash and quotas, and the recent deletions."""
        table = self.runs_table()
        return {
            "runs_version": self.runs_version,
            "runs": {
                n: {
                    "token_hash": r["token_hash"],
                    "quotas": dict(r["quotas"]),
                    "version": r["version"],
                }
                for n, r in table.items()
            },
            # [run, runs_version of the deletion]: a server drops the run's shards once
            "deleted": [[d["run"], d["version"]] for d in self.__dict__.get("deleted_runs", [])],
        }
