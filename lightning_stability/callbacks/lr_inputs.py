"""What :class:`~lightning_stability.callbacks.lr_schedule.ScheduledLR` reads from around it: a callback that
scales the LR (:class:`LRScaleSource`), whether an optimizer takes a device tensor as its LR, and the schedule's
name for the callback's ``state_key``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

import lightning.pytorch as pl
from torch.optim import Optimizer

from lightning_stability.schedules import Schedule

ScheduleFn = Callable[[int, "int | None"], float]


@runtime_checkable
class LRScaleSource(Protocol):
    """A callback that contributes a factor to the learning rate (e.g. :class:`GradientAccumulation`).

    :class:`ScheduledLR` looks for one among the Trainer's callbacks and folds it into the one formula
    ``lr = base_lr * schedule(applied) * source.lr_scale_at(applied)``.
    """

    def lr_scale_at(self, applied_steps: int) -> float:
        """The LR factor for the update that follows ``applied_steps`` applied updates."""
        ...

    def estimated_optimizer_steps(self, trainer: pl.Trainer) -> int | None:
        """Optimizer steps in the whole run, when the source changes how batches map to steps."""
        ...


def supports_tensor_lr(optimizer: Optimizer) -> bool:
    """Whether every param group of ``optimizer`` can take a device tensor ``lr`` without host syncs.

    Fused Adam/AdamW/SGD and capturable Adam/AdamW read a tensor LR inside their kernels. The other
    implementations turn it into a Python number once per parameter (a host sync each).
    """
    return all(bool(g.get("fused")) or bool(g.get("capturable")) for g in optimizer.param_groups)


def schedule_name(schedule: Schedule | ScheduleFn) -> str:
    """The schedule's name in the callback's ``state_key``: the same in every process.

    A function's ``repr`` holds its memory address, which changes from run to run: keyed by it, a resumed
    run would not find its saved state (the base LRs) and would take the scheduled LR for the base.
    """
    if isinstance(schedule, Schedule):
        return repr(schedule)
    named = schedule if hasattr(schedule, "__qualname__") else type(schedule)
    return f"{named.__module__}.{named.__qualname__}"
