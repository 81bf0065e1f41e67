"""The open step's gradients of one optimizer: their norms computed once, clipped by the tightest threshold.

``GradientNormMonitor`` and ``TrainingHealthMonitor`` both read the global gradient norm and may both clip.
Whichever asks first computes the norms (``StepLedger.gradients``); the other reuses them. Each clip scales
the gradients relative to the norm they have *now*, so clipping to several thresholds, in any order, leaves
the gradients at the smallest one, as one clip to it would.
"""

from __future__ import annotations

import math
import weakref

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_stability.norms import clip_by_global_norm_, combine_norms, is_uniform, per_tensor_norms

#: per optimizer: the ids of the parameters that had gradients on its last step, those parameters (held, so the
#: ids stay theirs) and whether their gradients are uniform (``norms.is_uniform``): checked once per set, not
#: per tensor on every step
_UNIFORM: weakref.WeakKeyDictionary[Optimizer, tuple[tuple[int, ...], list[Tensor], bool]] = weakref.WeakKeyDictionary()


def forget_layouts() -> None:
    """Drop what :func:`_uniform` learnt (at each fit's setup): parameters converted to another dtype or moved
    between fits keep their ids and their optimizer."""
    _UNIFORM.clear()


def _uniform(optimizer: Optimizer, key: tuple[int, ...], params: list[Tensor], grads: list[Tensor]) -> bool:
    known = _UNIFORM.get(optimizer)
    if known is None or known[0] != key:
        known = _UNIFORM[optimizer] = (key, list(params), is_uniform(grads))
    return known[2]


class ClipScale:
    """The product of every clip coefficient applied to the open step's gradients so far (``None``: none), and the
    tightest threshold given as a host number (``inf``: none)."""

    def __init__(self) -> None:
        self.coef: Tensor | None = None
        self.fixed = math.inf


class StepGradients:
    """Gradients of ``optimizer`` for the open step, with their norms (0-dim device tensors, no host sync).

    Norms are homogeneous (``||c g|| = c ||g||``), so an object made after another one clipped (a second norm
    type) still reports the norms from before any clip, by dividing out the shared :class:`ClipScale`.

    Attributes:
        params: the parameters that have a gradient.
        grads: their gradients (local shards of sharded ones, scaled in place by :meth:`clip_`).
        norms: per-tensor norms before any clip (globally reduced for sharded tensors).
        total: the global norm before any clip.
    """

    def __init__(self, optimizer: Optimizer, norm_type: float, device: torch.device, clip: ClipScale) -> None:
        self.norm_type = norm_type
        self._clip = clip
        self.params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        self.grads: list[Tensor] = [p.grad for p in self.params]
        #: the parameters' ids: identifies the set of parameters with gradients (callers cache per set)
        self.key = tuple(map(id, self.params))
        self._uniform = bool(self.grads) and _uniform(optimizer, self.key, self.params, self.grads)
        if self.grads:
            self.norms = per_tensor_norms(self.grads, norm_type, self._uniform)
            self.total = combine_norms(self.norms, norm_type)
            if clip.coef is not None:  # measured after a clip: back to the gradients' own norms
                self.norms = self.norms / clip.coef
                self.total = self.total / clip.coef
        else:
            self.norms = torch.zeros(0, dtype=torch.float32, device=device)
            self.total = torch.zeros((), dtype=torch.float32, device=device)

    @property
    def current(self) -> Tensor:
        """The global norm after every clip so far (by any callback)."""
        return self.total if self._clip.coef is None else self.total * self._clip.coef

    @property
    def coefficient(self) -> Tensor | float:
        """The product of the clip coefficients applied so far (1.0 when none)."""
        return 1.0 if self._clip.coef is None else self._clip.coef

    @property
    def fixed_threshold(self) -> float | None:
        """The tightest threshold given as a host number that the step's gradients were clipped to so far, by any
        callback (a fixed clip, such as ``GradientNormMonitor(max_norm)``); ``None``: none."""
        return None if math.isinf(self._clip.fixed) else self._clip.fixed

    def clip_(self, threshold: float | Tensor) -> Tensor:
        """Scale the gradients so that their norm is at most ``threshold``; returns the coefficient applied."""
        if not isinstance(threshold, Tensor):
            self._clip.fixed = min(self._clip.fixed, float(threshold))
        coef = clip_by_global_norm_(self.grads, threshold, total=self.current, uniform=self._uniform)
        self._clip.coef = coef if self._clip.coef is None else self._clip.coef * coef
        return coef
