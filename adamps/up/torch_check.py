"""`adamps up --torch`'s check before anything starts: the factory imported and called, and one
batch run forward and backward in this process (adamps.torch.data.preflight). A factory that
cannot be imported, or a model whose output does not fit the labels, is one line and exit 2,
with no process started and no run directory made."""

from __future__ import annotations

import argparse
from pathlib import Path

from adamps import config
from adamps.up.flags import UsageError
from adamps.up.train_flags import TrainFlags


def check_torch(a: argparse.Namespace) -> bool:
    """True when the factory's Task brings its own data sets (no data server is started).
    Sets ``a.source`` and ``a.source_args``: what the data servers serve (the Task's source, a
    click log's path made absolute)."""
    fields = config.fields_of(TrainFlags)
    given = dict(arg.partition("=")[::2] for arg in a.train_arg)
    given = {k.replace("-", "_"): v for k, v in given.items()}

    def value(name: str) -> int:
        if name in given:
            return int(config.convert(TrainFlags, name, fields[name][1], given[name], name))
        return int(getattr(TrainFlags, name))

    try:
        from adamps.torch.data import preflight
        from adamps.torch.params import ModelError
    except ImportError as exc:
        raise UsageError(
            f"--torch {a.torch}: needs PyTorch: pip install 'adamps[torch]' ({exc})"
        ) from None
    try:
        task = preflight(a.torch, value("seed"), value("batch_size"))
    except ModelError as exc:  # its message names --torch and the problem
        raise UsageError(str(exc)) from None
    kind, _, arg = task.source.partition(":")
    a.source = f"{kind}:{Path(arg).resolve()}" if arg else kind
    a.source_args = list(task.source_args)
    return task.own_data
