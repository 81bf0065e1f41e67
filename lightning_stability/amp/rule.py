"""The fp16 dynamic loss-scale rule: growth, backoff, hysteresis and a floor, as pure functions.

Nothing here touches a scaler or a Trainer. :func:`update_scale` takes tensors and returns new ones and
:func:`update_scale_` updates them in place, so the rule runs on the device with no host sync.
:func:`update_scale_host` is the same rule on host numbers, for steps whose overflow the host already knows:
torch's ``GradScaler.step`` reads the overflow flag on the host (``.item()``) to decide whether to call a
non-fused optimizer's ``step()``, and :class:`~lightning_stability.amp.scaler.TunedGradScaler` reuses that read.
Step for step it gives the values of :func:`update_scale`, float32 arithmetic included. Each function is
unit-tested step by step.

The rule, once per optimizer step, given ``found_inf`` (the scaled gradients held an inf/NaN):

1. **Overflow.** The growth tracker restarts at 0 and the hysteresis tracker (overflows still
   tolerated) drops by one. When it reaches 0 the scale is multiplied by ``backoff_factor``, but
   never below ``min_scale``; once exhausted, every further overflow backs off until the next growth.
2. **Finite step.** The growth tracker counts up; after ``growth_interval`` finite steps in a row the
   scale is multiplied by ``growth_factor`` (unless that would overflow fp32, as in torch), the
   tracker restarts and the hysteresis tracker is refilled to ``hysteresis``. With
   ``consecutive_hysteresis`` every finite step refills it (DeepSpeed's option of that name).

The step itself is skipped on *every* overflow; hysteresis only delays shrinking the scale, so a
single bad batch does not halve it. ``hysteresis=1`` with ``min_scale=None`` is exactly torch's
``GradScaler`` (``torch._amp_update_scale_``); ``hysteresis=2, min_scale=1`` is Megatron-LM's
``DynamicGradScaler`` and DeepSpeed's ``DynamicLossScaler``.

:func:`auto_initial_scale` picks a first scale from a measured gradient magnitude: the largest
power of two that keeps ``headroom * max|grad| * scale`` inside fp16's largest finite value, 65504.
"""

from __future__ import annotations

import math
from array import array
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from lightning_stability import _compat
from lightning_stability.errors import check_bool, check_int, check_number

FP16_MAX = 65504.0
"""The largest finite float16 value (IEEE 754 half precision: the fp16 range is ±65504)."""

AUTO_MAX_SCALE = 2.0**32
"""Upper bound of an automatic initial scale: Megatron-LM's ``--initial-loss-scale`` default."""

AUTO_EMPTY_SCALE = 2.0**24
"""Automatic initial scale when every probed gradient was zero: at a probe scale of 1 nothing was
at least fp16's smallest subnormal, 2**-24, so a scale of 2**24 keeps the largest gradient below 1."""


@dataclass(frozen=True)
class ScaleRule:
    """The settings of the update rule. Every field is checked on construction.

    Attributes:
        growth_factor: multiply the scale by this after ``growth_interval`` finite steps (> 1).
        backoff_factor: multiply the scale by this on a backoff (in (0, 1)).
        growth_interval: finite steps in a row before the scale grows (int >= 1).
        hysteresis: overflows tolerated before the scale backs off (int >= 1; 1 = back off at once).
        min_scale: the floor of the scale; ``None`` for no floor (torch's behaviour).
        consecutive_hysteresis: refill the hysteresis tracker after every finite step, not only
            after a growth.
    """

    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    hysteresis: int = 2
    min_scale: float | None = 1.0
    consecutive_hysteresis: bool = False

    def __post_init__(self) -> None:
        check_number("growth_factor", self.growth_factor, 1.0, example="2.0")
        check_number("backoff_factor", self.backoff_factor, 0.0, 1.0, example="0.5")
        for name in ("growth_interval", "hysteresis"):
            value = getattr(self, name)
            example = "2000 (torch) or 1000 (Megatron-LM, DeepSpeed)" if name == "growth_interval" else "2"
            check_int(name, value, 1, example)
        if self.min_scale is not None:
            check_number("min_scale", self.min_scale, 0.0, example="1.0, or None")
        check_bool("consecutive_hysteresis", self.consecutive_hysteresis)


class ScaleState(NamedTuple):
    """The rule's state, three 0-dim tensors on one device.

    Attributes:
        scale: the loss scale (float32).
        growth_tracker: finite steps since the last growth or overflow (int32).
        hysteresis_tracker: overflows still tolerated before the next backoff (int32).
    """

    scale: Tensor
    growth_tracker: Tensor
    hysteresis_tracker: Tensor


class ScaleUpdate(NamedTuple):
    """The result of one :func:`update_scale`.

    Attributes:
        state: the new state.
        overflow: whether this step overflowed, i.e. ``found_inf != 0`` (bool tensor).
        backed_off: whether the scale was multiplied by ``backoff_factor`` (bool tensor).
        floor_hit: whether ``min_scale`` stopped a backoff, i.e. the scale would have gone below
            the floor (bool tensor; always false without a floor).
    """

    state: ScaleState
    overflow: Tensor
    backed_off: Tensor
    floor_hit: Tensor


def initial_state(scale: float, rule: ScaleRule, device: torch.device | str = "cpu") -> ScaleState:
    """A fresh state: ``scale``, no finite steps counted, the full hysteresis to spend."""
    return ScaleState(
        torch.full((), float(scale), dtype=torch.float32, device=device),
        torch.zeros((), dtype=torch.int32, device=device),
        torch.full((), rule.hysteresis, dtype=torch.int32, device=device),
    )


def update_scale(state: ScaleState, found_inf: Tensor, rule: ScaleRule) -> ScaleUpdate:
    """Apply one step of the rule (see the module docstring). No host sync; inputs are not modified.

    Args:
        state: the current state.
        found_inf: nonzero when this step's gradients overflowed (any dtype, 0-dim, same device).
        rule: the settings.

    Returns:
        The new state, and whether the step overflowed, the scale backed off, the floor stopped it.

    Example::

        rule = ScaleRule(hysteresis=2, growth_interval=2000)
        state = initial_state(2.0**16, rule)
        state, overflow, backed_off, floor_hit = update_scale(state, torch.tensor(1.0), rule)  # tolerated
    """
    scale, growth, hyst = state
    overflow = found_inf != 0
    if overflow.device != scale.device:
        overflow = overflow.to(scale.device, non_blocking=True)

    # 1. overflow: spend one unit of hysteresis; back off once it is used up
    remaining = torch.clamp(hyst - 1, min=0)
    backed_off = overflow & (remaining == 0)
    lowered = scale * rule.backoff_factor
    if rule.min_scale is not None:
        floor_hit = backed_off & (lowered < rule.min_scale)
        lowered = torch.clamp(lowered, min=rule.min_scale)
    else:
        floor_hit = torch.zeros_like(backed_off)

    # 2. finite step: count; grow after `growth_interval` in a row (only to a finite value)
    counted = growth + 1
    grow = counted >= rule.growth_interval
    raised = scale * rule.growth_factor
    raised = torch.where(torch.isfinite(raised), raised, scale)

    new_scale = torch.where(overflow, torch.where(backed_off, lowered, scale), torch.where(grow, raised, scale))
    new_growth = torch.where(overflow | grow, 0, counted)
    refilled = (
        torch.full_like(hyst, rule.hysteresis)
        if rule.consecutive_hysteresis
        else torch.where(grow, rule.hysteresis, hyst)
    )
    new_hyst = torch.where(overflow, remaining, refilled)
    return ScaleUpdate(ScaleState(new_scale, new_growth, new_hyst), overflow, backed_off, floor_hit)


class FusedScaleState(NamedTuple):
    """The state :func:`update_scale_` updates in place: tensors on one device.

    Attributes:
        scale: the loss scale (0-dim float32, a view of ``pair``; a scaler adopts it as its ``_scale``).
        growth_tracker: finite steps since the last growth or overflow (0-dim int32; a scaler's own tracker).
        hysteresis_tracker: overflows still tolerated, in ``[1, hysteresis]`` (0-dim float32, a view of ``pair``):
            at 1 the next overflow backs off, so the reference's 0 and 1 are one state here.
        pair: ``[scale, hysteresis_tracker]``, so that one ``clamp`` applies the bounds of both.
        lower: ``[min_scale, 1]`` (float32; ``min_scale`` is 0 without a floor).
        upper: ``[inf, hysteresis]`` (float32).
        refill_tracker: a copy of ``growth_tracker`` that the same kernel advances (0-dim int32); it tells
            the refill when the scale grows. Keep it equal to ``growth_tracker`` when setting that by hand.
        flag_tracker: scratch of the single-step kernel calls (0-dim int32, 0 between calls).
        floor_test: ``[inf, min_scale]`` (float32; ``[inf, 0]`` without a floor): a scale below each entry
            counts as ``[an overflow, a floor hit]``.
        below: scratch for that test (float32, two entries).
    """

    scale: Tensor
    growth_tracker: Tensor
    hysteresis_tracker: Tensor
    pair: Tensor
    lower: Tensor
    upper: Tensor
    refill_tracker: Tensor
    flag_tracker: Tensor
    floor_test: Tensor
    below: Tensor


def fused_state(scale: Tensor, growth_tracker: Tensor, hysteresis_tracker: float, rule: ScaleRule) -> FusedScaleState:
    """A :class:`FusedScaleState` following ``rule``, starting at the value of ``scale`` and
    ``hysteresis_tracker`` (brought into ``[1, rule.hysteresis]``), around an existing ``growth_tracker``."""
    device = growth_tracker.device
    pair = torch.empty(2, dtype=torch.float32, device=device)
    pair[0].copy_(scale)
    pair[1].fill_(min(max(float(hysteresis_tracker), 1.0), float(rule.hysteresis)))

    def vector() -> Tensor:
        return torch.zeros(2, dtype=torch.float32, device=device)

    state = FusedScaleState(
        pair[0],
        growth_tracker,
        pair[1],
        pair,
        vector(),
        vector(),
        growth_tracker.clone(),
        torch.zeros((), dtype=torch.int32, device=device),
        vector(),
        vector(),
    )
    adopt_rule_(state, rule)
    return state


def adopt_rule_(state: FusedScaleState, rule: ScaleRule) -> None:
    """Make ``state`` follow a changed ``rule``: its bounds, and the refill started afresh (the refill's tracker
    follows the growth tracker only under some rules)."""
    floor = float(rule.min_scale) if rule.min_scale is not None else 0.0
    # fills, not tensors made from host numbers: on a GPU those would be host-to-device copies
    state.lower[0].fill_(floor)
    state.lower[1].fill_(1.0)
    state.upper[0].fill_(math.inf)
    state.upper[1].fill_(float(rule.hysteresis))
    state.floor_test[0].fill_(math.inf)
    state.floor_test[1].fill_(floor)
    state.refill_tracker.copy_(state.growth_tracker)


def update_scale_(state: FusedScaleState, found_inf: Tensor, rule: ScaleRule, counts: Tensor, out: Tensor) -> None:
    """:func:`update_scale` in place, built on torch's fused ``_amp_update_scale_``: what the scaler runs.

    torch's ``_amp_update_scale_(scale, tracker, flag, growth, backoff, interval)`` multiplies ``scale`` by
    ``backoff`` when ``flag != 0``; otherwise it counts, and multiplies by ``growth`` when the count
    reaches ``interval``. The rule uses it three times:

    1. the growth half, as torch's scaler does, with no backoff;
    2. the backoff, through the kernel's growth branch with ``interval=1``: that branch runs exactly
       when its flag is 0, and the flag ``hysteresis_tracker - found_inf`` is 0 exactly for the overflow
       that hysteresis no longer tolerates (the tracker never drops below 1);
    3. the refill of the hysteresis tracker: multiplied by ``hysteresis`` on the step the scale grows (its
       tracker mirrors the growth tracker), or on every finite step with ``consecutive_hysteresis``.

    Before the bounds, a scale below ``min_scale`` is a floor hit. Then one ``clamp`` of
    ``[scale, hysteresis_tracker]`` between ``[min_scale, 1]`` and ``[inf, hysteresis]`` applies the floor of
    the scale and brings the tracker back into range: one less after an overflow (never below 1), the full
    hysteresis after a refill. Step for step the same scales, growth trackers and counts as
    :func:`update_scale` (tested against it), with no host sync.

    Args:
        state: the state, updated in place.
        found_inf: 0-dim float32 tensor, 1.0 when this step's gradients overflowed, else 0.0 (what
            torch's unscale writes).
        rule: the settings (``state`` must follow them: see :func:`adopt_rule_`).
        counts: ``[overflow steps, floor hits]`` before this step (float32).
        out: receives ``counts`` plus this step's (float32, the shape of ``counts``; may be ``counts``).
    """
    scale, tracker = state.scale, state.hysteresis_tracker
    tracker.sub_(found_inf)  # 0 exactly for the overflow that backs off
    _compat.amp_update_scale_(scale, state.growth_tracker, found_inf, rule.growth_factor, 1.0, rule.growth_interval)
    _compat.amp_update_scale_(scale, state.flag_tracker, tracker, rule.backoff_factor, 1.0, 1)
    torch.addcmul(counts, found_inf, torch.lt(scale, state.floor_test, out=state.below), out=out)
    if rule.hysteresis > 1:  # else the tracker stays 1: every overflow backs off
        hysteresis = float(rule.hysteresis)
        if rule.consecutive_hysteresis:
            _compat.amp_update_scale_(tracker, state.flag_tracker, found_inf, hysteresis, 1.0, 1)
        else:
            _compat.amp_update_scale_(tracker, state.refill_tracker, found_inf, hysteresis, 1.0, rule.growth_interval)
    torch.clamp(state.pair, state.lower, state.upper, out=state.pair)


def auto_initial_scale(
    max_abs_grad: Tensor,
    headroom: float = 8.0,
    min_scale: float | None = None,
    max_scale: float = AUTO_MAX_SCALE,
    empty_scale: float = AUTO_EMPTY_SCALE,
) -> Tensor:
    """The largest power of two ``s`` with ``headroom * max_abs_grad * s <= 65504`` (no host sync).

    Args:
        max_abs_grad: the largest absolute unscaled gradient value (0-dim tensor, finite, >= 0).
        headroom: safety factor for values larger than the measured gradients (activation
            gradients, later steps); 8 leaves three powers of two.
        min_scale: lower bound of the result (the rule's floor), if any.
        max_scale: upper bound of the result.
        empty_scale: the result when ``max_abs_grad`` is 0 (nothing measurable).

    Returns:
        A 0-dim float32 tensor on the device of ``max_abs_grad``.

    Example::

        auto_initial_scale(torch.tensor(100.0))  # 2**6 = 64: 8 * 100 * 64 = 51200 <= 65504
    """
    peak = max_abs_grad.to(torch.float32)
    need = headroom * torch.where(peak > 0, peak, torch.ones_like(peak))  # what one unit of scale costs
    scale = torch.exp2(torch.floor(torch.log2(FP16_MAX / need)))
    # log2 rounds in float32: step one power of two down or up where it landed on the wrong side
    scale = torch.where(need * scale > FP16_MAX, scale * 0.5, scale)
    scale = torch.where(need * scale * 2 <= FP16_MAX, scale * 2, scale)
    scale = torch.where(peak > 0, scale, torch.full_like(scale, empty_scale))
    scale = torch.clamp(scale, max=max_scale)
    if min_scale is not None:
        scale = torch.clamp(scale, min=min_scale)
    return scale


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
