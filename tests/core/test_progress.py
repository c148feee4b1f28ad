"""The one progress display (adamps/progress.py): readable in a log, where a live line would be
one endless line of carriage returns."""

from __future__ import annotations

import io
import time

from adamps.progress import Progress


def test_not_a_terminal_gives_plain_lines_at_most_one_per_interval() -> None:
    out = io.StringIO()
    p = Progress("epoch 1/2", 1000, "img", out, interval=1.0)
    for _ in range(10):  # within a second of the first line: none more
        p.update(10, "loss=1.000")
    time.sleep(1.05)
    p.update(10, "loss=0.500")
    p.close()
    text = out.getvalue()
    assert "\r" not in text and "\x1b" not in text
    lines = text.splitlines()
    assert len(lines) == 3, lines  # the start, one after the interval, the end
    assert lines[0].startswith("epoch 1/2:   0%")
    assert "110/1000" in lines[1] and "loss=0.500" in lines[1]
    assert "110/1000" in lines[2]


def test_set_moves_the_count_to_a_value() -> None:
    out = io.StringIO()
    p = Progress("epochs complete", 10, "epoch", out, interval=0.001)
    p.set(3, "epoch 4/10")
    p.set(3)
    assert p.bar.n == 3
    p.close()
    assert "3/10" in out.getvalue().splitlines()[-1]
