"""The start-up every role shares (`adamps controller|ps|dataserver|train`): its argument parser
from its configuration dataclass, the configuration itself (flags > environment > TOML >
defaults), and logging. A bad value stops the process with a message naming it and exit code 2."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from adamps import config
from adamps.security import tls
from adamps.wire import logs

C = TypeVar("C")


def role_parser(prog: str, description: str, cls: type) -> argparse.ArgumentParser:
    """The parser of `adamps <role>`: one flag per field of the role's configuration."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    config.add_arguments(parser, cls)
    tls.add_arguments(parser)
    return parser


def run_role(
    parser: argparse.ArgumentParser,
    cls: type[C],
    section: str,
    argv: Sequence[str] | None,
    serve: Callable[[C], int],
    log_name: Callable[[C], str] | None = None,
) -> int:
    """Parses `argv`, loads the `[section]` configuration, sets up logging (named `log_name(cfg)`,
    default the section), then runs `serve(cfg)` and returns its exit code."""
    args = parser.parse_args(sys.argv[1:] if argv is None else list(argv))
    try:
        cfg: Any = config.load(cls, section, args)
        # one [tls] table for every role: this process's listeners and its clients alike
        tls.install(tls.load(args))
        if tls.enabled():  # every role listens (at least /healthz): it needs its certificate
            tls.server_context()
    except config.ConfigError as exc:
        print(f"{parser.prog}: {exc}", file=sys.stderr)
        return 2
    logs.setup_logging(cfg.log_level, log_name(cfg) if log_name else section)
    try:
        return serve(cfg)
    except OSError as exc:
        # a directory or address the role cannot use (a data dir it cannot create, a port in
        # use): one line naming it, not a traceback; the traceback at debug level
        log = logging.getLogger(section)
        log.error("%s cannot run: %s", parser.prog, exc)
        log.debug("the error", exc_info=True)
        return 1
