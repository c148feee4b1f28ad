"""A server's write hold for a consistent checkpoint's cut (issue 24): pure, the clock passed in.

``adamps checkpoint save --consistent`` holds every server's new writes for the moment of the
cut: a push that arrives while held is refused before anything is queued (``503 held``, which
clients retry), and the pushes admitted before the hold are counted until they are decided, so
the cut waits for them. A push is then in every bucket's cut or in none. The hold ends when
released, or by itself at its expiry: a save tool that dies never wedges the cluster."""

from __future__ import annotations


class WriteHold:
    """Mutated by the event-loop thread only."""

    def __init__(self) -> None:
        #: monotonic time the hold expires, or None: writes flow
        self.until: float | None = None
        #: the id of the cut that holds
        self.cut: str | None = None
        #: pushes admitted and not yet decided
        self.inflight = 0

    def refusal(self, now: float) -> str | None:
        """Why a new write is refused now (the hold and its cut), or None."""
        if self.until is None:
            return None
        if now >= self.until:
            self.until = self.cut = None
            return None
        return f"writes are held for the cut {self.cut} of a consistent checkpoint"

    def hold(self, cut: str, now: float, seconds: float) -> None:
        self.cut, self.until = cut, now + seconds

    def release(self, cut: str) -> bool:
        """Ends the hold of `cut` (False if another cut or none holds)."""
        if self.cut != cut:
            return False
        self.until = self.cut = None
        return True

    def admitted(self) -> None:
        self.inflight += 1

    def decided(self) -> None:
        self.inflight -= 1
