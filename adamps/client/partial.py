"""What a push split over servers reports when only some of its parts were acknowledged.

A push checked whole (adamps/client/push_checks.py) can still fail on one server after others
applied their parts: a bucket unavailable until the retries' deadline, a server gone, a run's
quota, a table full. The parts are never rolled back (each bucket applied its part exactly once
and the push's pair stays recorded there), so the caller is told which parts were applied. It can
send the same push again with ``seq=err.seq``: the parts applied are recognised by their
``(client, seq)`` and dropped, the others applied once (docs/protocol-ps.md, "A push split over
servers").
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

#: the server of a part never sent (its bucket had no primary at any attempt)
NOT_SENT = "(not sent)"


class PartialPushError(Exception):
    """Some parts of a push were applied (acknowledged), the others were not confirmed.

    ``applied`` and ``unconfirmed`` map bucket -> the server its part was sent to last (a part
    whose request failed may still have been applied when ``cause`` is a lost connection or a
    timeout: its outcome is unknown, and sending it again with the same seq settles it; after a
    4xx refusal it was not applied). Not an ``RpcError``: a caller that reads a 4xx as "nothing
    applied" must not read this one so."""

    def __init__(
        self,
        op: str,
        client: str,
        seq: int,
        applied: Mapping[int, str],
        unconfirmed: Mapping[int, str],
        cause: BaseException,
    ) -> None:
        self.op = op
        self.client = client
        self.seq = seq
        self.applied = dict(applied)
        self.unconfirmed = dict(unconfirmed)
        self.cause = cause
        #: the cause's error code ("unavailable", "table_full", ...), or its type's name
        self.code = getattr(cause, "code", type(cause).__name__)
        why = str(cause) if hasattr(cause, "code") else f"{type(cause).__name__}: {cause}"
        super().__init__(
            f"{op} (client {client!r}, seq {seq}) applied in part: buckets "
            f"{_where(self.applied)} applied; buckets {_where(self.unconfirmed)} not confirmed "
            f"({why}). Send the same push again with seq={seq} to complete it exactly once."
        )

    @property
    def applied_servers(self) -> set[str]:
        return set(self.applied.values())

    @property
    def unconfirmed_servers(self) -> set[str]:
        return set(self.unconfirmed.values())


def _where(parts: Mapping[int, str]) -> str:
    by_server: dict[str, list[int]] = {}
    for b, url in sorted(parts.items()):
        by_server.setdefault(url, []).append(b)
    return "; ".join(f"{bs} on {url}" for url, bs in by_server.items()) or "none"


def partial_of(
    cause: BaseException,
    op: str,
    client: str,
    seq: int,
    sent_to: Mapping[int, str],
    applied: Iterable[int],
    unconfirmed: Iterable[int],
) -> PartialPushError | None:
    """The PartialPushError of a push that failed with `cause` after the buckets `applied`
    acknowledged their parts (None when none did: `cause` says it all). `sent_to`: bucket -> the
    server its part was last sent to (a bucket never sent is reported without a server)."""
    applied = set(applied)
    if not applied:
        return None
    return PartialPushError(
        op,
        client,
        seq,
        {b: sent_to.get(b, NOT_SENT) for b in applied},
        {b: sent_to.get(b, NOT_SENT) for b in set(unconfirmed) - applied},
        cause,
    )
