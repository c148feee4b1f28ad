"""Configuration: one dataclass per role, filled from TOML, environment and command line.

Precedence, highest first: command-line flags, environment variables ``ADAMPS_<SECTION>_<FIELD>``
(and ``ADAMPS_TOKEN`` for every field named ``token``), the ``[section]`` table of a TOML file,
the dataclass defaults (which run a local cluster on loopback).

Every field carries its help text in its metadata (``field(default, help=...)``): the same text is
the ``--help`` of the flag and the documentation of the field.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import tomllib
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


class ConfigError(ValueError):
    """A bad configuration value: the message names the value, its source and what is expected."""


def field(
    default: Any,
    help: str,  # noqa: A002 - mirrors argparse
    flags: tuple[str, ...] = (),
    minimum: float = 0,
    **kwargs: Any,
) -> Any:
    """A dataclass field with its help text. Mutable defaults (lists) are copied per instance.
    `flags`: its command-line flags when not only ``--field-name`` (the first one is shown).
    `minimum`: the least value a number takes (0 unless the field gives a meaning to less,
    as -1 for "not given" or "off")."""
    meta: dict[str, Any] = {"help": help, **({"flags": flags} if flags else {})}
    if minimum != 0:
        meta["minimum"] = minimum
    if isinstance(default, list | dict):
        return dataclasses.field(
            default_factory=lambda: type(default)(default), metadata=meta, **kwargs
        )
    return dataclasses.field(default=default, metadata=meta, **kwargs)


def default_token() -> str:
    """$ADAMPS_TOKEN or empty; an empty token is resolved by :func:`adamps.security.token.resolve`."""
    return os.environ.get("ADAMPS_TOKEN", "")


def _base_type(tp: Any) -> Any:
    """The non-None type of `X | None`; the origin of `list[X]` stays a list."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _base_type(args[0]) if len(args) == 1 else str
    return tp


def _minimum(cls: type, name: str) -> float:
    """The least value field `name` of `cls` takes: its ``minimum``, else 0. A count, size,
    port, interval or timeout below 0 means nothing: a negative one stopped a role later with a
    traceback (``bind(): port must be 0-65535``, ``negative dimensions are not allowed``) or,
    worse, ran (limits that refuse everything)."""
    f = (
        {f.name: f for f in dataclasses.fields(cls)}.get(name)
        if dataclasses.is_dataclass(cls)
        else None
    )
    return f.metadata.get("minimum", 0) if f is not None else 0


def _convert(cls: type, name: str, tp: Any, raw: Any, source: str) -> Any:
    tp = _base_type(tp)
    origin = typing.get_origin(tp)
    try:
        if origin is list:
            (item_tp,) = typing.get_args(tp) or (str,)
            if isinstance(raw, str):
                raw = [x.strip() for x in raw.split(",") if x.strip()]
            if not isinstance(raw, list):
                raise TypeError("a list")
            return [_convert(cls, name, item_tp, x, source) for x in raw]
        if tp is bool:
            if isinstance(raw, bool):
                return raw
            s = str(raw).strip().lower()
            if s in ("1", "true", "yes", "on"):
                return True
            if s in ("0", "false", "no", "off"):
                return False
            raise TypeError("true or false")
        if tp is int:
            if isinstance(raw, bool) or (isinstance(raw, float) and not raw.is_integer()):
                raise TypeError("an integer")
            value = int(raw)
            low = _minimum(cls, name)
            if name == "port" or name.endswith("_port"):
                if not low <= value <= 65535:
                    off = "; -1: off" if low == -1 else ""
                    raise TypeError(f"a port number in 0..65535 (0: any free one{off})")
            elif value < low:
                raise TypeError(f"an integer >= {low:g}")
            return value
        if tp is float:
            if isinstance(raw, bool):
                raise TypeError("a number")
            value = float(raw)
            # NaN passes every `x <= 0` check after it (a flush_interval of NaN ran), and
            # an infinite interval or timeout never ends
            if not math.isfinite(value):
                raise TypeError("a finite number")
            if value < _minimum(cls, name):
                raise TypeError(f"a number >= {_minimum(cls, name):g}")
            return value
        if tp is str:
            if not isinstance(raw, str | int | float):
                raise TypeError("a string")
            return str(raw)
        return raw
    except (TypeError, ValueError) as exc:
        expected = (
            exc.args[0]
            if isinstance(exc, TypeError) and exc.args
            else getattr(tp, "__name__", str(tp))
        )
        raise ConfigError(
            f"{cls.__name__}.{name} from {source}: bad value {raw!r}; expected {expected}"
        ) from None


def _fields(cls: type) -> dict[str, tuple[dataclasses.Field, Any]]:
    hints = typing.get_type_hints(cls)
    return {f.name: (f, hints[f.name]) for f in dataclasses.fields(cls)}


#: a role's fields (name -> (field, type)) and one value's conversion, as `load` does them
fields_of = _fields


def convert(cls: type, name: str, tp: Any, raw: Any, source: str) -> Any:
    return _convert(cls, name, tp, raw, source)


def add_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """One `--field-name` flag per field of config dataclass `cls` (default None = not given)."""
    parser.add_argument("--config", metavar="FILE", help="TOML file with a table per role")
    for name, (f, tp) in _fields(cls).items():
        flags = tuple(f.metadata.get("flags", ())) or ("--" + name.replace("_", "-"),)
        help_text = f.metadata.get("help", "")
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        if name == "token":
            help_text += (
                " (default: $ADAMPS_TOKEN; none: refused unless listening on loopback only, then "
                "this user's local token file)"
            )
        else:
            help_text += f" (default: {default!r})"
        # argparse treats help as a %-template: a literal '%' in a field's text (or a default
        # such as "75%") would crash `--help`, so every help string is escaped here, once.
        help_text = help_text.replace("%", "%%")
        if _base_type(tp) is bool:
            parser.add_argument(
                *flags, dest=name, default=None, action=argparse.BooleanOptionalAction,
                help=help_text,
            )  # fmt: skip
        else:
            parser.add_argument(
                *flags, dest=name, default=None, metavar=name.upper(), help=help_text
            )


def load(
    cls: type[T],
    section: str,
    args: argparse.Namespace | Mapping[str, Any] | None = None,
    path: str | os.PathLike[str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> T:
    """An instance of config dataclass `cls` from defaults < TOML [section] < env < flags."""
    environ = os.environ if environ is None else environ
    given = vars(args) if isinstance(args, argparse.Namespace) else dict(args or {})
    path = path or given.get("config")
    table: Mapping[str, Any] = {}
    if path:
        try:
            with open(path, "rb") as fh:
                doc = tomllib.load(fh)
        except OSError as exc:
            raise ConfigError(f"config file {path}: {exc.strerror}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path}: not valid TOML: {exc}") from None
        table = doc.get(section, {})
        if not isinstance(table, dict):
            raise ConfigError(f"config file {path}: [{section}] must be a table")
    fields = _fields(cls)
    unknown = set(table) - set(fields)
    if unknown:
        raise ConfigError(
            f"config file {path}: unknown key(s) {sorted(unknown)} in [{section}]; expected some of {sorted(fields)}"
        )
    values: dict[str, Any] = {}
    for name, (_f, tp) in fields.items():
        if name in table:
            values[name] = _convert(cls, name, tp, table[name], f"{path} [{section}]")
        env_names = [f"ADAMPS_{section.upper()}_{name.upper()}"]
        if name in ("token", "peer_token", "rack"):  # one value per machine, not per role
            env_names.append(f"ADAMPS_{name.upper()}")
        for env_name in env_names:
            if env_name in environ:
                values[name] = _convert(cls, name, tp, environ[env_name], f"${env_name}")
                break
        if given.get(name) is not None:
            values[name] = _convert(cls, name, tp, given[name], "--" + name.replace("_", "-"))
    try:
        return cls(**values)
    except ConfigError:
        raise
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{cls.__name__}: {exc}") from None


def to_dict(cfg: Any) -> dict[str, Any]:
    """The config as plain data (for /status), with the secrets redacted."""
    d = dataclasses.asdict(cfg)
    for secret in ("token", "peer_token", "server_key", "raft_password"):  # /status is open
        if d.get(secret):
            d[secret] = "***"
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in d.items()}
