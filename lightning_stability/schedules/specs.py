"""Schedule specs (frozen dataclasses binding a schedule's arguments) and the checks of user schedules."""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lightning_stability.errors import check_instance, check_length, config_error
from lightning_stability.schedules.functions import (
    _check_lengths,
    _check_step_args,
    _require_total,
    check_floor,
    cosine,
    inverse_sqrt,
    linear,
    step_decay,
    warmup_constant_cosine,
)


@dataclass(frozen=True)
class Schedule:
    """A schedule with its arguments bound: ``spec(step, total_steps) -> multiplier``.

    Subclasses check their arguments on construction (errors name the argument and the fix) and say
    with :attr:`needs_total_steps` whether the run length must be known.
    """

    needs_total_steps = True

    def __call__(self, step: int, total_steps: int | None) -> float:
        raise NotImplementedError

    def validate(self, total_steps: int | None) -> None:
        """Raise now if the schedule cannot be evaluated for a run of ``total_steps`` updates."""
        self(0, total_steps)


@dataclass(frozen=True)
class WarmupConstantCosineSchedule(Schedule):
    """Warmup, constant, cosine decay. See :func:`warmup_constant_cosine`.

    Attributes:
        warmup: warmup length (fraction of the run or step count).
        decay: length of the final cosine decay (fraction or step count).
        min_lr_ratio: the floor of the decay.
    """

    warmup: float = 0.05
    decay: float = 0.20
    min_lr_ratio: float = 0.0

    def __post_init__(self) -> None:
        check_length("warmup", self.warmup)
        _check_lengths({"decay": self.decay})
        check_floor(self.min_lr_ratio)
        if self.warmup < 1 and self.decay < 1 and self.warmup + self.decay > 1 + 1e-9:
            raise config_error(
                "warmup + decay",
                self.warmup + self.decay,
                "is more than the whole run: the phases would overlap",
                "make the fractions add up to at most 1 (warmup=0.05, decay=0.95 is cosine with warmup)",
            )

    def __call__(self, step: int, total_steps: int | None) -> float:
        return warmup_constant_cosine(step, _require_total(total_steps), self.warmup, self.decay, self.min_lr_ratio)


@dataclass(frozen=True)
class _WarmupDecaySchedule(Schedule):
    """Warmup, then a decay of :attr:`shape` down to the floor.

    Attributes:
        warmup: warmup length (fraction of the run or step count).
        min_lr_ratio: the floor of the decay.
    """

    warmup: float = 0.0
    min_lr_ratio: float = 0.0

    def __post_init__(self) -> None:
        check_length("warmup", self.warmup)
        check_floor(self.min_lr_ratio)

    @staticmethod
    def shape(step: int, total_steps: int, warmup: float, min_lr_ratio: float) -> float:
        raise NotImplementedError

    def __call__(self, step: int, total_steps: int | None) -> float:
        return self.shape(step, _require_total(total_steps), self.warmup, self.min_lr_ratio)


@dataclass(frozen=True)
class CosineSchedule(_WarmupDecaySchedule):
    """Warmup, then cosine decay to the floor (``warmup``, ``min_lr_ratio``). See :func:`cosine`."""

    shape = staticmethod(cosine)


@dataclass(frozen=True)
class LinearSchedule(_WarmupDecaySchedule):
    """Warmup, then linear decay to the floor (``warmup``, ``min_lr_ratio``). See :func:`linear`."""

    shape = staticmethod(linear)


@dataclass(frozen=True)
class StepSchedule(Schedule):
    """Warmup, then a factor ``gamma`` every ``every`` updates or at ``milestones``. See :func:`step_decay`.

    Attributes:
        gamma: factor per drop.
        every: drop period (fraction or step count).
        milestones: drop points (fractions or step counts).
        warmup: warmup length.
        min_lr_ratio: the floor.
    """

    gamma: float = 0.1
    every: float | None = None
    milestones: tuple[float, ...] = field(default=())
    warmup: float = 0.0
    min_lr_ratio: float = 0.0

    def __post_init__(self) -> None:
        check_instance("milestones", self.milestones, (list, tuple), "a list of update counts or fractions", "[1000]")
        object.__setattr__(self, "milestones", tuple(self.milestones))
        check_length("warmup", self.warmup)
        _check_step_args(self.gamma, self.every, self.milestones, self.min_lr_ratio)

    @property
    def needs_total_steps(self) -> bool:  # type: ignore[override]
        lengths = [self.warmup, *(self.milestones), *([self.every] if self.every is not None else [])]
        return any(0 < v < 1 for v in lengths)

    def __call__(self, step: int, total_steps: int | None) -> float:
        return step_decay(step, self.gamma, self.every, self.milestones, self.warmup, self.min_lr_ratio, total_steps)


@dataclass(frozen=True)
class InverseSqrtSchedule(Schedule):
    """Warmup, then ``∝ 1/√step``. See :func:`inverse_sqrt`.

    Attributes:
        warmup: warmup length (fraction or step count).
        min_lr_ratio: the floor.
    """

    warmup: float = 0.0
    min_lr_ratio: float = 0.0

    def __post_init__(self) -> None:
        check_length("warmup", self.warmup)
        check_floor(self.min_lr_ratio)

    @property
    def needs_total_steps(self) -> bool:  # type: ignore[override]
        return 0 < self.warmup < 1

    def __call__(self, step: int, total_steps: int | None) -> float:
        return inverse_sqrt(step, self.warmup, self.min_lr_ratio, total_steps)


def check_schedule_callable(schedule: Callable[..., Any]) -> None:
    """Raise unless ``schedule`` can be called as ``schedule(step, total_steps)``.

    Callables whose signature Python cannot read (some builtins) are accepted; the first call checks them.

    Raises:
        StabilityConfigError: the callable takes other arguments (e.g. ``lambda step: ...``).
    """
    try:
        signature = inspect.signature(schedule)
    except (TypeError, ValueError):
        return
    try:
        signature.bind(0, 1)
    except TypeError as err:
        raise config_error(
            "schedule",
            schedule,
            f"cannot be called as schedule(step, total_steps) ({err})",
            "take both arguments, e.g. `lambda step, total_steps: f(step)` for a schedule that needs no run length",
        ) from None


def check_multiplier(value: object, step: int, schedule: object) -> float:
    """``value`` as a float, if it is a usable LR multiplier (a finite real number ``>= 0``).

    Raises:
        StabilityConfigError: NaN, infinite, negative or not a number; names the schedule and the step.
    """
    # a one-element tensor or array, or a numpy scalar, is as good as a float
    numel = getattr(value, "numel", None)
    size = numel() if callable(numel) else getattr(value, "size", None)
    number = value.item() if hasattr(value, "item") and size == 1 else value
    if isinstance(number, bool) or not isinstance(number, numbers.Real):
        raise config_error(
            "schedule", schedule, f"returned {value!r} at step {step}, not a number", "return a float multiplier"
        )
    if not math.isfinite(number) or number < 0:
        raise config_error(
            "schedule",
            schedule,
            f"returned the LR multiplier {number!r} at step {step}",
            "return a finite multiplier >= 0 for every step of the run (the LR is base_lr * multiplier)",
        )
    return float(number)
