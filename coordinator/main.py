"""`adamps coordinator`: Sandblaster L-BFGS (DistBelief 4.2) on a replicated cluster.

    adamps coordinator --controllers 127.0.0.1:7101,127.0.0.1:7102,127.0.0.1:7103 \\
        --model softmax-mnist --portions 40 --max-iter 30

Trainers started with ``adamps train --coordinator http://HOST:7400`` ask it for portions.
Exit code 0 when the run stopped normally (with --exit-when-done), 1 when the optimizer
failed, 2 for a bad configuration.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import threading

from adamps import metrics as am
from adamps.role import role_parser, run_role
from adamps.security import tls
from adamps.wire import web as aweb
from coordinator.config import CoordinatorConfig

log = logging.getLogger("coordinator")


def build_parser() -> argparse.ArgumentParser:
    return role_parser(
        "adamps coordinator",
        "Run Sandblaster L-BFGS: the optimizer drives vector operations on the parameter "
        "servers and hands portions of each batch to trainers.",
        CoordinatorConfig,
    )


def main(argv: list[str] | None = None) -> int:
    return run_role(build_parser(), CoordinatorConfig, "coordinator", argv, serve)


def serve(cfg: CoordinatorConfig) -> int:
    from coordinator.engine import Engine
    from coordinator.service import make_app

    registry = am.new_registry()
    engine = Engine(cfg, registry)
    engine.setup()
    optimizer = threading.Thread(target=engine.run, name="lbfgs", daemon=True)
    optimizer.start()
    app = make_app(engine, registry)

    async def run() -> None:
        runner = await aweb.serve(app, cfg.host, cfg.port)
        log.info("coordinator on %s://%s:%d (run %s)", tls.scheme(), cfg.host, cfg.port, cfg.run)
        try:
            while True:
                await asyncio.sleep(0.2)
                if cfg.exit_when_done and engine.stopped.is_set():
                    await asyncio.sleep(1.0)  # trainers hear "stop" on their next call
                    return
        finally:
            await runner.cleanup()

    try:
        asyncio.run(run())
    except KeyboardInterrupt:
        return 130
    st = engine.status()
    print(
        json.dumps({k: st[k] for k in ("run", "iteration", "f", "stopped", "losses", "error")}),
        flush=True,
    )
    return 1 if engine.error else 0


if __name__ == "__main__":
    sys.exit(main())
