"""The LR that GradientAccumulation writes when no LR schedule does: ``base * scale(k)`` per param group.

No Lightning import: the callback says when a run starts, which factor each window has, and when a
search (Lightning's LR finder) may have written a new LR.
"""

from __future__ import annotations

from torch.optim import Optimizer

from lightning_stability.accumulation_schedule import lr_scale

__all__ = ["AccumulationLR"]


class AccumulationLR:
    """Writes ``base_lr * lr_scale(k, scaling)`` into each param group whenever the factor ``k`` changes.

    The base LRs are read once per run from the optimizer (the LR ``configure_optimizers`` set, for one
    micro-batch), unless a checkpoint supplied them (:attr:`base_lrs`).
    """

    def __init__(self, scaling: str) -> None:
        self.scaling = scaling
        self.active = False  # this callback writes the LR (no ScheduledLR folds the scaling in)
        self.base_lrs: list[float] = []
        self._factor: int | None = None  # the factor whose scale is in the param groups

    def reset(self) -> None:
        """At setup: forget the previous run (a checkpoint loaded afterwards refills :attr:`base_lrs`)."""
        self.base_lrs, self._factor = [], None

    def start(self, optimizer: Optimizer, active: bool) -> None:
        """At train start: read the base LRs unless a checkpoint gave them."""
        self.active = active
        if active and not self.base_lrs:
            # HOST SYNC (once): a user-supplied tensor LR is read on the host here.
            self.base_lrs = [float(g["lr"]) for g in optimizer.param_groups]
        self._factor = None

    def set_factor(self, optimizer: Optimizer, k: int) -> None:
        """At a window start: write the LR of factor ``k`` if it is not already in the param groups."""
        if self.active and k != self._factor:
            scale = lr_scale(k, self.scaling)
            for group, base in zip(optimizer.param_groups, self.base_lrs, strict=True):
                group["lr"] = base * scale
            self._factor = k

    def adopt_written(self, optimizer: Optimizer | None) -> None:
        """After a search during training: an LR it wrote (not ours) becomes the base for one micro-batch.

        A search before train start (``Tuner.lr_find``, ``LearningRateFinder`` at fit start) leaves its LR
        in the optimizer for :meth:`start` to read; then there is nothing to do here.
        """
        if not (self.active and self.base_lrs and self._factor is not None and optimizer is not None):
            return
        written = [base * lr_scale(self._factor, self.scaling) for base in self.base_lrs]
        current = [float(g["lr"]) for g in optimizer.param_groups]
        if current != written:  # the next window scales the new base
            self.base_lrs, self._factor = current, None
