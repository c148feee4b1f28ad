"""`adamps status`: print the cluster (controllers, servers, buckets, progress) as tables."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from adamps import clusters
from adamps import runs as run_names
from adamps.client.rpc import get_json
from adamps.config import ConfigError
from adamps.security import tls
from controller import run_view
from controller.text_table import table  # noqa: F401 (run_cmd uses it from here)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="adamps status", description="Print the cluster as seen by the controllers."
    )
    clusters.add_arguments(parser)
    parser.add_argument(
        "--run",
        default=None,
        help="show this run only: its tensors and tables, their buckets and primaries, its quota "
        "use (tables are listed with the cluster token)",
    )
    parser.add_argument("--buckets", action="store_true", help="also list every bucket")
    parser.add_argument("--json", action="store_true", help="print the raw /cluster JSON instead")
    parser.add_argument("--timeout", type=clusters.seconds, default=3.0, help="seconds per request")
    tls.add_arguments(parser)
    return parser


def flush_cells(st: dict[str, Any] | None) -> list[Any]:
    """[last flush (UTC), its age, durable] from a parameter server's /status (issue 29)."""
    if st is None:
        return ["?", "?", "unreachable"]
    last = st.get("last_flush") or {}
    at = last.get("time")
    age = last.get("age_seconds")
    when = time.strftime("%H:%M:%S", time.gmtime(at)) if at else "never"
    durable = "yes" if st.get("durable", True) else f"NO: {st.get('not_durable')}"
    return [when, "-" if age is None else f"{age:.1f}s", durable]


def journal_cell(journal: dict[str, Any] | None) -> str:
    """A controller's Raft journal: "ok", or why it cannot write it (it stands aside)."""
    if journal is None:
        return "-"
    return "ok" if journal.get("writable") else f"NOT WRITABLE: {journal.get('error')}"


def render(
    view: dict[str, Any],
    controllers: list[dict[str, Any]],
    progress: dict[str, Any],
    buckets: bool,
    servers: dict[str, dict[str, Any] | None] | None = None,
    runs: list[dict[str, Any]] | None = None,
) -> str:
    """`servers`: each server's own /status (None: unreachable), for its flush columns and the
    runs' held and pushed bytes; `runs`: the controllers' /runs (issue 25)."""
    out = []
    out.append(
        table(
            [
                [
                    c["addr"],
                    c.get("role"),
                    c.get("term"),
                    c.get("commit_index"),
                    c.get("leader"),
                    journal_cell(c.get("journal")),
                ]
                for c in controllers
            ],
            ["controller", "role", "term", "commit", "leader", "journal"],
        )
    )
    out.append("")
    out.append(
        f"table version {view['version']}  buckets {view['n_buckets']}  replication {view['replication']}  "
        f"under-replicated {view['under_replicated']}  unassigned {view['unassigned']}  "
        f"layout v{view['layout_version']}"
    )
    if view.get("rack_shared"):  # issue 26: a rack failure would take two copies of these
        out.append(
            f"buckets with two copies in one rack: {view['rack_shared']} "
            f"({view.get('racks', '?')} racks among the eligible servers)"
        )
    if view.get("unavailable"):
        out.append(
            f"UNAVAILABLE buckets (no live copy; waiting for a copy to come back): "
            f"{view['unavailable']}"
        )
    if view.get("lost"):
        out.append(f"buckets declared lost by an operator: {view['lost']}")
    out.append("")
    rows = [
        [
            s,
            r["address"],
            r["state"],
            r.get("rack", "-"),
            r.get("primary", 0),
            r.get("secondary", 0),
            r.get("joining", 0),
            r["incarnation"],
            *(flush_cells((servers or {}).get(s)) if servers is not None else []),
        ]
        for s, r in view["servers"].items()
    ]
    header = [
        "server",
        "address",
        "state",
        "rack",
        "primary",
        "secondary",
        "joining",
        "incarnation",
    ]
    if servers is not None:
        header += ["last flush (UTC)", "flush age", "durable"]
    out.append(table(rows, header))
    if buckets:
        out.append("")
        rows = []
        for bv in view["buckets"]:
            lease = bv.get("lease") or {}
            left = None
            if lease:
                left = f"{lease['expires_at'] - view['clock']:.1f}s"
            rows.append(
                [
                    bv["bucket"],
                    bv["primary"],
                    bv["epoch"],
                    ",".join(bv["secondaries"]),
                    ",".join(bv["joining"]),
                    left,
                    bv.get("state", "ok") + (" (lost)" if bv.get("lost") else ""),
                    ",".join(bv.get("candidates", [])),
                ]
            )
        header = ["bucket", "primary", "epoch", "secondaries", "joining", "lease left", "state"]
        out.append(table(rows, [*header, "candidates"]))
    if runs:
        out.append("")
        out.append(render_runs(runs, servers or {}))
    if progress:
        out.append("")
        rows = []
        for epoch, per in sorted(progress.items(), key=lambda kv: int(kv[0])):
            for replica, p in sorted(per.items()):
                rows.append([epoch, replica, p["progress"], p["done"]])
        out.append(table(rows, ["epoch", "replica", "progress", "done"]))
    return "\n".join(out)


def render_runs(runs: list[dict[str, Any]], servers: dict[str, dict[str, Any] | None]) -> str:
    """Each run: its tensors and elements (the layout), the bytes the servers hold of it (every
    copy) and the bytes of pushes they admitted, its quotas and the use of the element quota."""
    held: dict[str, int] = {}
    pushed: dict[str, int] = {}
    for st in servers.values():
        for run, d in ((st or {}).get("runs") or {}).get("runs", {}).items():
            held[run] = held.get(run, 0) + int(d.get("held_bytes", 0))
            pushed[run] = pushed.get(run, 0) + int(d.get("pushed_bytes", 0))
    rows = []
    for v in runs:
        q = v.get("quotas") or {}
        use = f"{v['param_elems'] / q['param_elems']:.0%}" if q.get("param_elems") else None
        rows.append(
            [
                v["name"], v["tensors"], v["param_elems"], held.get(v["name"], 0),
                pushed.get(v["name"], 0), q.get("param_elems"), use, q.get("table_rows"),
                q.get("push_bytes_per_s"), v["consistency"],
            ]
        )  # fmt: skip
    header = ["run", "tensors", "elements", "held bytes", "pushed bytes", "quota elems",
              "use", "quota rows", "quota push B/s", "mode"]  # fmt: skip
    return table(rows, header)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        tls.install_from(args)
        addrs, _info = clusters.find(args.controllers, args.cluster)
        if args.run is not None:
            run_names.check_name(args.run)
    except (ConfigError, ValueError) as exc:
        print(f"adamps status: {exc}", file=sys.stderr)
        return 2
    if args.run is not None:
        return show_run(args, addrs)
    controllers = []
    view = progress = None
    runs: list[dict[str, Any]] = []
    for addr in addrs:
        try:
            st = get_json(addr, "/status", args.timeout)["raft"]
        except (OSError, ValueError, KeyError) as exc:  # get_json: ConnectionError
            controllers.append({"addr": addr, "role": f"unreachable ({type(exc).__name__})"})
            continue
        controllers.append({"addr": addr, **st})
        if view is None:
            # A controller that answers /status may still refuse the state (503: starting, or
            # standing aside because it cannot write its journal): the next one is asked.
            try:
                view = get_json(addr, "/cluster", args.timeout)
                progress = get_json(addr, "/progress", args.timeout).get("epochs", {})
            except (OSError, ValueError, KeyError):
                view = None
                continue
            try:
                runs = get_json(addr, "/runs", args.timeout).get("runs", [])
            except (OSError, ValueError, KeyError):  # a controller without runs (older)
                runs = []
    if view is None:
        print(f"adamps status: no controller answered at {', '.join(addrs)}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(view, indent=2))
        return 0
    servers: dict[str, dict[str, Any] | None] = {}
    for sid, rec in view["servers"].items():
        try:
            servers[sid] = (
                None
                if rec["state"] == "dead"
                else get_json(rec["address"], "/status", args.timeout)
            )
        except (OSError, ValueError, KeyError):
            servers[sid] = None
    print(render(view, controllers, progress or {}, args.buckets, servers, runs))
    return 0


def show_run(args: argparse.Namespace, addrs: list[str]) -> int:
    """`adamps status --run NAME` (controller/run_view.py), from the first controller answering."""
    try:  # the token only lists tables: without one, the rest is shown
        token = clusters.resolve(",".join(addrs), args.token, args.cluster, "adamps status").token
    except ValueError:
        token = None
    for addr in addrs:
        try:
            view = run_view.collect(addr, args.run, token, args.timeout)
        except (OSError, ValueError, KeyError):
            continue
        if view["record"] is None and not (
            view["tensors"] or view["tables"] or view["held_bytes"] or view["pushed_bytes"]
        ):  # a mistyped name printed an empty run, exit code 0
            tables = ", no tables" if view["tables_listed"] else ""
            print(f"adamps status: no run {args.run!r} on this cluster (no record, no tensors"
                  f"{tables}; `adamps run list` lists the runs created)", file=sys.stderr)  # fmt: skip
            return 1
        print(json.dumps(view, default=sorted) if args.json else run_view.render(view))
        return 0
    print(f"adamps status: no controller answered at {', '.join(addrs)}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
