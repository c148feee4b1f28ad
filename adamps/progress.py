"""The one progress display of adamps (`adamps up`, `adamps train`): a tqdm bar.

On a terminal it is tqdm's live line. Elsewhere (a log file, CI) a live line would be one
endless line of carriage returns, so the same bar is written as plain lines instead, at most
one every ``interval`` seconds (default 5 s, against 0.1 s on a terminal).
"""

from __future__ import annotations

import sys
from typing import Any, TextIO

from tqdm import tqdm

#: seconds between two lines when the output is not a terminal
LOG_INTERVAL = 5.0


class _Lines:
    """A stream for tqdm that turns each redraw ("\\r" + the bar + padding) into one line."""

    def __init__(self, out: TextIO) -> None:
        self.out = out

    def write(self, s: str) -> None:
        line = s.replace("\r", "").strip()
        if line:
            self.out.write(line + "\n")

    def flush(self) -> None:
        self.out.flush()


class Progress:
    """A progress bar of ``total`` ``unit`` (None: unknown) with a status text after it.
    ``update`` advances it; the bar is redrawn at most every ``interval`` seconds."""

    def __init__(
        self,
        desc: str,
        total: float | None = None,
        unit: str = "it",
        out: TextIO | None = None,
        interval: float = 0.0,
    ) -> None:
        out = sys.stderr if out is None else out
        self.tty = out.isatty()
        self.interval = interval or (0.1 if self.tty else LOG_INTERVAL)
        options: dict[str, Any] = {"file": out, "dynamic_ncols": True}
        if not self.tty:
            options = {"file": _Lines(out), "ascii": True}
        self.bar = tqdm(
            total=total, desc=desc, unit=unit, leave=True,
            # miniters=0: redraws are paced by time only (also on update(0), for a new status)
            mininterval=self.interval, miniters=0, **options,
        )  # fmt: skip

    def update(self, n: float = 0, status: str | None = None) -> None:
        """Adds ``n`` to the count and sets the status (shown at the next redraw)."""
        if status is not None:
            self.bar.set_postfix_str(status, refresh=False)
        self.bar.update(n)

    def set(self, n: float, status: str | None = None) -> None:
        """Sets the count to ``n``."""
        self.update(n - self.bar.n, status)

    def close(self) -> None:
        """Draws the last state once more and ends the line."""
        self.bar.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()
