"""The loss-scale rule on host numbers, for steps whose overflow the host already knows.

torch's ``GradScaler.step`` reads the overflow flag on the host (``.item()``) to decide whether to call a
non-fused optimizer's ``step()``. :class:`~lightning_stability.grad_scaler.TunedGradScaler` keeps that read,
and on such steps applies the rule here in Python: no kernel at all, except one fill of the device scale on
the rare step that changes it. :func:`update_scale_host` gives, step for step, the values of the reference
:func:`~lightning_stability.scaling.update_scale` (float32 arithmetic included; tested against it).
"""

from __future__ import annotations

import math
from array import array
from dataclasses import dataclass

from lightning_stability.scaling import ScaleRule


def float32(value: float) -> float:
    """``value`` rounded to the nearest float32 (``inf`` beyond its range), as a device tensor would hold it."""
    return array("f", (value,))[0]


@dataclass
class HostScaleState:
    """The rule's state as host numbers.

    Attributes:
        scale: the loss scale (a float32 value).
        growth_tracker: finite steps since the last growth or overflow.
        hysteresis_tracker: overflows still tolerated before the next backoff (0 and 1 both mean: the next
            overflow backs off).
    """

    scale: float
    growth_tracker: int
    hysteresis_tracker: int


def update_scale_host(state: HostScaleState, overflow: bool, rule: ScaleRule) -> bool:
    """Apply one step of the rule to ``state`` in place. Returns whether ``min_scale`` stopped a backoff (a
    floor hit)."""
    if overflow:
        remaining = max(state.hysteresis_tracker - 1, 0)
        floor_hit = False
        if remaining == 0:
            lowered = float32(state.scale * float32(rule.backoff_factor))
            if rule.min_scale is not None and lowered < float32(rule.min_scale):
                floor_hit, lowered = True, float32(rule.min_scale)
            state.scale = lowered
        state.growth_tracker, state.hysteresis_tracker = 0, remaining
        return floor_hit
    counted = state.growth_tracker + 1
    if counted >= rule.growth_interval:
        raised = float32(state.scale * float32(rule.growth_factor))
        if math.isfinite(raised):
            state.scale = raised
        state.growth_tracker, state.hysteresis_tracker = 0, rule.hysteresis
    else:
        state.growth_tracker = counted
        if rule.consecutive_hysteresis:
            state.hysteresis_tracker = rule.hysteresis
    return False
