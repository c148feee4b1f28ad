"""`adamps controller`: run one controller node (Raft member + admin HTTP API)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from adamps import config as aconfig
from adamps import web as aweb
from controller.config import ControllerConfig
from controller.service import ControllerService

log = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="adamps controller",
        description="Run one controller node: a Raft member holding the cluster configuration "
        "(servers, buckets, leases, layout) and serving its admin HTTP API.",
    )
    aconfig.add_arguments(parser, ControllerConfig)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        cfg = aconfig.load(ControllerConfig, "controller", args)
    except aconfig.ConfigError as exc:
        print(f"adamps controller: {exc}", file=sys.stderr)
        return 2
    aweb.setup_logging(cfg.log_level, f"controller[{cfg.member}]")
    service = ControllerService(cfg)
    app = service.make_app()
    host = cfg.bind_host or cfg.self_host
    log.info(
        "controller %d of %d: raft %s, http %s:%d",
        cfg.member,
        len(cfg.members),
        service.self_raft,
        host,
        cfg.http_port,
    )
    try:
        asyncio.run(aweb.run_app(app, host, cfg.http_port))
    except OSError as exc:
        log.error("cannot serve HTTP on %s:%d: %s", host, cfg.http_port, exc.strerror or exc)
        return 1
    finally:
        service.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
