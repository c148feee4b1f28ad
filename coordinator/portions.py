"""Which trainer computes which portion of a batch (DistBelief 4.2's load balancing). Pure: no
IO, no clock (``now`` is an argument), so every schedule can be tested exactly.

- A batch is cut into many more portions than there are trainers; a free trainer asks and gets
  the next one, so faster trainers do more.
- Data affinity: a trainer gets the portion after its last one when that is still free;
  otherwise the start of the second half of the longest free run, so that trainers spread over
  the batch and then each walks its own stretch in order.
- Backup tasks: once no portion is free, a trainer that asks gets a copy of an outstanding
  portion it does not hold (the one assigned longest ago, at most ``max_copies`` holders). The
  first result wins; the servers drop the other copies' gradients by portion id.
- A trainer that falls silent for ``trainer_timeout`` is lost: its outstanding portions are
  free again for others.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Portion:
    pid: int
    #: trainer -> when it was given this portion
    holders: dict[str, float] = field(default_factory=dict)
    #: the trainer whose result counted, once one did
    done_by: str | None = None


class Schedule:
    """The portions of one evaluation. Mutated only through its methods."""

    def __init__(self, n_portions: int, backup: bool = True, max_copies: int = 2) -> None:
        if n_portions < 1:
            raise ValueError("an evaluation needs at least one portion")
        self.portions = [Portion(i) for i in range(n_portions)]
        self.backup = backup
        self.max_copies = max_copies
        #: trainer -> the last portion it was given (affinity)
        self.last: dict[str, int] = {}
        #: trainer -> when it was last heard from
        self.seen: dict[str, float] = {}
        self.n_done = 0
        #: results that came after another copy's (dropped on the servers)
        self.duplicates = 0
        #: copies handed out as backup tasks
        self.backups = 0
        #: portions given back after their trainer was lost
        self.reassigned = 0

    @property
    def complete(self) -> bool:
        return self.n_done == len(self.portions)

    def _free(self, i: int) -> bool:
        p = self.portions[i]
        return p.done_by is None and not p.holders

    def _spread(self) -> int | None:
        """The start of the second half of the longest run of free portions."""
        best: tuple[int, int] | None = None  # (length, start)
        i, n = 0, len(self.portions)
        while i < n:
            if not self._free(i):
                i += 1
                continue
            j = i
            while j < n and self._free(j):
                j += 1
            if best is None or j - i > best[0]:
                best = (j - i, i)
            i = j
        if best is None:
            return None
        length, start = best
        # A run that starts right after a busy trainer's stretch is its to walk: take the
        # second half. A run at the start, or after finished work, is taken from its start.
        before = start - 1
        walked = (
            before >= 0 and self.portions[before].done_by is None and self.portions[before].holders
        )
        return start + length // 2 if walked and length > 1 else start

    def request(self, trainer: str, now: float) -> int | None:
        """The portion `trainer` should compute next, or None (nothing to do for now)."""
        self.seen[trainer] = now
        nxt = self.last.get(trainer, -2) + 1
        pid = nxt if 0 <= nxt < len(self.portions) and self._free(nxt) else self._spread()
        if pid is None and self.backup:
            candidates = [
                p
                for p in self.portions
                if p.done_by is None
                and p.holders
                and trainer not in p.holders
                and len(p.holders) < self.max_copies
            ]
            if candidates:
                pid = min(candidates, key=lambda p: (len(p.holders), min(p.holders.values()))).pid
                self.backups += 1
        if pid is None:
            return None
        self.portions[pid].holders[trainer] = now
        self.last[trainer] = pid
        return pid

    def report(self, trainer: str, pid: int, now: float) -> bool:
        """`trainer` pushed portion `pid`'s result; True if it is the first result."""
        self.seen[trainer] = now
        if not 0 <= pid < len(self.portions):
            return False
        p = self.portions[pid]
        p.holders.pop(trainer, None)
        if p.done_by is not None:
            self.duplicates += 1
            return False
        p.done_by = trainer
        p.holders.clear()  # other copies still running are backups: their pushes are dropped
        self.n_done += 1
        return True

    def heard(self, trainer: str, now: float) -> None:
        self.seen[trainer] = now

    def expire(self, now: float, trainer_timeout: float) -> list[str]:
        """Trainers silent for trainer_timeout are lost; their portions become free."""
        lost = [t for t, at in self.seen.items() if now - at > trainer_timeout]
        for t in lost:
            self.lose(t)
        return lost

    def lose(self, trainer: str) -> None:
        self.seen.pop(trainer, None)
        self.last.pop(trainer, None)
        for p in self.portions:
            if trainer in p.holders:
                del p.holders[trainer]
                if p.done_by is None and not p.holders:
                    self.reassigned += 1

    def outstanding(self) -> list[int]:
        return [p.pid for p in self.portions if p.done_by is None and p.holders]


def portion_bounds(n_examples: int, n_portions: int, pid: int) -> tuple[int, int]:
    """Examples [start, stop) of portion `pid`: contiguous, sizes differing by at most one."""
    return pid * n_examples // n_portions, (pid + 1) * n_examples // n_portions
