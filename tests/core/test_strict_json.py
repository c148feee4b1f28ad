"""Issue 12 item 8: JSON carries only finite numbers, in and out (adamps/wire/web.py)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from adamps.wire import web as aweb
from adamps.wire.protocol import ProtocolError


def test_replies_never_carry_nan_or_infinity() -> None:
    text = aweb.dumps_finite(
        {"loss": math.nan, "xs": [1.0, math.inf, -math.inf], "a": np.array([np.nan, 2.0])}
    )
    assert json.loads(text, parse_constant=pytest.fail) == {
        "loss": None,
        "xs": [1.0, None, None],
        "a": [None, 2.0],
    }
    assert aweb.dumps_finite({"ok": 1.5}) == '{"ok": 1.5}'


@pytest.mark.parametrize(
    "body, code",
    [
        (b'{"x": NaN}', "malformed"),
        (b'{"x": -Infinity}', "malformed"),
        (b'{"x": 1e999}', "malformed"),
        (b'{"x": -1e400}', "malformed"),
        (b"[" * 5000 + b"]" * 5000, "malformed"),
        (b"[]" * 70_000, "too_large"),
        (b'{"x": "\xff"}', "malformed"),
    ],
)
def test_bodies_with_non_finite_numbers_deep_nesting_or_too_many_containers(body, code) -> None:
    with pytest.raises(ProtocolError) as err:
        aweb.parse_json(body)
    assert err.value.code == code


def test_big_integers_stay_exact_for_the_range_checks() -> None:
    assert aweb.parse_json(b'{"epoch": 1000000000000000000000}') == {"epoch": 10**21}
