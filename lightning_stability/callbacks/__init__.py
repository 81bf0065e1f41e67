"""Thin Lightning adapters, one per concern."""

from lightning_stability.callbacks.accumulation import GradientAccumulation
from lightning_stability.callbacks.grad_norm import GradientNormMonitor
from lightning_stability.callbacks.loss_scale import LossScaleTuner
from lightning_stability.callbacks.lr_schedule import ScheduledLR, WarmupConstantCosineLR

__all__ = ["GradientAccumulation", "GradientNormMonitor", "LossScaleTuner", "ScheduledLR", "WarmupConstantCosineLR"]
