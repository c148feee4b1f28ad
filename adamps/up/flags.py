"""`adamps up`'s flags: the parser, and the checks that name a bad value and what is expected
(exit code 2)."""

from __future__ import annotations

import argparse
import json
import re
from typing import Any

from adamps import config
from adamps.up.train_flags import TrainFlags

#: what the defaults were chosen to reach (measured: see docs/quickstart in the README)
DEFAULT_EPOCHS = 10


class UsageError(Exception):
    pass


def _check_train_arg(arg: str) -> None:
    """A --train-arg FLAG=VALUE names a flag of `adamps train` with a value of its type: found
    before the cluster starts (it was found ~30 s later, when the trainers exited)."""
    flag, _, value = arg.partition("=")
    name = flag.replace("-", "_")
    fields = config.fields_of(TrainFlags)
    if name not in fields:
        raise UsageError(
            f"--train-arg {arg}: adamps train has no flag --{flag.replace('_', '-')} "
            "(see adamps train --help)"
        )
    try:
        config.convert(TrainFlags, name, fields[name][1], value, f"--train-arg {arg}")
    except config.ConfigError as exc:
        raise UsageError(str(exc)) from None


def _check_train_optimizer(args: list[str]) -> None:
    """The trainers' optimizer as the --train-args make it (over adamps train's defaults): a
    negative lr or an optimizer_args field the kind does not take is found before the cluster
    starts, not when every trainer exits 2 after it."""
    from adamps.optspec import OptimError, Optimizer, spec_of

    fields = config.fields_of(TrainFlags)
    given = dict(a.partition("=")[::2] for a in args)
    val: dict[str, Any] = {}
    for name in ("optimizer", "lr", "local_lr", "adagrad_initial", "optimizer_args"):
        raw = given.get(name, given.get(name.replace("_", "-")))
        f, tp = fields[name]
        val[name] = f.default if raw is None else config.convert(TrainFlags, name, tp, raw, "")
    for name in ("lr", "local_lr"):
        if not val[name] >= 0:
            raise UsageError(f"--train-arg {name}={val[name]}: must be >= 0 (as torch.optim)")
    try:
        extra = json.loads(val["optimizer_args"]) if val["optimizer_args"].strip() else {}
        if not isinstance(extra, dict):
            raise OptimError(f"optimizer_args must be a JSON object, got {val['optimizer_args']}")
        spec = spec_of(val["optimizer"], val["lr"], val["adagrad_initial"], extra)
        Optimizer.from_dict(spec).check_for_tensor()
    except (OptimError, ValueError) as exc:
        raise UsageError(f"--train-arg: the trainers' optimizer: {exc}") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="adamps up",
        description="Run the whole adamps cluster as local processes and train adam-mnist on the "
        "built-in data; print the held-out accuracy, the throughput and a plot.",
    )
    p.add_argument(
        "--controllers", type=int, default=3, help="controller nodes (Raft) (default: %(default)s)"
    )
    p.add_argument(
        "--servers", type=int, default=3, help="parameter servers (default: %(default)s)"
    )
    p.add_argument(
        "--dataservers",
        type=int,
        default=1,
        help="data servers (trainers fail over) (default: %(default)s)",
    )
    p.add_argument(
        "--trainers",
        type=int,
        default=2,
        help="trainer processes (model replicas) (default: %(default)s)",
    )
    p.add_argument(
        "--workers", type=int, default=1, help="Hogwild workers per trainer (default: %(default)s)"
    )
    p.add_argument(
        "--partitions",
        type=int,
        default=1,
        help="processes each replica is cut into (adamps train --partitions; model "
        "parallelism, docs/training.md) (default: %(default)s)",
    )
    p.add_argument(
        "--epochs", type=int, default=DEFAULT_EPOCHS, help="training epochs (default: %(default)s)"
    )
    p.add_argument(
        "--torch",
        default="",
        metavar="PKG.MODULE:FACTORY",
        help="train a PyTorch model (adamps train --torch; extra adamps[torch]), e.g. "
        "examples.torch_mnist:Net; the final state_dict goes to RUN_DIR/model.pt",
    )
    p.add_argument(
        "--train-arg",
        action="append",
        default=[],
        metavar="FLAG=VALUE",
        help="an adamps train flag for every trainer, e.g. --train-arg optimizer=sgd "
        "(repeatable; adamps train --help lists them)",
    )
    p.add_argument(
        "--buckets",
        type=int,
        default=64,
        help="buckets the shards are hashed into (default: %(default)s)",
    )
    p.add_argument(
        "--augment",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="let the data server augment the training images (shifts, rotations; default: off)",
    )
    p.add_argument(
        "--http-only",
        action="store_true",
        help="servers get no data port; trainers pull and push over HTTP only (default: over "
        "the servers' binary data ports)",
    )
    p.add_argument(
        "--tls",
        action="store_true",
        help="TLS on every port: generates a throwaway CA and certificate in RUN_DIR/tls and "
        "gives them to every process (docs/operations.md, Security)",
    )
    p.add_argument(
        "--compress",
        action="store_true",
        help="trainers push Strom's threshold-quantized updates with error feedback "
        "(adamps train --compress; docs/training.md)",
    )
    p.add_argument(
        "--compress-fraction",
        type=float,
        default=0.01,
        help="with --compress: fraction of each tensor's elements sent per push (adaptive "
        "tau; default: %(default)s)",
    )
    p.add_argument(
        "--compress-tau",
        default="",
        help="with --compress: fixed thresholds, TAU or TENSOR=TAU, comma separated "
        "(default: adaptive)",
    )
    p.add_argument(
        "--compress-coding",
        choices=("words", "rice"),
        default="rice",
        help="with --compress: 32-bit words or Golomb-Rice coded index gaps (default: %(default)s)",
    )
    p.add_argument(
        "--target-accuracy",
        type=float,
        default=None,
        help="held-out accuracy the run must reach for exit code 0 (0 disables the check; "
        "default: 0.96, with --algorithm sandblaster 0.95)",
    )
    p.add_argument("--run-dir", default="", help="run directory (default: ./runs/<UTC time>)")
    p.add_argument(
        "--port-base",
        type=int,
        default=0,
        help="first TCP port; every process takes the next free one (default 0: ports chosen by "
        "the kernel)",
    )
    p.add_argument(
        "--token",
        default="",
        help="cluster token (default: $ADAMPS_TOKEN, else a new random one); written to "
        "RUN_DIR/token (mode 0600), handed to the children in their environment",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=1800.0,
        help="give up after this many seconds (default: %(default)s)",
    )
    p.add_argument(
        "--stop-timeout",
        type=float,
        default=10.0,
        help="seconds between SIGTERM and SIGKILL, per stage (default: %(default)s)",
    )
    p.add_argument(
        "--progress-interval",
        type=float,
        default=0.0,
        help="seconds between progress lines (default 0: 1 s on a terminal, 5 s otherwise)",
    )
    p.add_argument("--no-progress", action="store_true", help="no live progress view")
    p.add_argument(
        "--algorithm",
        choices=("downpour", "sandblaster"),
        default="downpour",
        help="downpour: asynchronous SGD replicas; sandblaster: L-BFGS by a coordinator over "
        "the whole training set (DistBelief 4.2; docs/training.md) (default: %(default)s)",
    )
    p.add_argument(
        "--iterations",
        type=int,
        default=60,
        help="with --algorithm sandblaster: L-BFGS iterations (default: %(default)s)",
    )
    p.add_argument(
        "--detach",
        action="store_true",
        help="start the controllers, parameter servers and data servers (no trainers), write the "
        "cluster file $XDG_CONFIG_HOME/adamps/clusters/NAME.json (default ~/.config/...) and "
        "return, leaving them running for `adamps launch`, `adamps status` and the rest; "
        "`adamps down` stops them",
    )
    p.add_argument(
        "--name",
        default="local",
        help="with --detach: the cluster's name, for --cluster NAME or $ADAMPS_CLUSTER "
        "(default: %(default)s, which every command uses when given no cluster)",
    )
    return p


def check_args(a: argparse.Namespace) -> None:
    """Raises UsageError naming the flag, its value and what is expected."""

    def need(ok: bool, flag: str, value: Any, expected: str) -> None:
        if not ok:
            raise UsageError(f"{flag} {value}: expected {expected}")

    for flag, value in (
        ("--controllers", a.controllers),
        ("--servers", a.servers),
        ("--dataservers", a.dataservers or (1 if a.detach else 0)),  # --detach: none is fine
        ("--trainers", a.trainers),
        ("--workers", a.workers),
        ("--partitions", a.partitions),
        ("--epochs", a.epochs),
        ("--buckets", a.buckets),
    ):
        need(value >= 1, flag, value, "an integer >= 1")
    need(0.0 < a.compress_fraction <= 1.0, "--compress-fraction", a.compress_fraction,
         "a fraction in (0, 1]")  # fmt: skip
    if a.compress_tau:
        from adamps.compression.codec import parse_taus

        try:
            parse_taus(a.compress_tau.split(","))
        except ValueError as exc:
            raise UsageError(f"--compress-tau {a.compress_tau}: {exc}") from None
    if a.torch:
        need(re.fullmatch(r"[\w.]+:[\w.]+", a.torch) is not None, "--torch", a.torch,
             "PKG.MODULE:FACTORY, e.g. examples.torch_mnist:Net")  # fmt: skip
        need(a.algorithm == "downpour" and a.partitions == 1, "--torch", a.torch,
             "Downpour replicas: no --algorithm sandblaster, no --partitions")  # fmt: skip
    for arg in a.train_arg:
        need(re.fullmatch(r"[a-z][a-z0-9_-]*=.*", arg) is not None, "--train-arg", arg,
             "FLAG=VALUE, e.g. optimizer=sgd")  # fmt: skip
        _check_train_arg(arg)
    _check_train_optimizer(a.train_arg)
    if a.detach:
        from adamps.clusters import ClusterError, check_name

        try:
            check_name(a.name)
        except ClusterError as exc:
            raise UsageError(f"--name: {exc}") from None
    need(a.controllers <= 9, "--controllers", a.controllers, "at most 9 (3 or 5 are usual)")
    need(a.iterations >= 1, "--iterations", a.iterations, "an integer >= 1")
    if a.target_accuracy is None:  # Sandblaster's 60 full-batch iterations reach less
        a.target_accuracy = 0.95 if a.algorithm == "sandblaster" else 0.96
    need(0.0 <= a.target_accuracy <= 1.0, "--target-accuracy", a.target_accuracy,
         "a fraction in [0, 1], e.g. 0.96 (0 disables the check)")  # fmt: skip
    need(a.port_base == 0 or 1024 <= a.port_base <= 65000, "--port-base", a.port_base,
         "0 (any free ports) or a port in 1024..65000")  # fmt: skip
    need(a.timeout > 0, "--timeout", a.timeout, "seconds > 0")
    need(a.stop_timeout > 0, "--stop-timeout", a.stop_timeout, "seconds > 0")
    need(a.progress_interval >= 0, "--progress-interval", a.progress_interval, "seconds >= 0")
