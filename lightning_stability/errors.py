"""The one exception type for bad configuration."""

from __future__ import annotations


class StabilityConfigError(ValueError):
    """Raised at construction or at ``setup`` when an argument or a Trainer setting is wrong.

    The message always names the argument, the value that was received and how to fix it.
    """


def config_error(argument: str, value: object, problem: str, fix: str) -> StabilityConfigError:
    """Build a :class:`StabilityConfigError` with the project's message layout."""
    return StabilityConfigError(f"`{argument}={value!r}` {problem}. Fix: {fix}")


def check_positive_int(argument: str, value: object, example: str) -> None:
    """Raise a :class:`StabilityConfigError` unless ``value`` is an int >= 1 (``bool`` is not accepted)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise config_error(argument, value, "must be an int >= 1", f"pass e.g. {example}")
