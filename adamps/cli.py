"""The `adamps` console script: one subcommand per role, each dispatched to its own module.

Every role module exposes ``main(argv: list[str]) -> int`` and owns its flags, so that the same
code runs in a local process, a container and a Kubernetes pod.
"""

from __future__ import annotations

import importlib
import sys

#: subcommand -> (module with main(argv), or "module:function", one-line description)
COMMANDS: dict[str, tuple[str, str]] = {
    "up": ("adamps.up.main", "run the whole cluster as local processes and train adam-mnist"),
    "down": ("adamps.up.detach:down_main", "stop a cluster started by `adamps up --detach`"),
    "launch": (
        "adamps.up.launch",
        "start N replicas of a training script against a cluster (RANK, WORLD_SIZE, as torchrun)",
    ),
    "ps": ("adamps.server.main", "run a parameter server"),
    "controller": ("controller.main", "run one controller node (Raft)"),
    "status": ("controller.status", "print the cluster's servers, buckets, leases and progress"),
    "drain": ("controller.drain_cmd", "take a parameter server out of service (its copies move)"),
    "undrain": (
        "controller.drain_cmd:undrain_main",
        "return a drained parameter server to service",
    ),
    "run": (
        "controller.run_cmd",
        "create, list, show or delete training runs (namespace, token, quotas)",
    ),
    "dataserver": ("dataserver.main", "run a data server"),
    "train": ("trainer.main", "run one model replica (trainer)"),
    "checkpoint": (
        "adamps.checkpoint.save_restore",
        "save a running cluster's state, or restore it",
    ),
    "export": (
        "adamps.checkpoint.export",
        "write a checkpoint's or a cluster's values as npz or safetensors",
    ),
    "table": (
        "adamps.checkpoint.table_load",
        "load an embedding table's rows from .npy, .safetensors or a checkpoint",
    ),
    "coordinator": ("coordinator.main", "run the Sandblaster L-BFGS coordinator"),
}

USAGE = (
    "usage: adamps COMMAND [options]   (adamps COMMAND --help for its options)\n\ncommands:\n"
    + "\n".join(f"  {name:<11} {desc}" for name, (_mod, desc) in COMMANDS.items())
)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:  # a command is required: a usage error, as argparse's
        print(USAGE, file=sys.stderr)
        return 2
    if argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    if argv[0] in ("-V", "--version"):
        from adamps import __version__

        print(f"adamps {__version__}")
        return 0
    from adamps.up.procs import die_with_parent

    die_with_parent()
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(
            f"adamps: unknown command {command!r}; expected one of: {', '.join(COMMANDS)}",
            file=sys.stderr,
        )
        return 2
    module_name, _, func = COMMANDS[command][0].partition(":")
    try:
        module = importlib.import_module(module_name)
        return int(getattr(module, func or "main")(rest) or 0)
    except KeyboardInterrupt:
        # Ctrl-C in a command that does not handle it itself (a client command waiting on a
        # server, a save or a load under way): one line, not a traceback, and the shell's
        # code for SIGINT. What the command wrote stays as its failure leaves it (a save
        # removes the directory it made; docs/operations.md).
        print(f"\nadamps {command}: interrupted (Ctrl-C)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
