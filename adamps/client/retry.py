"""The one retry policy of every client: exponential back-off with full jitter, within a deadline.

The PS client, the controllers' client and the data server client all retry through here, so a
cluster's clients back off alike. Each attempt is one whole try (a push to every primary, a round
over every controller, a round over the servers of a slice); between attempts the client waits a
random time in ``[0, min(cap, first * 2**(n-1))]`` ("full jitter": clients that failed together
do not all come back together), and it raises the last error when the next wait would end past
its deadline. Built on tenacity; nobody else imports it.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import tenacity

T = TypeVar("T")


@dataclass(frozen=True)
class RetryPolicy:
    """How long a client keeps trying, and how long it waits between attempts."""

    #: seconds after the first attempt's start beyond which no attempt starts; the last error is
    #: raised instead
    deadline: float
    #: upper bound of the first wait (seconds); each further wait's bound doubles
    first: float = 0.05
    #: no wait is longer than this (seconds)
    cap: float = 1.0


def _settings(
    policy: RetryPolicy,
    retry_if: Callable[[BaseException], bool],
    on_retry: Callable[[BaseException, int], None] | None,
    give_up: Callable[[], bool] | None,
) -> dict[str, Any]:
    """The tenacity settings of `policy`, the same for the blocking and the asyncio driver."""
    stop: Any = tenacity.stop_before_delay(policy.deadline)
    if give_up is not None:
        stop = stop | (lambda _state: give_up())

    def before_sleep(state: tenacity.RetryCallState) -> None:
        if on_retry is not None and state.outcome is not None:
            exc = state.outcome.exception()
            assert exc is not None
            on_retry(exc, state.attempt_number)

    return {
        "stop": stop,
        "wait": tenacity.wait_random_exponential(multiplier=policy.first, max=policy.cap),
        "retry": tenacity.retry_if_exception(retry_if),
        "before_sleep": before_sleep,
        # The caller sees its own last error, not tenacity's RetryError.
        "reraise": True,
    }


def call(
    policy: RetryPolicy,
    attempt: Callable[[int], T],
    retry_if: Callable[[BaseException], bool],
    *,
    on_retry: Callable[[BaseException, int], None] | None = None,
    give_up: Callable[[], bool] | None = None,
) -> T:
    """attempt(n) for n = 1, 2, ... until it returns, raises an error that `retry_if` refuses, or
    the deadline (or `give_up()`) ends the retries. `on_retry(error, n)` runs before each wait."""
    # The first attempt runs bare: most calls succeed at once, and building tenacity's machinery
    # cost more than a 4 MB push's Python work on the data plane (issue 27: 0.1-0.2 ms per
    # call). A failure is handed to tenacity as its own first attempt, with the deadline left.
    start = time.monotonic()
    try:
        return attempt(1)
    except BaseException as exc:
        # what tenacity would decide after this attempt without a wait: stop here
        if not retry_if(exc) or (give_up is not None and give_up()):
            raise
        first = exc
    numbers = itertools.count(1)

    def again() -> T:
        n = next(numbers)
        if n == 1:
            raise first
        return attempt(n)

    left = RetryPolicy(policy.deadline - (time.monotonic() - start), policy.first, policy.cap)
    return tenacity.Retrying(**_settings(left, retry_if, on_retry, give_up))(again)


async def acall(
    policy: RetryPolicy,
    attempt: Callable[[int], Awaitable[T]],
    retry_if: Callable[[BaseException], bool],
    *,
    on_retry: Callable[[BaseException, int], None] | None = None,
    give_up: Callable[[], bool] | None = None,
) -> T:
    """`call` on the event loop: the waits are asyncio sleeps. The first attempt runs bare, as
    in `call`: a server's heartbeat every second built tenacity's machinery for nothing (issue
    36: idle costs nothing)."""
    start = time.monotonic()
    try:
        return await attempt(1)
    except BaseException as exc:
        if not retry_if(exc) or (give_up is not None and give_up()):
            raise
        first = exc
    numbers = itertools.count(1)

    async def one() -> T:
        n = next(numbers)
        if n == 1:
            raise first
        return await attempt(n)

    left = RetryPolicy(policy.deadline - (time.monotonic() - start), policy.first, policy.cap)
    return await tenacity.AsyncRetrying(**_settings(left, retry_if, on_retry, give_up))(one)
