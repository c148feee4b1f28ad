"""`adamps dataserver`: load a dataset, augment ahead, serve batch streams until SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from adamps.role import role_parser, run_role
from adamps.wire import web as adamps_web
from dataserver.cache import CacheTooSmall
from dataserver.config import DataServerConfig
from dataserver.service import DataServer
from dataserver.sources import SourceError, load_source

log = logging.getLogger("dataserver")


def build_parser() -> argparse.ArgumentParser:
    return role_parser(
        "adamps dataserver",
        "Serve a dataset's training images, augmented ahead of time, as batch streams to trainers.",
        DataServerConfig,
    )


def main(argv: list[str] | None = None) -> int:
    return run_role(build_parser(), DataServerConfig, "dataserver", argv, serve)


def serve(cfg: DataServerConfig) -> int:
    ctr = cfg.source.partition(":")[0] == "ctr"  # click logs' rows are never augmented
    if (
        cfg.augment and not ctr
    ):  # the augmentation workers need scipy: say so now, not in a worker later
        from adamps.extras import MissingExtra, require

        try:
            require(
                "scipy.ndimage", "augmenting images (--augment; --no-augment serves them as is)"
            )
        except MissingExtra as exc:
            print(f"adamps dataserver: {exc}", file=sys.stderr)
            return 2
    try:
        dataset = load_source(
            cfg.source, holdout=cfg.holdout, seed=cfg.seed, color=cfg.color,
            ctr_examples=cfg.ctr_examples, ctr_id_space=cfg.ctr_id_space,
            max_bytes=cfg.cache_bytes,
        )  # fmt: skip
    except SourceError as exc:
        print(f"adamps dataserver: {exc}", file=sys.stderr)
        return 2
    if dataset.kind == "ctr":
        log.info(
            "source %s: %d training / %d held-out rows of %d dense features and %d ids, "
            "%d line(s) skipped",
            cfg.source, len(dataset.train_y), len(dataset.test_y), dataset.train_x.shape[1],
            dataset.train_ids.shape[1], dataset.skipped,
        )  # fmt: skip
    else:
        log.info(
            "source %s: %d training / %d held-out images of shape %s, %d file(s) skipped",
            cfg.source, len(dataset.train_y), len(dataset.test_y), dataset.image_shape,
            dataset.skipped,
        )  # fmt: skip
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
