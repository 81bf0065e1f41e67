"""Pure: the gradient noise scale of McCandlish et al. 2018 ("An Empirical Model of Large-Batch Training",
appendix A.1), from two gradients of one step at two batch sizes, each part smoothed before the ratio.

A gradient over ``b`` samples, ``G_b``, has ``E|G_b|^2 = |G|^2 + tr(Sigma) / b``, with ``G`` the true gradient and
``Sigma`` the per-sample covariance. Two of them, at ``b_small < b_big``, give unbiased estimates of both parts
(:func:`two_batch_estimates`); the ratio ``B_simple = tr(Sigma) / |G|^2`` is the critical batch in samples. One step's
estimates are very noisy and the ratio of two noisy numbers is biased, so each part is averaged by an exponential
moving average first and the ratio taken of the averages (:func:`ema_update`, :func:`critical_batch`).

FairScale's AdaScale gain (``accumulation/adascale.py``) is the same estimator with ``b_small`` one micro-batch and
``b_big`` all of a step's: its ``grad_var`` is ``tr(Sigma)`` and its ``grad_sqr`` is ``|G|^2`` per micro-batch, and
its gain is ``(B_simple/b + 1) / (B_simple/(S b) + 1)`` for ``S`` micro-batches of ``b`` samples.

Everything here is a tensor op on the gradients' device: no host read.

Example::

    >>> small, big = torch.tensor(5.0), torch.tensor(2.0)   # |G_b|^2 at b = 4, |G_B|^2 at B = 16
    >>> g2, trace = two_batch_estimates(small, big, 4, 16)
    >>> float(g2), float(trace)
    (1.0, 16.0)
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["FIELDS", "critical_batch", "ema_update", "new_state", "two_batch_estimates"]

#: the moving averages kept, in the order of the state vector: the EMA of 1 (its bias correction) and of its
#: squared weights (for the effective number of steps averaged), of |G|^2, of tr(Sigma), and of their squares and
#: product (for the uncertainty)
FIELDS = ("weight", "weight_sq", "g2", "trace", "g2_sq", "trace_sq", "g2_trace")


def two_batch_estimates(small_sq: Tensor, big_sq: Tensor, small: float, big: float) -> tuple[Tensor, Tensor]:
    """Unbiased estimates of ``|G|^2`` and ``tr(Sigma)`` from ``small_sq = |G_small|^2`` and ``big_sq = |G_big|^2``,
    gradients (means over their samples) of ``small < big`` samples:

    ``|G|^2 = (big |G_big|^2 - small |G_small|^2) / (big - small)``,
    ``tr(Sigma) = (|G_small|^2 - |G_big|^2) / (1/small - 1/big)``.
    """
    if not 0 < small < big:
        raise ValueError(f"two_batch_estimates: needs 0 < small < big, got small={small}, big={big}")
    g2 = (big * big_sq - small * small_sq) / (big - small)
    trace = (small_sq - big_sq) / (1.0 / small - 1.0 / big)
    return g2, trace


def new_state(device: torch.device | str | None = None) -> Tensor:
    """The moving averages before any step: zeros, one per :data:`FIELDS`, float32."""
    return torch.zeros(len(FIELDS), dtype=torch.float32, device=device)


def ema_update(state: Tensor, g2: Tensor, trace: Tensor, decay: float, valid: Tensor | bool = True) -> Tensor:
    """``state`` after one step's estimates (a new tensor): each average ``a <- decay a + (1 - decay) x``; the weight
    of squared weights ``q <- decay^2 q + (1 - decay)^2``. Where ``valid`` is false (a skipped update) or an estimate
    is not finite (an fp16 overflow) the state is returned unchanged, decided on the device."""
    d = decay
    g2, trace = g2.float(), trace.float()
    sample = torch.stack([g2, trace, g2 * g2, trace * trace, g2 * trace])
    weight = state[:1] * d + (1.0 - d)
    weight_sq = state[1:2] * (d * d) + (1.0 - d) ** 2
    updated = torch.cat([weight, weight_sq, state[2:] * d + (1.0 - d) * sample])
    ok = torch.isfinite(g2) & torch.isfinite(trace)
    if isinstance(valid, Tensor):
        ok = ok & valid
    elif not valid:
        return state
    return torch.where(ok, updated, state)


def critical_batch(state: Tensor) -> tuple[Tensor, Tensor]:
    """``B_simple = tr(Sigma) / |G|^2`` of the averages in ``state`` (in the unit of the batch sizes given to
    :func:`two_batch_estimates`), and its standard error; 0-dim tensors.

    The standard error is the delta method's for a ratio of two means, ``B sqrt((var_t / t^2 + var_g / g^2 -
    2 cov / (t g)) / n)``, with the variances and covariance of the per-step estimates from their averaged squares
    and ``n`` the effective number of steps the averages hold (Kish: ``weight^2 / weight_sq``). It treats the steps
    as independent: consecutive steps share most of their weights, so it is a lower bound of the real error, and it
    says nothing of the estimator's bias (a small batch much below ``B_simple`` is needed to resolve it).

    ``B_simple`` is infinite where the averaged ``|G|^2`` is not positive (the noise hides the gradient: larger
    batches still help), and NaN before any step was averaged.
    """
    weight, weight_sq, g2, trace, g2_sq, trace_sq, g2_trace = state.unbind(0)
    g = g2 / weight
    t = trace / weight
    var_g = (g2_sq / weight - g * g).clamp_min(0.0)
    var_t = (trace_sq / weight - t * t).clamp_min(0.0)
    cov = g2_trace / weight - g * t
    n = weight * weight / weight_sq
    unseen = torch.where(weight > 0, torch.full_like(g, float("inf")), torch.full_like(g, float("nan")))
    ratio = torch.where(g > 0, t / g, unseen)
    rel_var = (var_t / (t * t) + var_g / (g * g) - 2.0 * cov / (t * g)).clamp_min(0.0) / n
    stderr = torch.where(g > 0, ratio.abs() * rel_var.sqrt(), unseen)
    return ratio, stderr
