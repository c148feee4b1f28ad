"""Pipelined rounds: the next batch's rows are fetched while the current batch computes (PERSIA,
Monolith; issue 36 item 2).

    pipe = RowPipeline(client, depth=1)
    pipe.prime({"emb": ids_of(0)}); pipe.prime({"emb": ids_of(1)})   # depth + 1 batches ahead
    for t in range(n):
        rows = pipe.next()["emb"]                     # batch t's rows (waits for their round)
        ...                                           # compute batch t
        pipe.round(rows={"emb": (ids_t, grads_t)}, dense=..., fetch_rows={"emb": ids_of(t + 2)})

Each ``round`` is one ``PSClient.round`` (one request per server), sent by one background
thread in the order given: batch t + 1 computes while round t is in flight. Its answer holds
the rows of batch t + 1 + depth.

Staleness bound (docs/training.md, "Pipelined rows"): the rows batch t computes with were read
by their servers after this replica's rounds 0 .. t - 1 - depth were applied there, so they lack
at most ``depth`` of this replica's own rounds (the last ``depth`` ones), never more; other
replicas' updates are as fresh as the moment of that read, as for any pull. ``depth = 0`` is
ps-lite's ZPushPull without overlap: round t's answer, which includes round t's own writes, is
waited for before batch t + 1 starts.
"""

from __future__ import annotations

import collections
import concurrent.futures
from collections.abc import Mapping
from typing import Any

import numpy as np

#: the pipelining depth of the engines' table loops (the staleness bound, in own rounds)
DEPTH = 1


class RowPipeline:
    """Rounds of one replica, in order, one background thread (not thread-safe: one caller)."""

    def __init__(self, client: Any, depth: int = DEPTH) -> None:
        if depth not in (0, 1):
            raise ValueError(f"depth must be 0 or 1 (rounds in flight), got {depth}")
        self.client = client
        self.depth = depth
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="adamps-round")
        #: the fetches of the batches ahead, oldest first (each a round's future)
        self._ahead: collections.deque[concurrent.futures.Future] = collections.deque()
        #: rounds sent so far / the count of them every fetch queued had seen (staleness_of)
        self.rounds = 0
        self._seen: collections.deque[int] = collections.deque()

    def prime(self, fetch_rows: Mapping[str, Any]) -> None:
        """Fetches a first batch's rows (call it depth + 1 times before the first `next`)."""
        self._submit({}, fetch_rows, count=False)

    def next(self) -> dict[str, np.ndarray]:
        """The next batch's rows (table -> rows), waiting for the round that fetched them;
        raises that round's error."""
        if not self._ahead:
            raise RuntimeError("no batch fetched ahead: prime() first, then round() per batch")
        self._seen.popleft()
        return self._ahead.popleft().result()

    def staleness(self) -> int:
        """Own rounds sent but not seen by the rows `next` returns next (at most `depth`)."""
        return self.rounds - self._seen[0] if self._seen else 0

    def round(
        self,
        fc: Mapping[str, Any] | None = None,
        dense: Mapping[str, np.ndarray] | None = None,
        rows: Mapping[str, Any] | None = None,
        fetch_rows: Mapping[str, Any] | None = None,
    ) -> None:
        """Sends this batch's round in the background (after the rounds before it), fetching
        `fetch_rows` for the batch `depth + 1` ahead; with depth 0 it is waited for here."""
        self._submit({"fc": fc, "dense": dense, "rows": rows}, fetch_rows or {}, count=True)
        if self.depth == 0:
            f = self._ahead[-1]
            f.result()  # its error now, as a synchronous round's

    def _submit(self, writes: dict[str, Any], fetch: Mapping[str, Any], count: bool) -> None:
        if len(self._ahead) > self.depth:
            raise RuntimeError(
                f"{len(self._ahead)} batches fetched ahead and not taken: call next() per round"
            )
        seq = self.client.next_seq() if count else None
        self._ahead.append(
            self._pool.submit(
                lambda: self.client.round(
                    writes.get("fc"), writes.get("dense"), writes.get("rows"), fetch, seq=seq
                )
            )
        )
        if count:
            self.rounds += 1
        # the fetch is read after this round's writes: it has seen every own round up to it
        self._seen.append(self.rounds)

    def flush(self) -> None:
        """Waits for every round in flight; raises the first one's error."""
        while self._ahead:
            self._seen.popleft()
            self._ahead.popleft().result()

    def close(self) -> None:
        """Waits for the rounds in flight (their errors are dropped: call next() to see them)."""
        self._pool.shutdown(wait=True)

    def __enter__(self) -> RowPipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
