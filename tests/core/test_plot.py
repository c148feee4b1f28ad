"""The run's plot (adamps/up/plot.py), read back from the figure's lines: issue 26's Sandblaster
plot was empty, titled in epochs, and printed matplotlib's "No artists with labels found"
warning (pytest turns warnings into errors here)."""

from __future__ import annotations

from pathlib import Path

from adamps.up.plot import iteration_figure, plot_iterations, plot_run


def records(n: int) -> list[dict]:
    return [
        {"time": 100.0 + k, "iteration": k, "loss": 2.0 / k, "heldout_accuracy": 0.5 + k / 200}
        for k in range(1, n + 1)
    ]


def test_the_sandblaster_figure_plots_loss_and_accuracy_per_iteration() -> None:
    fig = iteration_figure(records(60), title="60 L-BFGS iterations", target=0.9)
    ax_loss, ax_acc = fig.axes
    (loss,) = ax_loss.get_lines()
    assert list(loss.get_xdata()) == list(range(1, 61))
    assert list(loss.get_ydata()) == [2.0 / k for k in range(1, 61)]
    acc, target = ax_acc.get_lines()
    assert list(acc.get_xdata()) == list(range(1, 61))
    assert list(acc.get_ydata()) == [100 * (0.5 + k / 200) for k in range(1, 61)]
    assert list(target.get_ydata()) == [90.0, 90.0]
    assert ax_acc.get_xlabel() == "L-BFGS iteration"
    assert fig.get_suptitle() == "60 L-BFGS iterations"
    assert "after iteration 60" in ax_acc.get_title()


def test_a_record_without_accuracy_plots_its_loss_only(tmp_path: Path) -> None:
    recs = records(3)
    recs[1]["heldout_accuracy"] = None  # not measured (a server unreachable then)
    fig = iteration_figure(recs)
    assert len(fig.axes[0].get_lines()[0].get_xdata()) == 3
    assert list(fig.axes[1].get_lines()[0].get_xdata()) == [1, 3]
    assert plot_iterations(tmp_path / "p.png", recs).stat().st_size > 0


def test_empty_runs_draw_without_a_legend_warning(tmp_path: Path) -> None:
    """No data (a run that failed early): the axes are drawn, no warning is printed."""
    assert plot_iterations(tmp_path / "a.png", []).exists()
    assert plot_run(tmp_path / "b.png", [], [], t0=0.0).exists()
