"""The picture of a training run: training loss and held-out accuracy over time (PNG), or per
L-BFGS iteration for a Sandblaster run.

Used by `adamps up` at the end of a run. Uses matplotlib's object API with the Agg canvas (no
pyplot, no display, no global state), so it works on a headless machine and inside tests.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any


def _matplotlib() -> tuple[Any, Any]:
    """(FigureCanvasAgg, Figure), or MissingExtra naming the extra (adamps[demo])."""
    from adamps.extras import require

    agg = require("matplotlib.backends.backend_agg", "the plot of adamps up")
    return agg.FigureCanvasAgg, require("matplotlib.figure", "the plot of adamps up").Figure


def plot_run(
    path: str | Path,
    history: Sequence[dict[str, Any]],
    samples: Sequence[dict[str, Any]],
    *,
    t0: float,
    title: str = "",
    target: float = 0.0,
) -> Path:
    """Writes the run's plot to `path` and returns it.

    history: replica 0's per-epoch records ({time, epoch, loss, accuracy, images_per_s}, time in
    seconds since the epoch); samples: the progress view's periodic readings ({time, loss:
    {replica: value}, images_per_s}); t0: the run's start (time.time()), the x axis' zero;
    target: the accuracy the run must reach (a dashed line; 0 = none).
    """
    FigureCanvasAgg, Figure = _matplotlib()

    fig = Figure(figsize=(8, 6.5), dpi=100)
    FigureCanvasAgg(fig)
    ax_loss, ax_acc = fig.subplots(2, 1, sharex=True)

    replicas = sorted({r for s in samples for r in (s.get("loss") or {})}, key=int)
    for r in replicas:
        pts = [(s["time"] - t0, s["loss"][r]) for s in samples if s.get("loss", {}).get(r)]
        if pts:
            xs, ys = zip(*pts, strict=True)
            ax_loss.plot(xs, ys, lw=1, alpha=0.7, label=f"replica {r} (recent rounds)")
    if history:
        ax_loss.plot(
            [h["time"] - t0 for h in history],
            [h["loss"] for h in history],
            "o-",
            color="black",
            lw=1.5,
            label="epoch mean (replica 0)",
        )
    ax_loss.set_ylabel("training loss")
    ax_loss.set_yscale("log")
    ax_loss.grid(True, which="both", alpha=0.3)
    _legend(ax_loss, "upper right")

    if history:
        xs = [h["time"] - t0 for h in history]
        ys = [100 * h["accuracy"] for h in history]
        ax_acc.plot(xs, ys, "o-", color="tab:green", label="held-out accuracy (server weights)")
        ax_acc.set_title(
            f"held-out accuracy {ys[-1]:.1f}% after epoch {history[-1]['epoch']}",
            fontsize="small",
        )
        low = min(ys + ([100 * target] if target > 0 else []))
        ax_acc.set_ylim(max(0.0, min(low - 2, 90.0)), 100.5)
    if target > 0:
        ax_acc.axhline(100 * target, ls="--", color="gray", lw=1, label=f"target {100 * target:g}%")
    ax_acc.set_ylabel("held-out accuracy (%)")
    ax_acc.set_xlabel("seconds since the trainers started")
    ax_acc.grid(True, alpha=0.3)
    _legend(ax_acc, "lower right")
    if title:
        fig.suptitle(title, fontsize="medium")
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out)
    return out


def _legend(ax: Any, loc: str) -> None:
    """A legend only over labelled lines: an empty one makes matplotlib warn ("No artists with
    labels found"), which `adamps up` printed to the terminal."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc=loc, fontsize="small")


def iteration_figure(
    records: Sequence[dict[str, Any]], *, title: str = "", target: float = 0.0
) -> Any:
    """The figure of a Sandblaster run: training loss f and held-out accuracy per L-BFGS
    iteration (records: the coordinator's history lines {iteration, loss, heldout_accuracy};
    see coordinator/heldout.py). Returned unsaved, so that tests read the plotted data."""
    FigureCanvasAgg, Figure = _matplotlib()

    fig = Figure(figsize=(8, 6.5), dpi=100)
    FigureCanvasAgg(fig)
    ax_loss, ax_acc = fig.subplots(2, 1, sharex=True)
    losses = [(r["iteration"], r["loss"]) for r in records if r.get("loss") is not None]
    if losses:
        xs, ys = zip(*losses, strict=True)
        ax_loss.plot(
            xs, ys, "o-", color="black", lw=1.5, ms=3, label="training loss f (all training images)"
        )
        if min(ys) > 0:
            ax_loss.set_yscale("log")
    ax_loss.set_ylabel("training loss")
    ax_loss.grid(True, which="both", alpha=0.3)
    _legend(ax_loss, "upper right")
    accs = [
        (r["iteration"], 100 * r["heldout_accuracy"])
        for r in records
        if r.get("heldout_accuracy") is not None
    ]
    if accs:
        xs, ys = zip(*accs, strict=True)
        ax_acc.plot(xs, ys, "o-", color="tab:green", ms=3, label="held-out accuracy (iterate)")
        ax_acc.set_title(
            f"held-out accuracy {ys[-1]:.1f}% after iteration {xs[-1]}", fontsize="small"
        )
        low = min(list(ys) + ([100 * target] if target > 0 else []))
        ax_acc.set_ylim(max(0.0, min(low - 2, 90.0)), 100.5)
    if target > 0:
        ax_acc.axhline(100 * target, ls="--", color="gray", lw=1, label=f"target {100 * target:g}%")
    ax_acc.set_ylabel("held-out accuracy (%)")
    ax_acc.set_xlabel("L-BFGS iteration")
    ax_acc.grid(True, alpha=0.3)
    _legend(ax_acc, "lower right")
    if title:
        fig.suptitle(title, fontsize="medium")
    fig.tight_layout()
    return fig


def plot_iterations(
    path: str | Path,
    records: Sequence[dict[str, Any]],
    *,
    title: str = "",
    target: float = 0.0,
) -> Path:
    """Writes `iteration_figure` to `path` and returns it."""
    out = Path(path)
    iteration_figure(records, title=title, target=target).savefig(out)
    return out
