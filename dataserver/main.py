"""`adamps dataserver`: load a dataset, augment ahead, serve batch streams until SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from adamps import config as adamps_config
from adamps import web as adamps_web
from dataserver.cache import CacheTooSmall
from dataserver.config import DataServerConfig
from dataserver.service import DataServer
from dataserver.sources import SourceError, load_source

log = logging.getLogger("dataserver")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="adamps dataserver",
        description="Serve a dataset's training images, augmented ahead of time, as batch streams to trainers.",
    )
    adamps_config.add_arguments(p, DataServerConfig)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        cfg = adamps_config.load(DataServerConfig, "dataserver", args)
    except adamps_config.ConfigError as exc:
        print(f"adamps dataserver: {exc}", file=sys.stderr)
        return 2
    adamps_web.setup_logging(cfg.log_level, "dataserver")
    try:
        dataset = load_source(cfg.source, holdout=cfg.holdout, seed=cfg.seed, color=cfg.color)
    except SourceError as exc:
        print(f"adamps dataserver: {exc}", file=sys.stderr)
        return 2
    log.info(
        "source %s: %d training / %d held-out images of shape %s, %d file(s) skipped",
        cfg.source,
        len(dataset.train_y),
        len(dataset.test_y),
        dataset.image_shape,
        dataset.skipped,
    )
    try:
        server = DataServer(cfg, dataset)
    except CacheTooSmall as exc:
        print(f"adamps dataserver: {exc}", file=sys.stderr)
        return 2
    asyncio.run(_serve(server))
    return 0


async def _serve(server: DataServer) -> None:
    await server.start()
    try:
        await adamps_web.run_app(server.make_app(), server.cfg.host, server.cfg.port)
    finally:
        await server.close()


if __name__ == "__main__":
    sys.exit(main())
