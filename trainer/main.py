"""`adamps train`: run one model replica with Downpour SGD (trainer/downpour.py).

    adamps train --ps http://127.0.0.1:7100 --dataservers http://127.0.0.1:7300 \\
        --replica 0 --n-replicas 2 --epochs 5 --out model.npz --history history.jsonl
    adamps train --controllers 127.0.0.1:7101,127.0.0.1:7102,127.0.0.1:7103 ...

Serves /metrics, /status and /healthz on --metrics-port while it trains. Exit code 0 when the
training completed, 1 when it failed (the error is logged), 2 for a bad configuration,
130/143 when interrupted.
"""

from __future__ import annotations

import argparse
import json
import logging
import resource
import signal
import sys
import time
from typing import Any

from adamps import config as aconfig
from adamps import metrics as am
from adamps.role import role_parser, run_role
from adamps.security import tls
from trainer.config import TrainConfig
from trainer.metrics_server import MetricsServer

log = logging.getLogger("trainer")


def build_parser() -> argparse.ArgumentParser:
    return role_parser(
        "adamps train", "Run one model replica (Downpour SGD with Hogwild workers).", TrainConfig
    )


#: error codes by which the cluster refuses what the run asked (docs/protocol-ps.md): reported in
#: one line, not as a crash
REFUSALS = frozenset(
    {"quota_exceeded", "forbidden", "unauthorized", "too_large", "exists", "bad_request"}
)


def main(argv: list[str] | None = None) -> int:
    return run_role(build_parser(), TrainConfig, "train", argv, serve, _log_name)


def _log_name(c: TrainConfig) -> str:
    part = f"/p{c.partition}" if c.partitions > 1 and c.partition >= 0 else ""
    return f"train[{c.replica}{part}]"


def serve(cfg: TrainConfig) -> int:
    if cfg.init and cfg.replica == 0:  # a bad --init is a message, before any process starts
        import numpy as np

        from trainer.model import Model, resolve_spec
        from trainer.warm import InitError, initial_values

        shapes = dict(
            Model(
                resolve_spec(cfg.model), params=np.empty(0, np.float32), _layout_only=True
            ).tensors()
        )
        try:
            initial_values(cfg.init, shapes)
        except InitError as exc:
            print(f"adamps train: --init {cfg.init}: {exc}", file=sys.stderr)
            return 2
    from trainer.runmode import resolve

    try:
        cfg = resolve(cfg)  # the consistency mode: given, else the run's record, else async
    except ValueError as exc:
        print(f"adamps train: {exc}", file=sys.stderr)
        return 2
    if cfg.coordinator:  # Sandblaster L-BFGS (DistBelief 4.2)
        from trainer.sandblaster import serve_sandblaster

        return serve_sandblaster(cfg)
    if cfg.partitions > 1 and cfg.partition < 0:  # one replica as K child processes
        from trainer.partition_launch import launch

        return launch(cfg)
    registry = am.new_registry()
    #: errors that name a bad model (exit 2, like a bad configuration), not a failed run
    bad_model: tuple[type[Exception], ...] = ()
    if cfg.torch:  # a user's PyTorch model (adamps.torch; torch is imported only then)
        try:
            from trainer.torch_main import make_torch_replica
        except ImportError as exc:
            log.error("--torch needs PyTorch: pip install 'adamps[torch]' (%s)", exc)
            return 2
        from adamps.torch.params import ModelError

        bad_model = (ModelError,)
        try:
            replica: Any = make_torch_replica(cfg, registry)
        except ModelError as exc:
            log.error("%s", exc)
            return 2
    else:
        from trainer.partitioned import make_replica

        replica = make_replica(cfg, registry)
    started = time.time()

    def status() -> dict[str, Any]:
        return {
            "role": "trainer",
            "config": aconfig.to_dict(cfg),
            "uptime_seconds": time.time() - started,
            "replica": cfg.replica,
            #: an elastic replica's name in its run (trainer/elastic.py), else null
            "elastic_replica": getattr(replica, "replica_id", None),
            "epoch": replica.epoch,
            "completed_epoch": replica.completed,
            "steps": replica.step,
            "images": replica.result.images,
            "fetch_staleness_steps": replica.last_staleness,
            "push_queue": len(replica.pushq),
            "heldout_accuracy": {str(k): v for k, v in replica.result.accuracy.items()},
            **({"partition": replica.partition_status()} if cfg.partitions > 1 else {}),
        }

    server = None
    if cfg.metrics_port >= 0:
        server = MetricsServer(registry, cfg.token, status, cfg.host, cfg.metrics_port)
        log.info("metrics on %s://%s:%d/metrics", tls.scheme(), cfg.host, server.port)
        if cfg.partitions > 1:
            replica.metrics_port = server.port  # type: ignore[attr-defined] # told to the leader

    interrupted: list[int] = []

    def on_signal(signum: int, _frame: Any) -> None:
        interrupted.append(signum)
        replica.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        result = replica.run()
    except KeyboardInterrupt:
        log.info("interrupted")
        return 128 + (interrupted[0] if interrupted else signal.SIGINT)
    except bad_model as exc:  # e.g. a tensor of the run on the servers with another shape
        log.error("%s", exc)
        return 2
    except Exception as exc:
        if interrupted:
            log.info("interrupted")
            return 128 + interrupted[0]
        from adamps.client.rpc import RpcError

        if isinstance(exc, RpcError) and exc.code in REFUSALS:
            # The cluster refused the run (a quota, a token's rights): the message names why;
            # a traceback would bury it.
            log.error("training refused by the cluster: %s", exc)
            return 1
        log.exception("training failed")
        return 1
    finally:
        if server is not None:
            server.close()
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)  # the Hogwild worker processes
    summary = {
        "replica": cfg.replica,
        "cpu_main_s": round(own.ru_utime + own.ru_stime, 2),
        "cpu_workers_s": round(children.ru_utime + children.ru_stime, 2),
        "cpu_threads_s": result.cpu_threads,
        "images": result.images,
        "seconds": round(result.seconds, 2),
        "images_per_s": round(result.images / max(result.seconds, 1e-9), 1),
        "heldout_accuracy": {str(k): v for k, v in result.accuracy.items()},
        "bytes_pushed": result.bytes_pushed,
        "pushes": result.pushes,
        "sent_fraction": result.sent_fraction,
        **({"partition": replica.partition_status()} if cfg.partitions > 1 else {}),
        "out": result.out,
    }
    log.info("training complete")
    print(json.dumps(summary), flush=True)  # the last line of stdout: the run's figures
    return 0


if __name__ == "__main__":
    sys.exit(main())
