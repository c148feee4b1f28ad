"""`adamps drain SERVER` and `adamps undrain SERVER`: an operator takes a parameter server out of
service, or returns it (POST /servers/{id}/drain, /undrain on any controller, which forwards to
the Raft leader)."""

from __future__ import annotations

import argparse
import sys

from adamps import clusters
from adamps.client.controller import ControllerClient
from adamps.client.rpc import RpcError
from adamps.security import tls
from adamps.security import token as tokens

WHAT = {
    "drain": "move every bucket copy off SERVER; stop it once `adamps status` shows it drained",
    "undrain": "return a draining or drained SERVER to service (it may receive buckets again)",
}


def build_parser(op: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"adamps {op}", description=WHAT[op])
    parser.add_argument("server", help="the parameter server's id (as `adamps status` lists it)")
    clusters.add_arguments(parser)
    parser.add_argument("--timeout", type=clusters.seconds, default=5.0, help="seconds per request")
    tls.add_arguments(parser)
    return parser


def run(op: str, argv: list[str]) -> int:
    args = build_parser(op).parse_args(argv)
    try:
        target = clusters.resolve(args.controllers, args.token, args.cluster, f"adamps {op}")
        addrs, token = target.controllers, target.token
        tls.install_from(args)
    except (ValueError, tokens.TokenError) as exc:
        print(f"adamps {op}: {exc}", file=sys.stderr)
        return 2
    client = ControllerClient(addrs, token, timeout=args.timeout, retry_for=args.timeout * 2)
    try:
        reply = client.drain(args.server) if op == "drain" else client.undrain(args.server)
    except RpcError as exc:
        msg = clusters.explain(exc, target)
        print(f"adamps {op}: {args.server}: {msg}", file=sys.stderr)  # names its code
        return 1
    except (ConnectionError, TimeoutError, OSError) as exc:
        print(f"adamps {op}: no controller answered at {', '.join(addrs)}: {exc}", file=sys.stderr)
        return 1
    finally:
        client.close()
    print(f"{reply['server']}: {reply['state']}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run("drain", sys.argv[1:] if argv is None else argv)


def undrain_main(argv: list[str] | None = None) -> int:
    return run("undrain", sys.argv[1:] if argv is None else argv)
