"""Learning-rate multiplier functions: pure arithmetic on the count of applied optimizer updates.

Every function here maps ``step`` -- the number of optimizer updates already applied, which is also
the 0-based index of the update about to be applied -- to a multiplier of the base learning rate.
Skipped updates (loss-scaler overflow, non-finite gradient, spike) are not counted, so they do not
move the curve. Nothing here imports Lightning; the callbacks in
:mod:`lightning_stability.callbacks.lr_schedule` wire these to the Trainer.

Conventions, shared by every schedule:

1. **Warmup** (seed row 5): ``lr = base * min(s / warmup, 1)`` with ``s = step + 1``, the 1-based
   number of the update. The first update therefore uses ``base / warmup`` (never 0) and the last
   warmup update uses the full base LR.
2. **No overlap** (seed row 8): decay starts only after warmup (and the constant phase) ended.
   Decay progress is ``p = (step - decay_start) / decay_steps``: the first decay update still uses
   the peak, and ``p`` reaches 1 at ``step == total_steps``, one past the last update.
3. **Floor**: decays go from 1 down to ``min_lr_ratio``, never below. Warmup is not floored.
4. **Lengths**: a phase length ``< 1`` is a fraction of ``total_steps`` (rounded to the nearest
   step); a length ``>= 1`` is a step count and must be a whole number. Warmup and decay fractions that
   add up to at most 1 fit every run length: where rounding both would overshoot by one step, the decay
   starts where the warmup ends.

Compared with ``transformers`` (``get_linear_schedule_with_warmup``,
``get_cosine_schedule_with_warmup``, ``get_wsd_schedule``, ``get_inverse_sqrt_schedule`` with
``timescale=warmup``): after warmup the multipliers are identical, ``ours(step) == hf(step)``.
During warmup ours is one step ahead, ``ours(step) == hf(step + 1)``, because ``transformers``'
warmup starts from ``0 / warmup`` and so spends the first update at LR 0. The exception is
``get_wsd_schedule`` with ``min_lr_ratio = r > 0``: its warmup is ``r + (1 - r) * step / warmup`` (it
starts at the floor), ours ``(step + 1) / warmup`` whatever the floor, so inside warmup the two differ by
more than a step.

Example::

    >>> [round(warmup_constant_cosine(s, 100, warmup=0.05, decay=0.20), 3) for s in (0, 4, 5, 80, 99)]
    [0.2, 1.0, 1.0, 1.0, 0.006]
"""

from __future__ import annotations

from lightning_stability.schedule_functions import (
    cosine,
    inverse_sqrt,
    linear,
    resolve_steps,
    step_decay,
    warmup_constant_cosine,
)
from lightning_stability.schedule_specs import (
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
    "StepSchedule",
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
