"""Pure: the batch ramp's rules, on host numbers: when the accumulation factor grows, and the beta2 that follows.

* :func:`grown_factor`: the next factor: ``factor * growth`` (at most ``max_factor``) while the measured critical
  batch is finite and above the current global batch, else ``factor``; never less.
* :func:`beta2_at`: Adam's beta2 at a factor, keeping the half-life of its second-moment average fixed in samples.
  An EMA with ``beta2`` forgets half its weight in ``h = ln(1/2) / ln(beta2)`` steps, ``h B`` samples at batch ``B``;
  at ``B' = B k'/k`` the same ``h B`` samples need ``beta2' = beta2 ** (k'/k)``.
* The LR follows ``GradientAccumulation``'s ``lr_scaling`` (``accumulation/schedule.py``'s ``lr_scale``): ``"sqrt"``
  is the square-root rule for Adam (Malladi et al. 2022), ``"linear"`` Goyal et al.'s for SGD.

Example::

    >>> grown_factor(2, critical_batch=300.0, global_micro_batch=64, max_factor=16, growth=2)
    4
    >>> grown_factor(4, critical_batch=200.0, global_micro_batch=64, max_factor=16, growth=2)
    4
    >>> round(beta2_at(0.95, factor=4, base_factor=2), 6)
    0.9025
"""

from __future__ import annotations

import math

__all__ = ["beta2_at", "grown_factor", "half_life_samples"]


def grown_factor(factor: int, critical_batch: float, global_micro_batch: int, max_factor: int, growth: int) -> int:
    """The accumulation factor after a ramp decision.

    Args:
        factor: micro-batches per optimizer step now.
        critical_batch: the measured critical batch in samples. Never grows on NaN (nothing measured) nor on
            infinity (the averaged ``|G|^2`` is not positive yet: too few steps to tell the gradient from the noise).
        global_micro_batch: samples of one micro-batch on every rank together (micro-batch size x ranks), so the
            global batch is ``factor * global_micro_batch``.
        max_factor: the factor never exceeds it.
        growth: the factor is multiplied by it at each decision that grows it.
    """
    if factor >= max_factor or not math.isfinite(critical_batch) or critical_batch <= factor * global_micro_batch:
        return factor
    return min(max_factor, factor * growth)


def beta2_at(beta2: float, factor: int, base_factor: int) -> float:
    """The beta2 for ``factor`` micro-batches per step when ``beta2`` was set for ``base_factor``: the same
    half-life in samples (``beta2 ** (factor / base_factor)``)."""
    return float(beta2 ** (factor / base_factor))


def half_life_samples(beta2: float, batch: int) -> float:
    """Samples over which an EMA with ``beta2`` at ``batch`` samples per step halves a step's weight."""
    return math.log(0.5) / math.log(beta2) * batch if 0 < beta2 < 1 else math.inf
