"""When a controller's Raft thread has something to do (issue 36: idle costs nothing).

pysyncobj's tick thread runs one tick, then waits in ``poll`` for a message, a command (its pipe)
or ``autoTickPeriod``, whichever comes first. A fixed period makes every node tick every 50 ms
for nothing; `tick_wait` instead sleeps until the next of this node's own deadlines:

- a leader: its next append (Raft's heartbeats, every ``appendEntriesPeriod``);
- a follower or a candidate: its election deadline (each append from the leader pushes it on,
  and wakes the thread anyway);
- at most ``longest``: what pysyncobj does once per tick besides (reconnecting to a partner
  every ``connectionRetryTime``, its once-a-second journal meta write, log compaction) keeps
  about its period.

Every message and every command still wakes the thread at once: waiting longer delays nothing
but the timers, which it waits for.

The heartbeats' period is derived from the election timeout (`append_period`), not tuned on its
own: a follower starts an election only after missing three of them in a row.
"""

from __future__ import annotations

#: heartbeats per shortest election timeout (pysyncobj requires more than 3; etcd/raft's
#: defaults are 10, for WANs; on a LAN, 4 tolerates three lost or late ones in a row)
APPENDS_PER_ELECTION = 4


def append_period(election_min: float) -> float:
    """The leader's append period (Raft's heartbeat) for a shortest election timeout."""
    if election_min <= 0:
        raise ValueError(f"election_min must be > 0, not {election_min}")
    return election_min / APPENDS_PER_ELECTION


def tick_wait(
    now: float,
    *,
    leader: bool,
    next_append: float,
    period: float,
    election_deadline: float,
    election_min: float,
    longest: float,
) -> float:
    """Seconds the tick thread may wait after the tick that starts at `now` (pysyncobj's
    ``_onTick``, which ends in that wait): until the next deadline of this node, at most
    `longest`, never negative.

    The wait is computed before the tick runs, so a deadline already due is one this tick
    serves: a leader's append due now is sent by it, the next one is `period` later; a
    follower's election deadline due now starts an election in it, whose own deadline is at
    least `election_min` later."""
    if leader:
        due = next_append if next_append > now else now + period
    else:
        due = election_deadline if election_deadline > now else now + election_min
    return max(0.0, min(due - now, longest))
