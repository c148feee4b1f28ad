"""The coordinator's record encoding (coordinator/record.py) and its configuration's checks."""

from __future__ import annotations

import numpy as np
import pytest

from adamps.config import ConfigError, load
from coordinator.config import CoordinatorConfig
from coordinator.record import RecordError, decode, encode


@pytest.mark.parametrize(
    "obj",
    [{"k": 3, "f": 0.1 + 0.2, "hist": [{"rho": 1e-300}]}, "odd", "ev", [], {"s": "\u00e9\u4e2d"}],
)
def test_records_round_trip_exactly(obj) -> None:
    values = encode(obj)
    assert values.dtype == np.float32 and (values >= 0).all() and (values < 65536).all()
    assert decode(np.concatenate([values, np.full(9, 7.0, np.float32)])) == obj  # tail ignored


def test_empty_tensor_is_no_record_and_too_big_is_refused() -> None:
    assert decode(np.zeros(10, np.float32)) is None
    with pytest.raises(RecordError):
        encode({"x": "y" * 100}, capacity=20)


@pytest.mark.parametrize(
    "flags, message",
    [
        ([], "give --controllers"),
        (["--controllers", "127.0.0.1:1", "--portions", "0"], "portions must be >= 1"),
        (["--controllers", "127.0.0.1:1", "--run", "a b"], "run must be"),
        (["--controllers", "127.0.0.1:1", "--l2", "-1"], "expected a number >= 0"),
    ],
)
def test_bad_configuration_names_the_value(flags, message) -> None:
    from coordinator.main import build_parser

    args = build_parser().parse_args(flags)
    with pytest.raises(ConfigError, match=message):
        load(CoordinatorConfig, "coordinator", args, environ={"ADAMPS_TOKEN": "a-test-token-123"})
