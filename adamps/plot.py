"""The picture of a training run: training loss and held-out accuracy over time (PNG).

Used by `adamps up` at the end of a run. Uses matplotlib's object API with the Agg canvas (no
pyplot, no display, no global state), so it works on a headless machine and inside tests.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any


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
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

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
    ax_loss.legend(loc="upper right", fontsize="small")

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
    ax_acc.legend(loc="lower right", fontsize="small")
    if title:
        fig.suptitle(title, fontsize="medium")
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out)
    return out
