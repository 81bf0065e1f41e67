"""The open step's gradients of one optimizer: their norms computed once, clipped by the tightest threshold.

``GradientNormMonitor`` and ``TrainingHealthMonitor`` both read the global gradient norm and may both clip.
Whichever asks first computes the norms (``StepLedger.gradients``); the other reuses them. Each clip scales
the gradients relative to the norm they have *now*, so clipping to several thresholds, in any order, leaves
the gradients at the smallest one, as one clip to it would.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_stability.norms import clip_coefficient, combine_norms, per_tensor_norms, scale_


class StepGradients:
    """Gradients of ``optimizer`` for the open step, with their norms (0-dim device tensors, no host sync).

    Attributes:
        params: the parameters that have a gradient.
        grads: their gradients (local shards of sharded ones, scaled in place by :meth:`clip_`).
        norms: per-tensor norms before any clip (globally reduced for sharded tensors).
        total: the global norm before any clip.
        current: the global norm after the clips so far.
    """

    def __init__(self, optimizer: Optimizer, norm_type: float, device: torch.device) -> None:
        self.norm_type = norm_type
        self.params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        self.grads: list[Tensor] = [p.grad for p in self.params]
        if self.grads:
            self.norms = per_tensor_norms(self.grads, norm_type)
            self.total = combine_norms(self.norms, norm_type)
        else:
            self.norms = torch.zeros(0, dtype=torch.float32, device=device)
            self.total = torch.zeros((), dtype=torch.float32, device=device)
        self.current = self.total

    def clip_(self, threshold: float | Tensor) -> Tensor:
        """Scale the gradients so that their norm is at most ``threshold``; returns the coefficient applied."""
        coef = clip_coefficient(self.current, threshold)  # type: ignore[arg-type]
        if self.grads:
            scale_(self.grads, coef)
        self.current = self.current * coef
        return coef
