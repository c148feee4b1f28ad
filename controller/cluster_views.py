"""What the controllers' model answers: the routing table, a server's roles, the cluster view,
the lease record. Read-only (callers hold the replicated state's lock)."""

from __future__ import annotations

from typing import Any

from adamps.core import lease as leases
from controller import placement
from controller.cluster_rules import DEAD, DRAINING


class Views:
    """The read-only queries of the model.

    A part of :class:`controller.state.ClusterModel`, which holds the records its methods read
    and change (``servers``, ``buckets``, ``history``, ...): plain, deterministic, no clock, no
    IO, never raises on bad input."""

    def under_replicated(self) -> int:
        """Buckets with fewer caught-up live copies than the replication factor."""
        return sum(1 for b in range(self.n_buckets) if len(self.holders_of(b)) < self.replication)

    def rack_shared(self) -> int:
        """Buckets with two caught-up live copies in one rack (issue 26): a failure of that rack
        takes both. 0 while the live servers span enough racks and placement has settled."""
        racks = self.racks()
        return placement.rack_shared({b: self.holders_of(b) for b in range(self.n_buckets)}, racks)

    def holders_of(self, b: int) -> list[str]:
        """Caught-up live copies, primary first."""
        bk = self.buckets[b]
        out = [self.primary_of(b)] if self.holder_live(b) else []
        return out + [s for s in bk["holders"] if self._live(s)]

    def bucket_view(self, b: int) -> dict[str, Any]:
        bk = self.buckets[b]
        lease = self.lease_of(b)  # with its renewal time (controller/server_leases.py)
        p = None if lease is None else lease.holder
        return {
            "bucket": b,
            "primary": p,
            "address": self.servers.get(p, {}).get("address") if p else None,
            "epoch": 0 if lease is None else lease.epoch,
            "secondaries": list(bk["holders"]),
            "joining": list(bk["joining"]),
            "want": list(bk["want"]),
            "lease": None
            if lease is None
            else {**lease.to_dict(), "expires_at": leases.expires_at(lease, self.terms)},
            "lost": bk["lost"],
            "candidates": list(bk.get("candidates", [])),
            "state": "unavailable" if self.unavailable(b) else "ok",
        }

    def routing(self) -> dict[str, Any]:
        buckets = []
        for b in range(self.n_buckets):
            v = self.bucket_view(b)
            entry = {k: v[k] for k in ("bucket", "primary", "address", "epoch", "secondaries")}
            entry["state"] = v["state"]
            if v["state"] == "unavailable":  # nobody to send to: no primary to try
                entry.update(primary=None, address=None, secondaries=[])
            buckets.append(entry)
        return {
            "version": self.version,
            "n_buckets": self.n_buckets,
            "buckets": buckets,
            "servers": {
                s: rec["address"] for s, rec in self.servers.items() if rec["state"] != DEAD
            },
            "layout_version": self.layout_version,
        }

    def holds_lease(self, sid: str) -> bool:
        """`sid` holds the lease of some bucket in its current incarnation (a heartbeat then
        renews its leases). Reads only the buckets leased to it (`leased_to`)."""
        return any(self.primary_of(b) == sid and self.holder_live(b) for b in self.leased_to(sid))

    def unavailable_buckets(self) -> list[int]:
        """The unavailable buckets, ascending. Every heartbeat's answer carries them: computed
        once per routing version (every change of a server's liveness, a replica set or a
        lease's holder bumps it), not once per heartbeat (issue 26's scale simulation: a pass
        over 100,000 buckets for each of 1,000 heartbeats a second)."""
        cached = self.__dict__.get("_unavailable")
        if cached is None or cached[0] != self.version:
            # A bucket becomes unavailable only when its last live member leaves (`_leave`,
            # which adds it to this index, a superset); the index is pruned as buckets are
            # served again. During a recovery the version moves with every entry: a pass over
            # 100,000 buckets per version was most of the leader's CPU (issue 26).
            maybe = self.__dict__.get("_unavail")
            if maybe is None:
                maybe = set(range(self.n_buckets))
                self._unavail = maybe
            now_out = sorted(b for b in maybe if self.unavailable(b))
            maybe.intersection_update(now_out)
            cached = (self.version, now_out)
            self._unavailable = cached
        return list(cached[1])

    def heartbeat_view(self, sid: str, known: Any, deltas: bool = False) -> dict[str, Any]:
        """What the answer to a heartbeat of `sid` reads: the version, the server's state, the
        unavailable buckets, and its roles only when its `known` version is not the current
        one (it holds them otherwise). With `deltas` (a server that applies them, issue 40),
        the roles are those of the buckets whose record changed since `known`, `removed` the
        changed buckets where it has no role any more, and `roles_since` is `known`; a full
        list (no `roles_since`) when `known` is older than what this controller tracked."""
        out: dict[str, Any] = {
            "version": self.version,
            "state": self.servers[sid]["state"],
            "unavailable": self.unavailable_buckets(),
            "roles": None,
        }
        if known == self.version:
            return out
        stamps = self.changed_since(known) if deltas else None
        if stamps is None:
            out["roles"] = self.roles_of(sid)
            return out
        offered = self.servers.get(sid, {}).get("copies", {})
        self._prune(sid, known, stamps)
        near = self.touching(sid) | set(offered) | set(self.leased_to(sid))
        roles, removed = [], []
        for b in sorted(x for x in near if stamps.get(x, -1) > known):
            view = self._role_view(sid, b, offered)
            if view is None:
                removed.append(b)
            else:
                roles.append(view)
        if removed:
            self._gone.setdefault(sid, set()).update(removed)
        out.update(roles=roles, removed=removed, roles_since=known)
        return out

    def _prune(self, sid: str, known: int, stamps: dict[int, int]) -> None:
        """Forgets, from `touching(sid)`, the buckets an answer told `sid` to drop once `sid`
        says it applied them (`known` is at or after their last change) and it is still in
        none of their lists. Not earlier: an answer may be lost, and the next delta from the
        older version must still name them."""
        gone = self.__dict__.setdefault("_gone", {}).get(sid)
        if not gone:
            return
        near = self.touching(sid)
        for b in [b for b in gone if stamps.get(b, self._floor) <= known]:
            gone.discard(b)
            bk = self.buckets[b]
            lists = (bk["holders"], bk["joining"], bk.get("candidates", []), bk.get("left", {}))
            if not any(sid in x for x in lists):
                near.discard(b)

    def changed_since(self, known: Any) -> dict[int, int] | None:
        """bucket -> the version its record last changed at (changes tracked on this node
        since `_floor`), or None when `known` is no version this node can answer a delta
        from (None, older than the tracking, newer than the state: a full answer then).

        A change is marked (`_mark`) while an entry applies, and stamped here with the
        version of the state read: every role change moves the version (the full answer's
        rule too), so a bucket stamped later than a server's `known` is one whose record
        changed after the state it knows. Derived beside the state, never dumped: a new
        leader or a restarted controller starts tracking at its current version, and
        answers older versions in full."""
        d = self.__dict__
        if "_stamps" not in d:
            self._stamps, self._dirty, self._floor = {}, set(), self.version
            return None
        stamps = d["_stamps"]
        for b in d["_dirty"]:
            stamps[b] = self.version
        d["_dirty"].clear()
        ok = isinstance(known, int) and not isinstance(known, bool)
        if not ok or known < self._floor or known > self.version:
            return None
        return stamps

    def roles_of(self, sid: str) -> list[dict[str, Any]]:
        out = []
        offered = self.servers.get(sid, {}).get("copies", {})
        near = self.touching(sid)
        # Only the buckets where `sid` may have a role (the indexes are supersets), ascending.
        for b in sorted(near | set(offered) | set(self.leased_to(sid))):
            view = self._role_view(sid, b, offered)
            if view is not None:
                out.append(view)
                continue
            if "_stamps" in self.__dict__:
                # Deltas are tracked: a server whose answer is lost asks again from its older
                # version, and the delta must still find this bucket; it is pruned once the
                # server says it applied this state (`_prune`).
                self.__dict__.setdefault("_gone", {}).setdefault(sid, set()).add(b)
                continue
            bk = self.buckets[b]
            lists = (bk["holders"], bk["joining"], bk.get("candidates", []), bk.get("left", {}))
            if not any(sid in x for x in lists):
                near.discard(b)  # in none of them any more: pruned from the index
        return out

    def _role_view(self, sid: str, b: int, offered: Any) -> dict[str, Any] | None:
        """The view of bucket `b` with `sid`'s role in it, or None: no role (drop the copy)."""
        bk = self.buckets[b]
        if self.primary_of(b) == sid and self.holder_live(b):
            role = "primary"
        elif sid in bk["holders"]:
            role = "secondary"
        elif sid in bk.get("candidates", []) or (b in offered and self.unavailable(b)):
            # Keep the copy, serve nothing: it may be the freshest one there is (a
            # candidate), or what an operator's declare-lost (write_off) picks.
            role = "standby"
        elif sid in bk["joining"]:
            role = "joining"
        elif b in offered and sid in bk.get("left", {}):
            role = "standby"  # left shortly before: a candidate if the last member leaves
        else:
            return None
        view = self.bucket_view(b)
        view["role"] = role
        view["secondary_addresses"] = {
            s: self.servers.get(s, {}).get("address") for s in view["secondaries"] + view["joining"]
        }
        if role == "joining":
            view["join"] = bk.get("join_ids", {}).get(sid, 0)
        return view

    def lease_records(self) -> list[dict[str, Any]]:
        """Every lease in the record (closed ones, then the current ones)."""
        current = [
            {"bucket": b, **self.lease_of(b).to_dict()}  # type: ignore[union-attr]
            for b, bk in enumerate(self.buckets)
            if bk["lease"]
        ]
        return [*self.history, *current]

    def cluster_view(self) -> dict[str, Any]:
        per_server: dict[str, dict[str, int]] = {
            s: {"primary": 0, "secondary": 0, "joining": 0} for s in self.servers
        }
        for b in range(self.n_buckets):
            v = self.bucket_view(b)
            if v["primary"] in per_server:
                per_server[v["primary"]]["primary"] += 1
            for s in v["secondaries"]:
                per_server.setdefault(s, {"primary": 0, "secondary": 0, "joining": 0})[
                    "secondary"
                ] += 1
            for s in v["joining"]:
                per_server.setdefault(s, {"primary": 0, "secondary": 0, "joining": 0})[
                    "joining"
                ] += 1
        servers = {}
        for s, rec in sorted(self.servers.items()):
            counts = per_server.get(s, {})
            state = rec["state"]
            if state == DRAINING and not any(counts.values()):
                state = "drained"
            servers[s] = {**rec, "state": state, **counts}
        return {
            "version": self.version,
            "n_buckets": self.n_buckets,
            "replication": self.replication,
            "clock": self.clock,
            "lease_terms": self.terms.to_dict(),
            "servers": servers,
            "buckets": [self.bucket_view(b) for b in range(self.n_buckets)],
            "under_replicated": self.under_replicated(),
            # issue 26: failure domains among the eligible servers, and buckets with two
            # caught-up copies in one of them
            "racks": len({placement.domain(s, self.racks()) for s in self.eligible()}),
            "rack_shared": self.rack_shared(),
            "unassigned": sum(1 for b in range(self.n_buckets) if not self.holder_live(b)),
            "unavailable": [b for b in range(self.n_buckets) if self.unavailable(b)],
            "lost": [b for b in range(self.n_buckets) if self.buckets[b]["lost"]],
            "declared_lost": getattr(self, "declared_lost", 0),
            "digest_conflicts": getattr(self, "digest_conflicts", 0),
            "layout_version": self.layout_version,
        }
