"""The argument checks of ``lightning_stability.errors``: bounds open or closed, the message names the argument,
the value, the bounds and the fix."""

from __future__ import annotations

import math

import pytest

from lightning_stability.errors import StabilityConfigError, check_number


@pytest.mark.parametrize(
    ("kwargs", "good", "bad", "says"),
    [
        ({}, [1e-9, 5, 1e300], [0, -1, math.inf, math.nan, True, "1"], "must be a finite number > 0.0"),
        ({"low_inclusive": True}, [0, 0.0, 3], [-1e-9, math.inf, math.nan], "must be a finite number >= 0.0"),
        ({"high_inclusive": True}, [1, math.inf], [0, -math.inf, math.nan], "must be a number > 0.0, or inf"),
        ({"high": 1.0}, [0.5], [0, 1, 1.5, math.nan], r"must be a finite number in \(0.0, 1.0\)"),
        ({"high": 1.0, "high_inclusive": True}, [0.5, 1], [0, 1.5], r"must be a finite number in \(0.0, 1.0\]"),
        ({"low": 1.0, "low_inclusive": True}, [1, 8.0], [0.99, math.inf], "must be a finite number >= 1.0"),
    ],
)
def test_check_number_bounds(kwargs: dict, good: list, bad: list, says: str) -> None:
    for value in good:
        assert check_number("x", value, **kwargs) == float(value)
    for value in bad:
        with pytest.raises(StabilityConfigError, match=rf"^`x={value!r}` {says}\. Fix: pass e\.g\. x=3$"):
            check_number("x", value, example="3", **kwargs)
