"""Gradient-accumulation schedules: pure arithmetic on the count of applied optimizer updates.

A schedule maps ``applied`` -- the number of optimizer updates already applied, the same clock as
:mod:`lightning_stability.schedules` (a skipped update does not move it) -- to the number of
micro-batches of the next optimizer step, and to the LR factor that accumulation implies. Nothing here
imports Lightning or torch; :class:`~lightning_stability.accumulation.callback.GradientAccumulation`
wires it to the Trainer.

Example::

    >>> schedule = AccumulationSchedule.parse({2: 3, 5: 2})
    >>> [schedule.factor_at(n) for n in range(7)]
    [1, 1, 3, 3, 3, 2, 2]
    >>> schedule.optimizer_steps(batches_per_epoch=10, max_steps=-1, max_epochs=2)
    10
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping
from dataclasses import dataclass

from lightning_stability.errors import check_int, config_error

__all__ = ["LR_SCALINGS", "AccumulationSchedule", "lr_scale", "parse_steps"]

#: The ``lr_scaling`` choices; ``lr_scale`` gives the factor of the first three ("adascale" is measured).
LR_SCALINGS = ("linear", "sqrt", "none", "adascale")


def parse_steps(steps: int | Mapping[int, int]) -> tuple[list[int], list[int]]:
    """(sorted keys, factors) of an accumulation schedule; before the first key the factor is 1."""
    if isinstance(steps, Mapping):
        if not steps:
            raise config_error("steps", dict(steps), "is an empty schedule", "pass e.g. {0: 2, 1000: 4} or an int")
        for key, value in steps.items():
            if isinstance(key, bool) or not isinstance(key, int) or key < 0:
                raise config_error(
                    "steps",
                    dict(steps),
                    f"has key {key!r}; keys are optimizer-update counts (ints >= 0)",
                    "key the schedule by optimizer update, e.g. {0: 2, 1000: 4}",
                )
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise config_error(
                    "steps",
                    dict(steps),
                    f"maps {key} to {value!r}; factors are ints >= 1",
                    "pass e.g. {0: 2, 1000: 4}",
                )
        schedule = dict(steps)  # a copy: the caller's dict is never changed
        schedule.setdefault(0, 1)
        keys = sorted(schedule)
        return keys, [schedule[k] for k in keys]
    check_int("steps", steps, 1, "4, or a dict {update: factor} such as {0: 2, 1000: 4}")
    return [0], [steps]


def lr_scale(factor: int, scaling: str) -> float:
    """The LR factor of ``factor`` micro-batches per step: ``k`` ("linear"), ``sqrt(k)`` ("sqrt"), else 1."""
    if scaling == "linear":
        return float(factor)
    if scaling == "sqrt":
        return math.sqrt(factor)
    return 1.0


@dataclass(frozen=True)
class AccumulationSchedule:
    """Micro-batches per optimizer step, keyed by applied updates: ``factors[i]`` from ``keys[i]`` on.

    ``keys`` is sorted and starts at 0 (:meth:`parse` guarantees both).
    """

    keys: tuple[int, ...]
    factors: tuple[int, ...]

    @classmethod
    def parse(cls, steps: int | Mapping[int, int]) -> AccumulationSchedule:
        """From an int (constant) or ``{applied_updates: factor}``; raises ``StabilityConfigError`` when bad."""
        keys, factors = parse_steps(steps)
        return cls(tuple(keys), tuple(factors))

    @property
    def is_constant(self) -> bool:
        return len(set(self.factors)) == 1

    @property
    def max_factor(self) -> int:
        return max(self.factors)

    def factor_at(self, applied_steps: int) -> int:
        """Micro-batches per optimizer step after ``applied_steps`` applied updates."""
        return self.factors[bisect.bisect_right(self.keys, applied_steps) - 1]

    def next_switch(self, applied_steps: int) -> int | None:
        """The first key after ``applied_steps`` (where the factor may change next), or ``None``."""
        i = bisect.bisect_right(self.keys, applied_steps)
        return self.keys[i] if i < len(self.keys) else None

    def micro_batches_before(self, applied_steps: int) -> int:
        """Micro-batches (per rank) of the first ``applied_steps`` updates, each of its factor: the samples they
        trained on, in micro-batches (the shorter last window of an epoch counted whole)."""
        total = 0
        for i, (key, factor) in enumerate(zip(self.keys, self.factors, strict=True)):
            end = self.keys[i + 1] if i + 1 < len(self.keys) else applied_steps
            total += max(0, min(end, applied_steps) - key) * factor
        return total

    def lr_scale_at(self, applied_steps: int, scaling: str) -> float:
        """The LR factor of the update after ``applied_steps`` updates under ``scaling``."""
        return lr_scale(self.factor_at(applied_steps), scaling)

    def optimizer_steps(self, batches_per_epoch: float, max_steps: int, max_epochs: int | None) -> int | None:
        """Optimizer steps of a whole run (``None``: endless, or the epoch length is unknown).

        ``max_steps``/``max_epochs`` follow the Trainer (``-1``/``None`` for no limit). Every epoch ends
        with an optimizer step (its last window may be shorter). Assumes no skipped updates; a skip delays
        every later switch by one step.
        """
        if not math.isfinite(batches_per_epoch):
            return None
        per_epoch = int(batches_per_epoch)
        if per_epoch == 0:
            return 0
        n, epoch = 0, 0
        while (max_epochs is None or max_epochs < 0 or epoch < max_epochs) and (max_steps < 0 or n < max_steps):
            if n >= self.keys[-1]:  # past the last switch every epoch has the same number of steps
                per = math.ceil(per_epoch / self.factors[-1])
                epochs_left = math.inf if max_epochs is None or max_epochs < 0 else max_epochs - epoch
                total = min(n + per * epochs_left, max_steps if max_steps >= 0 else math.inf)
                return int(total) if math.isfinite(total) else None  # None: an endless run
            done = 0
            while done < per_epoch:
                k = self.factor_at(n)
                switch = self.next_switch(n)
                until_switch = switch - n if switch is not None else math.inf
                full = min((per_epoch - done) // k, until_switch)
                if full == 0:  # the shorter last window of the epoch
                    done, n = per_epoch, n + 1
                else:
                    done, n = done + int(full) * k, n + int(full)
            epoch += 1
        return min(n, max_steps) if max_steps >= 0 else n
