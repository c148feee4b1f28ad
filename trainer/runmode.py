"""The consistency mode a trainer declares (issue 25): the one it is given (``--consistency``),
else the one in its run's record on the controllers (``adamps run create NAME --consistency``),
else ``async``. A run's replicas then agree without each being given the same flag, and a
replica given a mode other than the record's is refused before it trains (the servers would
refuse it anyway once a replica of the run reported, with 409; this says it at start-up, with
the record named)."""

from __future__ import annotations

from typing import Any

from adamps.core.stepclock import parse_mode
from trainer.config import TrainConfig


class ModeError(ValueError):
    """The given mode differs from the run's record (the message names both)."""


def decide(given: str, recorded: str | None, run: str) -> str:
    """The mode to declare: pure, so that its rule is tested as it is."""
    if not given:
        return recorded or "async"
    if recorded and parse_mode(recorded) != parse_mode(given):
        raise ModeError(
            f"--consistency {given} differs from run {run!r}'s mode ({recorded}, recorded when "
            f"the run was created): give {recorded} or nothing (a run's mode is chosen at "
            f"`adamps run create {run} --consistency MODE`, async by default)"
        )
    return given


def resolve(cfg: TrainConfig) -> TrainConfig:
    """`cfg` with its consistency decided (a run's record is read only with controllers: a
    static cluster (--ps) has no run records)."""
    recorded = None
    if cfg.run and cfg.controllers:
        from adamps.client.controller import ControllerClient

        ctl = ControllerClient(cfg.controllers, cfg.token, retry_for=cfg.wait_timeout)
        try:
            view: Any = ctl.run(cfg.run)  # None: no record (a run name used without create)
        finally:
            ctl.close()
        recorded = (view or {}).get("consistency")
    # Set in place: a new TrainConfig would run __post_init__ again, which is not idempotent
    # (an elastic replica's -1 becomes replica 0 there).
    cfg.consistency = decide(cfg.consistency, recorded, cfg.run)
    cfg.check_mode()
    return cfg
