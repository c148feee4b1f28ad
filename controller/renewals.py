"""Lease renewal rounds on the leader (issue 40): the renewals of every heartbeat that arrived
while the previous round was committing go into one Raft entry (`x_renew_round`), not one
entry per heartbeat. A group commit: the first heartbeat of an idle leader proposes at once,
alone; those arriving meanwhile wait for that commit and then share the next entry.

Lease safety (adamps/core/lease.py): a round's entry is proposed after every heartbeat it
renews arrived, with the leader's clock read then, so no holder's `asked_at` is later than the
`renewed_at` recorded for it. A heartbeat never joins a round already proposed.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from controller.raft_node import RaftNode


class RenewalRounds:
    """The leader's pending renewals and the one round in flight. Event-loop thread only."""

    def __init__(self, raft: RaftNode) -> None:
        self.raft = raft
        #: server id -> the heartbeats of it waiting for the next round
        self._waiting: dict[str, list[asyncio.Future]] = {}
        self._task: asyncio.Task | None = None

    async def renew(self, sid: str) -> dict[str, Any]:
        """Renews `sid`'s leases in the next round; its answer as `renew` gives it (`renewed`,
        `at`, or a refusal)."""
        fut = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(sid, []).append(fut)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._rounds(), name="renewal-rounds")
        return await fut

    async def _rounds(self) -> None:
        while self._waiting:
            batch, self._waiting = self._waiting, {}
            try:
                # The clock is read now: after every heartbeat of this round arrived.
                # Its entry rides the next Raft heartbeat (controller/raft_riding.py): no
                # append of its own, at most one append period later.
                res = await self.raft.commit("x_renew_round", sorted(batch), time.time(), ride=True)
            except Exception as exc:  # every waiter gets the error (no quorum, not leader)
                for futs in batch.values():
                    for f in futs:
                        if not f.done():
                            f.set_exception(exc)
                continue
            for sid, futs in batch.items():
                answer = round_answer(res, sid)
                for f in futs:
                    if not f.done():
                        f.set_result(answer)


def round_answer(res: dict[str, Any], sid: str) -> dict[str, Any]:
    """Server `sid`'s answer from its round's result: its own, or the round's refusal."""
    servers = res.get("servers", {}) if res.get("ok") else {}
    return servers.get(sid, res)
