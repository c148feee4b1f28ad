"""`adamps controller`: run one controller node (Raft member + admin HTTP API)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from adamps.role import role_parser, run_role
from adamps.wire import web as aweb
from controller.config import ControllerConfig
from controller.service import ControllerService

log = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    return role_parser(
        "adamps controller",
        "Run one controller node: a Raft member holding the cluster configuration "
        "(servers, buckets, leases, layout) and serving its admin HTTP API.",
        ControllerConfig,
    )


def main(argv: list[str] | None = None) -> int:
    return run_role(
        build_parser(),
        ControllerConfig,
        "controller",
        argv,
        serve,
        lambda c: f"controller[{c.member}]",
    )


def serve(cfg: ControllerConfig) -> int:
    try:
        service = ControllerService(cfg)
    except OSError as exc:  # a new journal on a full (or read-only) data_dir: nothing to serve
        log.error("cannot start the Raft journal in %s: %s", cfg.data_dir, exc)
        return 1
    app = service.make_app()
    host = cfg.bind_host or cfg.self_host
    log.info(
        "controller %d of %d: raft %s, http %s:%d",
        cfg.member,
        len(cfg.members),
        service.raft.self_raft,
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
