"""Pure: the batch ramp's rules, on host numbers: when the accumulation factor grows, and the beta2 that follows.

* :func:`grown_factor`: the next factor: ``factor * growth`` (at most ``max_factor``) when the global batch after
  the change is at most ``fraction`` of the measured critical batch's lower bound (the figure less ``confidence``
  standard errors), else ``factor``; never less. McCandlish et al.'s model of equal loss, ``samples = S_min (1 +
  B / B_noise)``, makes a batch at ``fraction`` of the critical batch cost ``fraction`` more samples than a tiny one:
  at ``fraction = 1`` (the batch up to the figure itself) twice as many, which at equal samples is a worse loss.
* :func:`beta2_at`: Adam's beta2 at a factor, keeping the half-life of its second-moment average fixed in samples.
  An EMA with ``beta2`` forgets half its weight in ``h = ln(1/2) / ln(beta2)`` steps, ``h B`` samples at batch ``B``;
  at ``B' = B k'/k`` the same ``h B`` samples need ``beta2' = beta2 ** (k'/k)``.
* The LR follows ``GradientAccumulation``'s ``lr_scaling`` (``accumulation/schedule.py``'s ``lr_scale``): ``"sqrt"``
  is the square-root rule for Adam (Malladi et al. 2022), ``"linear"`` Goyal et al.'s for SGD.

Example::

    >>> grown_factor(2, critical_batch=300.0, global_micro_batch=64, max_factor=16, growth=2)
    4
    >>> grown_factor(4, critical_batch=300.0, global_micro_batch=64, max_factor=16, growth=2)   # 512 > 300
    4
    >>> grown_factor(2, 1200.0, 64, 16, 2, stderr=300.0, fraction=0.25, confidence=2.0)   # 256 > 0.25 x 600
    2
    >>> round(beta2_at(0.95, factor=4, base_factor=2), 6)
    0.9025
"""

from __future__ import annotations

import math

__all__ = ["beta2_at", "grown_factor", "half_life_samples"]


def grown_factor(
    factor: int,
    critical_batch: float,
    global_micro_batch: int,
    max_factor: int,
    growth: int,
    stderr: float = 0.0,
    fraction: float = 1.0,
    confidence: float = 0.0,
) -> int:
    """The accumulation factor after a ramp decision: ``min(max_factor, factor * growth)`` where that global batch
    is at most ``fraction * (critical_batch - confidence * stderr)``, else ``factor``.

    Args:
        factor: micro-batches per optimizer step now.
        critical_batch: the measured critical batch in samples. Never grows on NaN (nothing measured) nor on
            infinity (the averaged ``|G|^2`` is not positive yet: too few steps to tell the gradient from the noise).
        global_micro_batch: samples of one micro-batch on every rank together (micro-batch size x ranks), so the
            global batch is ``factor * global_micro_batch``.
        max_factor: the factor never exceeds it.
        growth: the factor is multiplied by it at each decision that grows it.
        stderr: the critical batch's standard error (NaN or infinite: never grows when ``confidence > 0``).
        fraction: the largest share of the critical batch's lower bound the batch may reach.
        confidence: standard errors taken off the critical batch before the comparison.
    """
    if factor >= max_factor or not math.isfinite(critical_batch):
        return factor
    bound = critical_batch
    if confidence > 0:
        if not math.isfinite(stderr):
            return factor
        bound = critical_batch - confidence * stderr
    new = min(max_factor, factor * growth)
    return new if new * global_micro_batch <= fraction * bound else factor


def beta2_at(beta2: float, factor: int, base_factor: int) -> float:
    """The beta2 for ``factor`` micro-batches per step when ``beta2`` was set for ``base_factor``: the same
    half-life in samples (``beta2 ** (factor / base_factor)``)."""
    return float(beta2 ** (factor / base_factor))


def half_life_samples(beta2: float, batch: int) -> float:
    """Samples over which an EMA with ``beta2`` at ``batch`` samples per step halves a step's weight."""
    return math.log(0.5) / math.log(beta2) * batch if 0 < beta2 < 1 else math.inf
