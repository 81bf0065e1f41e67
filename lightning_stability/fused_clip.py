"""FusedClipMixedPrecision: Lightning's MixedPrecision with ``gradient_clip_val`` for fused optimizers too."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch.optim import Optimizer

from lightning_stability.skips import unscale_if_deferred


class FusedClipMixedPrecision(MixedPrecision):
    """Lightning's ``MixedPrecision`` where ``Trainer(gradient_clip_val=...)`` works for fused optimizers too.

    Lightning raises for fused optimizers (they unscale inside ``step()``) because their gradients are
    still scaled when it would clip. Here they are unscaled first (unless a ledger callback already
    did); torch's ``GradScaler.step`` then passes ``grad_scale=None`` and the overflow flag to the fused
    kernel, so nothing is unscaled twice and overflow steps are still skipped. Checkpoints keep the
    ``MixedPrecision`` key, so they load with or without this plugin.

    Example::

        trainer = L.Trainer(gradient_clip_val=1.0, plugins=[FusedClipMixedPrecision("16-mixed", "cuda")])
    """

    def clip_gradients(
        self,
        optimizer: Optimizer,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        if clip_val > 0 and self.scaler is not None:
            unscale_if_deferred(self.scaler, optimizer)
        # Skip MixedPrecision.clip_gradients (the fused-optimizer refusal): the gradients are unscaled now.
        Precision.clip_gradients(self, optimizer, clip_val, gradient_clip_algorithm)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        own = type(self).__qualname__
        if own in checkpoint:
            checkpoint[MixedPrecision.__qualname__] = checkpoint.pop(own)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        own, base = type(self).__qualname__, MixedPrecision.__qualname__
        if own not in checkpoint and base in checkpoint:
            checkpoint[own] = checkpoint[base]
