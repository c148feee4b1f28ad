"""pysyncobj identifies a replicated method in the journal by its number: its rank among the
consumer's replicated methods sorted by (ver, name). A method added anywhere but at the end of
that order renumbers the ones after it, and a journal written by the previous version would
replay as the wrong operations after an upgrade. This pins the order; new methods go at the end
(choose a name that sorts last, or a higher `ver`).
"""

from __future__ import annotations

from controller.state import ReplicatedCluster

#: the order of the release before issue 12, then what was appended since
RELEASED = [
    "caught_up_v0", "declare_dead_v0", "drain_v0", "drop_secondary_v0", "rebalance_v0",
    "reconcile_v0", "register_v0", "release_v0", "renew_v0", "report_progress_v0",
    "role_change_v0", "set_layout_v0",
]  # fmt: skip
APPENDED = [
    "sweep_dead_v0",
    "verified_caught_up_v0",
    "write_off_v0",
    "write_storage_v0",
    "write_tenancy_v0",
    "x_checkpoint_v0",
    "x_renew_round_v0",
]


def replicated_method_order(cls: type) -> list[str]:
    names = [
        m
        for m in dir(cls)
        if getattr(getattr(cls, m), "replicated", False)
        and m != getattr(getattr(cls, m), "origName", m)
    ]
    return [n for _ver, n in sorted((getattr(cls, n).ver, n) for n in names)]


def test_replicated_methods_keep_their_journal_numbers() -> None:
    order = replicated_method_order(ReplicatedCluster)
    assert order[: len(RELEASED)] == RELEASED, order
    assert order == RELEASED + APPENDED, order
