"""Learning-rate multiplier functions: pure arithmetic on the count of applied optimizer updates.

Every function here maps ``step`` -- the number of optimizer updates already applied, which is also
the 0-based index of the update about to be applied -- to a multiplier of the base learning rate.
Skipped updates (loss-scaler overflow, non-finite gradient, spike) are not counted, so they do not
move the curve. Nothing here imports Lightning; the callbacks in
:mod:`lightning_stability.schedules.callback` wire these to the Trainer.

Conventions, shared by every schedule:

1. **Warmup** (linear): ``lr = base * min(s / warmup, 1)`` with ``s = step + 1``, the 1-based
   number of the update. The first update therefore uses ``base / warmup`` (never 0) and the last
   warmup update uses the full base LR.
2. **No overlap**: decay starts only after warmup (and the constant phase) ended.
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

import math
from collections.abc import Sequence

from lightning_stability.errors import check_int, check_length, check_number, check_ratio, config_error


# ---------------------------------------------------------------------------------------------- helpers
def resolve_steps(length: float, total_steps: int | None, name: str = "length") -> int:
    """A phase length as a step count: a fraction of the run when ``< 1``, a count when ``>= 1``.

    Args:
        length: the fraction (``0 <= length < 1``) or the number of steps (a whole number ``>= 1``).
        total_steps: the run length; needed only for fractions.
        name: the argument name used in error messages.

    Raises:
        StabilityConfigError: a negative or non-whole length, or a fraction without ``total_steps``.

    Example::

        >>> resolve_steps(0.05, 1000), resolve_steps(50, None)
        (50, 50)
    """
    check_length(name, length)
    if length >= 1 or length == 0:
        return int(length)
    if total_steps is None:
        raise config_error(name, length, "is a fraction of the run but the run length is unknown", "pass total_steps")
    return round(length * total_steps)


def _is_fraction(length: float) -> bool:
    return 0 <= length < 1


def _require_total(total_steps: int | None) -> int:
    """The run length, which schedules that decay towards the end of the run cannot do without."""
    if total_steps is None:
        raise config_error("total_steps", None, "is needed by this schedule", "pass total_steps or set max_steps")
    return total_steps


def check_floor(min_lr_ratio: float) -> None:
    check_ratio("min_lr_ratio", min_lr_ratio, "0.0 or 0.1 (10% of the base LR)")


def _warmup(step: int, warmup_steps: int) -> float:
    return (step + 1) / warmup_steps


def _decay(step: int, start: int, length: int, shape: str, min_lr_ratio: float) -> float:
    progress = 1.0 if length <= 0 else min(1.0, max(0.0, (step - start) / length))
    value = 0.5 * (1.0 + math.cos(math.pi * progress)) if shape == "cosine" else 1.0 - progress
    return min_lr_ratio + (1.0 - min_lr_ratio) * value


def _phases(total_steps: int, warmup: float, decay: float | None) -> tuple[int, int, int]:
    """(warmup, constant, decay) step counts; ``decay=None`` means "everything after warmup"."""
    check_int("total_steps", total_steps, 1, "total_steps=10000 (the number of optimizer updates)")
    w = resolve_steps(warmup, total_steps, "warmup")
    if w > total_steps:
        raise config_error(
            "warmup", warmup, f"is longer than the run (total_steps={total_steps})", "shorten the warmup"
        )
    d = total_steps - w if decay is None else resolve_steps(decay, total_steps, "decay")
    if w + d == total_steps + 1 and decay is not None and _is_fraction(warmup) and _is_fraction(decay):
        # Two fractions that add up to at most 1 are rounded one by one, which can overshoot the run by one
        # step (0.1 + 0.9 of 15 steps: 2 + 14). The warmup keeps its length; the decay starts where it ends.
        d = total_steps - w
    if w + d > total_steps:
        raise config_error(
            "warmup + decay",
            f"{w} + {d} steps",
            f"exceeds total_steps={total_steps}: warmup and decay would overlap",
            "shorten one of them (fractions of the run must add up to at most 1)",
        )
    return w, total_steps - w - d, d


# ---------------------------------------------------------------------------------------------- schedules
def warmup_constant_cosine(
    step: int, total_steps: int, warmup: float = 0.05, decay: float = 0.20, min_lr_ratio: float = 0.0
) -> float:
    """Linear warmup, constant, cosine decay over the end of the run (a common recipe at 100B scale).

    Args:
        step: applied updates so far (0-based index of the next update).
        total_steps: number of updates in the run.
        warmup: warmup length (fraction of the run or step count); default 5%.
        decay: cosine-decay length at the end of the run; default 20%. ``warmup=0.05, decay=0.95``
            is plain cosine with warmup (the ``175b`` preset).
        min_lr_ratio: the floor of the decay, as a fraction of the base LR.

    Raises:
        StabilityConfigError: bad lengths, or warmup and decay that would overlap.
    """
    check_floor(min_lr_ratio)
    w, c, d = _phases(total_steps, warmup, decay)
    if step < w:  # 1) linear warmup
        return _warmup(step, w)
    if step < w + c:  # 2) constant at the peak
        return 1.0
    return _decay(step, w + c, d, "cosine", min_lr_ratio)  # 3) cosine down to the floor


def cosine(step: int, total_steps: int, warmup: float = 0.0, min_lr_ratio: float = 0.0) -> float:
    """Linear warmup, then cosine decay from the peak to ``min_lr_ratio`` over the rest of the run.

    Args:
        step: applied updates so far.
        total_steps: number of updates in the run.
        warmup: warmup length (fraction or step count).
        min_lr_ratio: the floor, as a fraction of the base LR.
    """
    return _warmup_then_decay(step, total_steps, warmup, min_lr_ratio, "cosine")


def linear(step: int, total_steps: int, warmup: float = 0.0, min_lr_ratio: float = 0.0) -> float:
    """Linear warmup, then linear decay from the peak to ``min_lr_ratio`` over the rest of the run (arguments as
    :func:`cosine`)."""
    return _warmup_then_decay(step, total_steps, warmup, min_lr_ratio, "linear")


def _warmup_then_decay(step: int, total_steps: int, warmup: float, min_lr_ratio: float, shape: str) -> float:
    check_floor(min_lr_ratio)
    w, _, d = _phases(total_steps, warmup, None)
    return _warmup(step, w) if step < w else _decay(step, w, d, shape, min_lr_ratio)


def _check_step_args(gamma: float, every: float | None, milestones: Sequence[float], min_lr_ratio: float) -> None:
    check_floor(min_lr_ratio)
    check_number("gamma", gamma, 0.0, 1.0, example="0.1 (divide the LR by 10 at each drop)", high_inclusive=True)
    if not isinstance(milestones, (list, tuple)):
        raise config_error(
            "milestones", milestones, "must be a list of update counts or fractions", "pass e.g. [1000, 2000]"
        )
    if (every is None) == (not milestones):
        raise config_error(
            "every/milestones",
            (every, tuple(milestones)),
            "must give exactly one of the two",
            "pass every=1000 or milestones=[...]",
        )
    _check_lengths({"every": every, **{f"milestones[{i}]": m for i, m in enumerate(milestones)}})
    if every is not None and every == 0:
        raise config_error("every", every, "must be > 0", "pass e.g. every=1000 (updates) or 0.3 (of the run)")


def step_decay(
    step: int,
    gamma: float,
    every: float | None = None,
    milestones: Sequence[float] = (),
    warmup: float = 0.0,
    min_lr_ratio: float = 0.0,
    total_steps: int | None = None,
) -> float:
    """Linear warmup, then multiply by ``gamma`` every ``every`` updates or at each of ``milestones``.

    ``every`` counts from the end of warmup (the first drop comes ``every`` updates after it);
    ``milestones`` are absolute update indices (or fractions of the run): from update ``m`` on, one
    more factor ``gamma`` applies. Milestones inside the warmup are an error (no decay during warmup).

    Args:
        step: applied updates so far.
        gamma: the factor per drop, in (0, 1].
        every: drop period (fraction or step count); give this or ``milestones``.
        milestones: drop points (fractions or step counts).
        warmup: warmup length (fraction or step count).
        min_lr_ratio: the floor, as a fraction of the base LR.
        total_steps: the run length; needed only when a length is a fraction.

    Raises:
        StabilityConfigError: bad ``gamma``, both or neither of ``every``/``milestones``, a milestone
            inside the warmup.
    """
    _check_step_args(gamma, every, milestones, min_lr_ratio)
    w = resolve_steps(warmup, total_steps, "warmup")
    if step < w:
        return _warmup(step, w)
    if every is not None:
        # a fraction of a very short run still drops at most once per update
        period = max(1, resolve_steps(every, total_steps, "every")) if _is_fraction(every) else int(every)
        drops = (step - w) // period
    else:
        points = sorted(resolve_steps(m, total_steps, "milestones") for m in milestones)
        if points[0] < w:
            raise config_error(
                "milestones",
                list(milestones),
                f"has a drop at step {points[0]}, inside the {w}-step warmup",
                "move the milestones after the warmup",
            )
        drops = sum(1 for m in points if step >= m)
    return max(min_lr_ratio, gamma**drops)


def inverse_sqrt(step: int, warmup: float = 0.0, min_lr_ratio: float = 0.0, total_steps: int | None = None) -> float:
    """Linear warmup, then ``sqrt(warmup / step)``: continuous at the end of warmup, ``∝ 1/√step`` after.

    Without warmup the multiplier is ``1 / sqrt(step + 1)`` (1 on the first update). The curve has no
    end, so ``total_steps`` is needed only for a fractional warmup.

    Args:
        step: applied updates so far.
        warmup: warmup length (fraction or step count).
        min_lr_ratio: the floor, as a fraction of the base LR.
        total_steps: the run length; needed only when ``warmup`` is a fraction.
    """
    check_floor(min_lr_ratio)
    w = resolve_steps(warmup, total_steps, "warmup")
    if step < w:
        return _warmup(step, w)
    value = math.sqrt(w / step) if w > 0 else 1.0 / math.sqrt(step + 1)
    return max(min_lr_ratio, value)


def _check_lengths(values: dict[str, float | None]) -> None:
    for name, value in values.items():
        if value is not None:
            check_length(name, value)
