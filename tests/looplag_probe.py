"""The loop-lag probe's shared part (issue 39): read a process's blocked-time histogram around
each request of a table, and report the requests that held an event loop past the bound.

Used by tests/system/test_loop_lag.py (a parameter server) and test_loop_lag_roles.py (the
controllers, a data server). Every process probed must run with `ENV` (a 10 ms probe timer:
at the default 0.25 s a hold of B seconds is seen only as B - 0.25).
"""

from __future__ import annotations

import http.client
import inspect
import re
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

#: the bound on one request's hold of the loop (the issue's)
BOUND = 0.1
#: the environment of every probed process: the 10 ms timer, and the loop's stack logged when
#: it is held 0.1 s (the log then says where)
ENV = {"ADAMPS_LOOP_PROBE_PERIOD": "0.01", "ADAMPS_LOOP_STACKS": "0.1"}


def blocked(addr: str) -> dict[float, int]:
    """`addr`'s (host:port) blocked-time histogram: upper bound (seconds) -> observations at
    most it."""
    conn = http.client.HTTPConnection(addr, timeout=30)
    try:
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    got = re.findall(r'adamps_event_loop_blocked_seconds_bucket\{le="([^"]+)"\} (\S+)', text)
    assert got, f"{addr} exposes no adamps_event_loop_blocked_seconds"
    return {float(le): int(float(n)) for le, n in got}


def over_bound(addr: str) -> dict[float, int]:
    """Observations above BOUND so far, by the bucket they fell in (its upper bound)."""
    h = blocked(addr)
    bounds = sorted(h)
    return {hi: h[hi] - h[lo] for lo, hi in zip(bounds, bounds[1:], strict=False) if lo >= BOUND}


def probe(
    table: Mapping[str, Callable[[], Any]],
    addrs: Iterable[str],
    settle: float = 0.6,
    skip: Iterable[str] = (),
) -> dict[str, dict[str, int]]:
    """Runs each request of `table` (kind -> a call) and returns the kinds that held the loop
    of any process of `addrs` past BOUND: kind -> {"<addr> <= <bucket> s": observations}.

    A request that holds the loop does so each time; a machine loaded by other work may delay
    a loop's thread once (the GIL's hand-overs to busy owner threads are not counted as waiting
    for a CPU): a kind is reported when two tries in a row exceed the bound. A call gets the
    try's number (0, 1) when it takes an argument `again` (a create under a new name)."""
    addrs = list(addrs)
    skipped = set(skip)
    slow: dict[str, dict[str, int]] = {}
    for kind, call in table.items():
        if kind in skipped:
            continue
        for again in range(2):
            before = {a: over_bound(a) for a in addrs}
            call(again) if "again" in inspect.signature(call).parameters else call()
            time.sleep(settle)  # the probe's next ticks, and the work the request started
            new = {}
            for a in addrs:
                after = over_bound(a)
                for hi, n in after.items():
                    if n > before[a][hi]:
                        new[f"{a} <= {hi:g} s"] = n - before[a][hi]
            if not new:
                slow.pop(kind, None)
                break
            slow[kind] = new
    return slow


def request(
    addr: str,
    method: str,
    path: str,
    body: bytes | None = None,
    headers: Mapping[str, str] | None = None,
    timeout: float = 120,
) -> tuple[int, bytes]:
    """(status, body) of one HTTP request to `addr` (host:port)."""
    conn = http.client.HTTPConnection(addr, timeout=timeout)
    try:
        conn.request(method, path, body=body, headers=dict(headers or {}))
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()
