"""The one exception type for bad configuration."""

from __future__ import annotations


class StabilityConfigError(ValueError):
    """Raised at construction or at ``setup`` when an argument or a Trainer setting is wrong.

    The message always names the argument, the value that was received and how to fix it.
    """


def config_error(argument: str, value: object, problem: str, fix: str) -> StabilityConfigError:
    """Build a :class:`StabilityConfigError` with the project's message layout."""
    return StabilityConfigError(f"`{argument}={value!r}` {problem}. Fix: {fix}")


FAIRSCALE_FIX = (
    'install the extra: pip install "lightning-stability[fairscale]" (FairScale 0.4.13 ships as a source '
    "package; `pip install --no-build-isolation fairscale==0.4.13` keeps the torch you already have)"
)


def require_fairscale(argument: str, value: object, alternative: str) -> None:
    """Raise a :class:`StabilityConfigError` naming ``argument=value`` when FairScale is not installed."""
    try:
        import fairscale  # noqa: F401
    except ImportError as err:
        raise config_error(
            argument, value, "needs FairScale, which is not installed", f"{FAIRSCALE_FIX}, or {alternative}"
        ) from err


def check_positive_int(argument: str, value: object, example: str) -> None:
    """Raise a :class:`StabilityConfigError` unless ``value`` is an int >= 1 (``bool`` is not accepted)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise config_error(argument, value, "must be an int >= 1", f"pass e.g. {example}")
