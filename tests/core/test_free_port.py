"""free_port's range: `$ADAMPS_FREE_PORT_RANGE` confines it, so pytest-xdist workers (each given
a slice by tests/conftest.py) never hand out the same port."""

from __future__ import annotations

import os

import pytest

from adamps.up import procs


def test_free_port_stays_in_the_range_it_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(procs.PORT_RANGE_ENV, "23000-23050")
    ports = {procs.free_port() for _ in range(20)}
    assert len(ports) == 20  # never one port twice in a process
    assert all(23000 <= p < 23050 for p in ports), sorted(ports)


@pytest.mark.parametrize("bad", ["23000", "a-b", "80-90", "30000-20000"])
def test_a_bad_range_names_the_variable_and_what_is_expected(
    monkeypatch: pytest.MonkeyPatch, bad: str
) -> None:
    monkeypatch.setenv(procs.PORT_RANGE_ENV, bad)
    with pytest.raises(ValueError, match=rf"ADAMPS_FREE_PORT_RANGE='{bad}': expected"):
        procs.free_port()


def test_each_xdist_worker_has_a_slice_of_its_own() -> None:
    """tests/conftest.py gives worker gwI of N the I-th of N equal slices of the range."""
    worker, count = (
        os.environ.get("PYTEST_XDIST_WORKER"),
        os.environ.get("PYTEST_XDIST_WORKER_COUNT"),
    )
    if not worker or not count:
        pytest.skip("not run by pytest-xdist")
    low, high = procs.port_range()
    monkey = pytest.MonkeyPatch()
    monkey.delenv(procs.PORT_RANGE_ENV)
    try:
        full_low, full_high = procs.port_range()
    finally:
        monkey.undo()
    step = (full_high - full_low) // int(count)
    assert (low, high) == (
        full_low + int(worker[2:]) * step,
        full_low + (int(worker[2:]) + 1) * step,
    )
