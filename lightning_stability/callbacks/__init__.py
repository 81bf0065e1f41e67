"""Thin Lightning adapters, one per concern."""

from lightning_stability.callbacks.grad_norm import GradientNormMonitor

__all__ = ["GradientNormMonitor"]
