"""`adamps status --run NAME`: one run's tensors and tables, their buckets and primaries, and its
quota use, so that finding where a run's values live takes no hashing of names by hand.

Tensors come from the controllers' layout (the run's namespace, ``NAME..``), their buckets from
the layout's shards and the primaries from the routing table. Tables are not in the layout: each
server lists the tables it holds (``list_tables``, with the cluster token). The quota use is the
run's record (``GET /runs/NAME``) and the bytes the servers hold of it and admitted from it.
"""

from __future__ import annotations

from typing import Any

from adamps import runs
from adamps.client.rpc import RpcError, SyncRpc, base_url, get_json, http_json
from adamps.layout import Layout
from controller.text_table import table


def _buckets(bs: list[int]) -> str:
    """'3 (1, 7, 40)', or the first ones and a count when many."""
    bs = sorted(bs)
    shown = ", ".join(map(str, bs[:8])) + (", ..." if len(bs) > 8 else "")
    return f"{len(bs)} ({shown})"


def _found(addr: str, path: str, timeout: float) -> Any:
    """GET `path`'s JSON, None on 404; ConnectionError otherwise."""
    status, body = http_json(base_url(addr) + path, timeout=timeout)
    if status == 404:
        return None
    if status != 200:
        raise ConnectionError(f"GET {base_url(addr)}{path}: answered {status or 'nothing'}")
    return body


def collect(addr: str, name: str, token: str | None, timeout: float) -> dict[str, Any]:
    """Everything the run view prints, read from the controller at `addr` and the servers."""
    routing = get_json(addr, "/routing", timeout)
    ns = runs.namespace(name)
    got = _found(addr, "/layout", timeout)
    layout = Layout.from_dict(got["layout"]) if got else None
    primary = {int(e["bucket"]): e.get("primary") for e in routing.get("buckets", [])}
    tensors = []
    for tname, spec in (layout.tensors if layout else {}).items():
        if not tname.startswith(ns):
            continue
        bs = sorted(layout.buckets_of_tensor(tname)) if layout else []
        tensors.append(
            {
                "name": tname,
                "shape": list(spec.shape),
                "buckets": bs,
                "primaries": sorted({str(primary.get(b)) for b in bs}),
            }  # fmt: skip
        )
    record = _found(addr, f"/runs/{name}", timeout)  # None: used with the cluster token only
    tables: dict[str, dict[str, Any]] = {}
    held = pushed = 0
    for sid, url in routing.get("servers", {}).items():
        try:
            st = get_json(url, "/status", timeout)
        except (OSError, ValueError, RpcError):
            continue
        mine = ((st.get("runs") or {}).get("runs") or {}).get(name) or {}
        held += int(mine.get("held_bytes", 0))
        pushed += int(mine.get("pushed_bytes", 0))
        if not token:
            continue
        rpc = SyncRpc(url, token, timeout)
        try:
            listed = rpc.call("list_tables").get("tables", [])
        except (OSError, RpcError):
            listed = []
        finally:
            rpc.close()
        for t in listed:
            if runs.run_of(t["name"]) != name:
                continue
            row = tables.setdefault(t["name"], {"name": t["name"], "dim": t.get("dim"),
                                                "rows": 0, "buckets": set(), "primaries": set()})  # fmt: skip
            for b, n in (t.get("bucket_rows") or {}).items():
                if primary.get(int(b)) == sid:  # one copy: the primary's, which commits first
                    row["buckets"].add(int(b))
                    row["primaries"].add(sid)
                    row["rows"] += int(n)
    return {"run": name, "tensors": tensors, "record": record, "held_bytes": held,
            "pushed_bytes": pushed, "tables": list(tables.values()),
            "tables_listed": bool(token)}  # fmt: skip


def render(v: dict[str, Any]) -> str:
    name = v["run"]
    out = [f"run {name}"]
    rec = v["record"]
    if rec is None:
        out.append("  no run record (used with the cluster token, never created): no quotas")
        q: dict[str, Any] = {}
    else:
        q = rec.get("quotas") or {}
        out.append(f"  mode {rec.get('consistency')}")
    elems = sum(_prod(t["shape"]) for t in v["tensors"])
    use = (
        f" ({elems / q['param_elems']:.0%} of the quota {q['param_elems']})"
        if q.get("param_elems")
        else " (no quota)"
    )
    out.append(f"  parameter elements {elems}{use}")
    out.append(f"  table rows quota {q.get('table_rows') or 'none'}; push quota "
               f"{q.get('push_bytes_per_s') or 'none'} B/s per server")  # fmt: skip
    out.append(f"  servers hold {v['held_bytes']} bytes of it (every copy); pushes admitted "
               f"{v['pushed_bytes']} bytes")  # fmt: skip
    out.append("")
    rows = [[t["name"], "x".join(map(str, t["shape"])), _buckets(t["buckets"]),
             ", ".join(t["primaries"])] for t in v["tensors"]]  # fmt: skip
    out.append(table(rows, ["tensor", "shape", "buckets", "primaries"]) if rows else "no tensors")
    out.append("")
    if not v["tables_listed"]:
        out.append("tables: not listed (no cluster token: give --token or --cluster)")
    elif v["tables"]:
        rows = [[t["name"], t["dim"], t["rows"], _buckets(sorted(t["buckets"])),
                 ", ".join(sorted(t["primaries"]))] for t in v["tables"]]  # fmt: skip
        out.append(table(rows, ["table", "dim", "rows (one copy)", "buckets", "primaries"]))
    else:
        out.append("no tables")
    return "\n".join(out)


def _prod(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n
