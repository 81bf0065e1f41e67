"""The one exception type for bad configuration, its message layout, and the argument checks every feature uses."""

from __future__ import annotations

import math
import os
from typing import Any, cast


class StabilityConfigError(ValueError):
    """Raised at construction or at ``setup`` when an argument or a Trainer setting is wrong.

    The message always names the argument, the value that was received and how to fix it.
    """


def config_error(argument: str, value: object, problem: str, fix: str) -> StabilityConfigError:
    """Build a :class:`StabilityConfigError` with the project's message layout."""
    return StabilityConfigError(f"`{argument}={value!r}` {problem}. Fix: {fix}")


FAIRSCALE_FIX = (
    "install FairScale: `pip install --no-build-isolation fairscale==0.4.13` (a source package; this keeps the "
    "torch you already have), or from a clone of lightning_stability the `fairscale` extra: "
    '`pip install -e ".[fairscale]"`'
)


def require_fairscale(argument: str, value: object, alternative: str) -> None:
    """Raise a :class:`StabilityConfigError` naming ``argument=value`` when FairScale is not installed."""
    try:
        import fairscale  # noqa: F401
    except ImportError as err:
        raise config_error(
            argument, value, "needs FairScale, which is not installed", f"{FAIRSCALE_FIX}, or {alternative}"
        ) from err


def check_int(argument: str, value: object, minimum: int = 1, example: str | None = None) -> int:
    """``value`` if it is an int >= ``minimum`` (``bool`` is not accepted), else a config error naming it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        fix = f"pass e.g. {example if example is not None else f'{argument}={max(minimum, 1)}'}"
        raise config_error(argument, value, f"must be an int >= {minimum}", fix)
    return value


def check_number(
    argument: str,
    value: object,
    low: float = 0.0,
    high: float = math.inf,
    example: str = "1",
    *,
    low_inclusive: bool = False,
    high_inclusive: bool = False,
) -> float:
    """``value`` as a float if it is a number between ``low`` and ``high``, else a config error naming it.

    Both bounds are excluded unless ``low_inclusive`` / ``high_inclusive`` (so by default the number is finite;
    ``high=math.inf, high_inclusive=True`` admits infinity). NaN and ``bool`` never pass.
    """
    number = not isinstance(value, bool) and isinstance(value, (int, float))
    above = number and (low <= value if low_inclusive else low < value)  # type: ignore[operator]
    below = number and (value <= high if high_inclusive else value < high)  # type: ignore[operator]
    if not (above and below):
        if high == math.inf:
            bounds = f"{'>=' if low_inclusive else '>'} {low}" + (", or inf" if high_inclusive else "")
        else:
            bounds = f"in {'[' if low_inclusive else '('}{low}, {high}{']' if high_inclusive else ')'}"
        what = "a number" if high == math.inf and high_inclusive else "a finite number"
        raise config_error(argument, value, f"must be {what} {bounds}", f"pass e.g. {argument}={example}")
    return float(value)  # type: ignore[arg-type]


def check_bool(argument: str, value: object) -> bool:
    """``value`` if it is a bool, else a config error naming it."""
    if not isinstance(value, bool):
        raise config_error(argument, value, "must be a bool", "pass True or False")
    return value


def check_ratio(argument: str, value: object, example: str = "0.1") -> float:
    """``value`` as a float if it is a number in ``[0, 1]``, else a config error naming it."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise config_error(argument, value, "must be in [0, 1]", f"pass e.g. {example}")
    return float(value)


def check_length(argument: str, value: object) -> float:
    """A phase length: a fraction of the run in ``[0, 1)`` or a whole step count ``>= 1``, else a config error."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise config_error(
            argument, value, "must be a fraction in [0, 1) or a whole step count >= 1", "pass e.g. 0.05 or 500"
        )
    if value >= 1 and float(value) != int(value):
        raise config_error(
            argument, value, "is >= 1 but not a whole number of steps", f"pass {int(value)} or a fraction < 1"
        )
    return float(value)


def check_instance(argument: str, value: object, types: type | tuple[type, ...], what: str, example: str) -> Any:
    """``value`` if it is an instance of ``types`` (a ``bool`` only where ``types`` names ``bool``), else a config
    error naming it: ``what`` says what was expected ("a str"), ``example`` a value to pass."""
    allowed = types if isinstance(types, tuple) else (types,)
    if not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed):
        raise config_error(argument, value, f"must be {what}", f"pass e.g. {argument}={example}")
    return value


def check_alone(callback: object, kind: type, callbacks: list[Any], problem: str, fix: str) -> None:
    """A config error naming the Trainer's callbacks when another ``kind`` than ``callback`` is among them:
    ``problem`` says what two would do, ``fix`` what to keep."""
    if any(isinstance(cb, kind) and cb is not callback for cb in callbacks):
        raise config_error("callbacks", [type(cb).__name__ for cb in callbacks], problem, fix)


def check_path(argument: str, value: object, example: str = "'checkpoints/'") -> str | os.PathLike[str]:
    """``value`` if it is a path (a ``str`` or an ``os.PathLike``), else a config error naming it."""
    return cast("str | os.PathLike[str]", check_instance(argument, value, (str, os.PathLike), "a path", example))
