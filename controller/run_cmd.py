"""`adamps run create|list|show|delete [NAME]`: an operator's runs (issue 25), on any controller
(writes are forwarded to the Raft leader). `create` prints the run's token once: keep it (for
example ``--token-file``, mode 0600), nobody can show it again."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from adamps import clusters, runs
from adamps.client.controller import ControllerClient
from adamps.client.rpc import RpcError
from adamps.security import tls
from adamps.security import token as tokens
from controller.status import table

ACTIONS = ("create", "list", "show", "delete")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="adamps run",
        description="Create, list, show or delete training runs: each has a namespace "
        "(NAME..), a token of its own and optional quotas.",
    )
    parser.add_argument("action", choices=ACTIONS, help="what to do")
    parser.add_argument("name", nargs="?", help="the run's name (create, show, delete)")
    clusters.add_arguments(parser)
    parser.add_argument("--param-elems", type=int, help="quota: parameter elements of the run")
    parser.add_argument("--table-rows", type=int, help="quota: rows of the run's tables")
    parser.add_argument(
        "--memory-bytes",
        type=int,
        help="quota: bytes the run's tensors and tables hold per copy (values, optimizer "
        "state, rows at max_rows, frequency filters), summed across the servers",
    )
    parser.add_argument(
        "--push-bytes-per-s", type=float, help="quota: push bytes per second, on each server"
    )
    parser.add_argument(
        "--consistency",
        default=None,
        help="async (default), sync or ssp:S: the mode the run's trainers declare unless given --consistency",
    )
    parser.add_argument(
        "--token-file",
        default="",
        help="create: also write the run's token to this new file (0600; an existing path is "
        "refused)",
    )
    parser.add_argument("--json", action="store_true", help="print the reply as JSON")
    parser.add_argument("--timeout", type=clusters.seconds, default=5.0, help="seconds per request")
    tls.add_arguments(parser)
    return parser


def _quotas(args: argparse.Namespace) -> dict[str, Any]:
    raw = {
        "param_elems": args.param_elems,
        "table_rows": args.table_rows,
        "memory_bytes": args.memory_bytes,
        "push_bytes_per_s": args.push_bytes_per_s,
    }
    return runs.check_quotas({k: v for k, v in raw.items() if v is not None})


def _claim_token_file(path: str) -> int:
    """Creates the token file (mode 0600) before the run is created: a path that exists (it may
    hold another run's token, shown once) or cannot be written is refused while nothing was
    created yet, instead of leaving a run whose token nobody holds. Returns its descriptor."""
    try:
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise ValueError(
            f"--token-file {path} exists (it may hold another run's token): give a new path"
        ) from None
    except OSError as exc:
        raise ValueError(f"--token-file {path} cannot be created: {exc.strerror}") from None


def _show(view: dict[str, Any]) -> str:
    quotas = view.get("quotas") or {}
    created = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(view["created"]))
    return "\n".join(
        [
            f"run {view['name']} (namespace {view['namespace']})",
            f"  created      {created} UTC",
            f"  consistency  {view['consistency']}",
            f"  tensors      {view['tensors']} ({view['param_elems']} elements, "
            f"{view['bytes']} bytes)",
            "  quotas       "
            + (", ".join(f"{k} = {v:g}" for k, v in sorted(quotas.items())) or "none"),
            "  usage        "
            + ", ".join(f"{k} = {v}" for k, v in sorted((view.get("usage") or {}).items())),
        ]
    )


def render_runs(listed: list[dict[str, Any]]) -> str:
    rows = [
        [
            v["name"],
            v["tensors"],
            v["param_elems"],
            v["quotas"].get("param_elems"),
            v["quotas"].get("table_rows"),
            v["quotas"].get("push_bytes_per_s"),
            v["consistency"],
        ]
        for v in listed
    ]
    header = ["run", "tensors", "elements", "quota elems", "quota rows", "quota B/s", "mode"]
    return table(rows, header) if rows else "no runs"


def _act(client: ControllerClient, args: argparse.Namespace) -> tuple[Any, str]:
    """(reply, text) of the action."""
    if args.action == "list":
        reply = client.runs()
        return reply, render_runs(reply["runs"])
    if args.action == "show":
        reply = client.run(args.name)
        if reply is None:
            raise RpcError("not_found", f"no run {args.name!r}")
        return reply, _show(reply)
    if args.action == "delete":
        reply = client.delete_run(args.name)
        return reply, f"run {args.name} deleted ({len(reply.get('tensors', []))} layout tensors)"
    reply = client.create_run(args.name, _quotas(args), args.consistency)
    if args.token_fd is not None:
        with os.fdopen(args.token_fd, "w") as fh:
            fh.write(reply["token"] + "\n")
        args.token_fd = None
    text = _show(reply["run"]) + f"\n  token        {reply['token']}\n(shown once: keep it)"
    return reply, text


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        if args.action != "list":
            if args.name is None:
                raise ValueError(f"a run's name is required: adamps run {args.action} NAME")
            runs.check_name(args.name)
        if args.action == "create":
            _quotas(args)
            runs.check_consistency(args.consistency)
        target = clusters.resolve(args.controllers, args.token, args.cluster, "adamps run")
        addrs, token = target.controllers, target.token
        tls.install_from(args)
        args.token_fd = None
        if args.action == "create" and args.token_file:
            args.token_fd = _claim_token_file(args.token_file)
    except (ValueError, tokens.TokenError) as exc:
        print(f"adamps run {args.action}: {exc}", file=sys.stderr)
        return 2
    client = ControllerClient(addrs, token, timeout=args.timeout, retry_for=args.timeout * 2)
    try:
        reply, text = _act(client, args)
    except RpcError as exc:
        msg = clusters.explain(exc, target)
        print(f"adamps run {args.action}: {msg}", file=sys.stderr)  # names its code
        return 1
    except (ConnectionError, TimeoutError, OSError) as exc:
        print(f"adamps run: no controller answered at {', '.join(addrs)}: {exc}", file=sys.stderr)
        return 1
    finally:
        client.close()
        if args.token_fd is not None:  # the run was not created: no token for the file
            os.close(args.token_fd)
            os.unlink(args.token_file)
    print(json.dumps(reply) if args.json else text)
    return 0
