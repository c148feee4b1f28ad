"""bounds.within, the data port's reader thread's check of a whole push payload (issue 27),
against its reference: check_dense on every shard of the payload, as the event loop runs it.
A payload passes within exactly when every shard passes check_dense; a payload that fails is
then refused by check_dense with the error naming the shard."""

from __future__ import annotations

import numpy as np
import pytest

from adamps.server.updates import bounds
from adamps.wire.protocol import ProtocolError

SHARD = 1000


def reference(payload: np.ndarray) -> bool:
    try:
        for i in range(0, payload.size, SHARD):
            bounds.check_dense(f"v/{i // SHARD}", payload[i : i + SHARD])
    except ProtocolError:
        return False
    return True


BAD = [np.nan, np.inf, -np.inf, 2e12, -2e12, np.float32(3.4e38)]
EDGE = [1e12, -1e12, np.nextafter(np.float32(1e12), np.float32(np.inf)), 0.0, -0.0]


@pytest.mark.parametrize("seed", range(40))
def test_within_agrees_with_check_dense_on_every_shard(seed: int) -> None:
    rng = np.random.default_rng(seed)
    payload = rng.standard_normal(4 * SHARD).astype(np.float32) * rng.choice([1e-6, 1.0, 1e11])
    for _ in range(int(rng.integers(0, 3))):  # 0-2 special values anywhere, any shard
        payload[rng.integers(0, payload.size)] = rng.choice(BAD + EDGE)
    assert bounds.within(payload) == reference(payload)


@pytest.mark.parametrize("value", BAD + EDGE)
def test_within_at_each_special_value_and_position(value: float) -> None:
    for pos in (0, SHARD - 1, SHARD, 4 * SHARD - 1):
        payload = np.zeros(4 * SHARD, np.float32)
        payload[pos] = value
        assert bounds.within(payload) == reference(payload), (value, pos)


def test_within_of_an_empty_payload() -> None:
    assert bounds.within(np.zeros(0, np.float32))
