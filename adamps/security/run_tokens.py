"""Run tokens accepted by a role that only reads (a data server), learnt from the controllers
(issue 25): the hash of each run's token, fetched from ``GET /auth/runs`` with the cluster
token. A token not in the table makes it fetch again (at most every `MISS_INTERVAL`); the table
is trusted for `TTL` seconds, so a deleted run's token stops working within TTL."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from adamps import runs

log = logging.getLogger(__name__)

#: fewest seconds between two fetches caused by an unknown token
MISS_INTERVAL = 0.5
#: seconds a fetched table is used before the next lookup fetches it again
TTL = 5.0


class RunTokens:
    """hash -> run, fetched on demand (event-loop thread)."""

    def __init__(
        self,
        fetch: Callable[[], Awaitable[dict[str, Any]]],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        #: fetches {"runs": {name: {"token_hash", ...}}} (GET /auth/runs)
        self.fetch = fetch
        self.clock = clock
        self.by_hash: dict[str, str] = {}
        self._fetched_at = -1e9
        self._tried_at = -1e9
        self._lock = asyncio.Lock()

    async def run_of(self, token: str) -> str | None:
        """The run whose token this is, or None."""
        digest = runs.token_hash(token)
        if self.clock() - self._fetched_at > TTL or digest not in self.by_hash:
            # Under the lock: a lookup that arrives while a fetch is in flight waits for it.
            async with self._lock:
                stale = self.clock() - self._fetched_at > TTL
                if (stale or digest not in self.by_hash) and (
                    self.clock() - self._tried_at >= MISS_INTERVAL
                ):
                    self._tried_at = self.clock()
                    try:
                        table = await self.fetch()
                    except Exception as exc:  # keep the last table; the next lookup tries again
                        log.warning("could not fetch the runs from the controllers: %s", exc)
                    else:
                        recs = table.get("runs") or {}
                        self.by_hash = {r["token_hash"]: n for n, r in recs.items()}
                        self._fetched_at = self.clock()
        return self.by_hash.get(digest)
