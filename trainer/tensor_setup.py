"""What replica 0 of a Downpour run sets up on the cluster before it trains: the model's layout
at the controllers (its run's part only), and every tensor created on the servers with its
initial values (a warm start's, accumulators included: issue 24). trainer/downpour.py calls it."""

from __future__ import annotations

import logging
import time
from typing import Any

from adamps.layout import Layout, TensorSpec
from adamps.optspec import Optimizer
from trainer.config import TrainConfig
from trainer.model import Model

log = logging.getLogger(__name__)


def controller_layout(cfg: TrainConfig, tensors: list[TensorSpec], ctl: Any) -> Layout:
    """Replica 0 stores the model's layout at the controllers; the others read it there, so
    every replica derives the same shards and buckets."""
    want = {t.name: t.shape for t in tensors}
    deadline = time.monotonic() + cfg.wait_timeout
    while True:
        if cfg.replica == 0:
            n_buckets = int(ctl.routing()["n_buckets"])
            layout = Layout(tensors, n_buckets)
            # With --run, only the run's part: the other runs' tensors stay in the layout
            # (with the cluster token the whole layout was replaced, erasing theirs).
            ctl.set_layout(layout.to_dict(), run=cfg.run or None)
            return layout
        got = ctl.layout()
        if got is not None:
            layout = Layout.from_dict(got["layout"])
            # The cluster's layout holds every run's tensors: this run's part must match.
            ns = f"{cfg.run}.." if cfg.run else ""
            have = {n: t.shape for n, t in layout.tensors.items() if n.startswith(ns)}
            if have == want:
                return Layout(tensors, layout.n_buckets, layout.max_shard_elems)
        if time.monotonic() > deadline:
            raise TimeoutError("no layout of this model at the controllers (is replica 0 up?)")
        time.sleep(0.2)


def create_tensors(cfg: TrainConfig, spec: Any, tensors: list[TensorSpec], client: Any) -> None:
    """Defines every tensor with its initial values (the seed's, or a warm start's) and the
    optimizer."""
    init = Model(spec)
    init.init_params(cfg.seed)
    accums: dict[str, Any] = {}
    if cfg.init:  # warm start (issue 24): checked whole before the first create
        from trainer.warm import initial_state

        warm, accums = initial_state(cfg.init, {t.name: t.shape for t in tensors})
        for name, values in warm.items():
            init.param(name)[...] = values
    optimizer = cfg.optimizer_spec()
    for t in tensors:
        client.create(t, init={"kind": "values", "values": init.param(t.name)}, optimizer=optimizer)
    if accums and Optimizer.from_dict(optimizer).has_accumulator:
        install_accumulators(cfg, client, init, accums, optimizer)


def install_accumulators(
    cfg: TrainConfig, client: Any, init: Model, accums: dict[str, Any], optimizer: dict[str, Any]
) -> None:
    """The checkpoint's optimizer state (Adagrad's accumulators, Adam's moments...), installed
    (with the same values) through the servers' one write path: the run goes on from the
    checkpoint's learning rates, not from fresh state (issue 24). A tensor whose saved state is
    another optimizer's (its size differs) starts from fresh state, logged."""
    from adamps.checkpoint.save_restore import Cluster, install

    opt = Optimizer.from_dict(optimizer)
    fits = {}
    for n, a in accums.items():
        want = sum(opt.state_size(s.size) for s in client.layout.shards_of[n])
        if a.size == want:
            fits[n] = a
        else:
            log.warning("warm start: %s's saved optimizer state (%d elements) is not %s's (%d): "
                        "its %s state starts fresh", n, a.size, opt.kind, want, opt.kind)  # fmt: skip
    accums = fits
    if not accums:
        return
    arrays = {n: init.param(n) for n in accums}
    arrays.update({f"{n}/accum": a for n, a in accums.items()})
    defs = [{"name": n, "optimizer": optimizer} for n in accums]
    cluster = Cluster(list(cfg.controllers), cfg.token, source=client.source)
    try:
        n = install(cluster, client.layout, defs, arrays)
    finally:
        cluster.close()
    log.info("warm start: optimizer state of %d tensors (%d shards) from %s",
             len(accums), n, cfg.init)  # fmt: skip
