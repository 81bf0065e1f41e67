"""LR schedules on the optimizer-update clock.

* ``functions.py``: pure: multiplier functions of the applied-update count (warmup -> constant -> cosine,
  cosine, linear, step, inverse-sqrt), and the conventions every schedule shares.
* ``specs.py``: frozen dataclasses binding a schedule's arguments (what :class:`ScheduledLR` takes); checks of
  a user's own schedule.
* ``callback.py``: :class:`ScheduledLR` and :class:`WarmupConstantCosineLR`, which set each optimizer's LR from
  its own applied-update count; the run length from the Trainer's limits.
"""

from lightning_stability.schedules.callback import ScheduledLR, WarmupConstantCosineLR
from lightning_stability.schedules.functions import (
    cosine,
    inverse_sqrt,
    linear,
    resolve_steps,
    step_decay,
    warmup_constant_cosine,
)
from lightning_stability.schedules.specs import (
    CosineSchedule,
    InverseSqrtSchedule,
    LinearSchedule,
    Schedule,
    StepSchedule,
    WarmupConstantCosineSchedule,
    check_multiplier,
    check_schedule_callable,
)

__all__ = [
    "CosineSchedule",
    "InverseSqrtSchedule",
    "LinearSchedule",
    "Schedule",
    "ScheduledLR",
    "StepSchedule",
    "WarmupConstantCosineLR",
    "WarmupConstantCosineSchedule",
    "check_multiplier",
    "check_schedule_callable",
    "cosine",
    "inverse_sqrt",
    "linear",
    "resolve_steps",
    "step_decay",
    "warmup_constant_cosine",
]
