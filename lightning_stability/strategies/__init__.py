"""Strategies: :class:`StableFSDPStrategy` (registered with Lightning as ``"stable_fsdp"``)."""

from lightning_stability.strategies.fsdp import StableFSDPStrategy
from lightning_stability.strategies.fsdp_checkpoint import consolidate_checkpoint
from lightning_stability.strategies.fsdp_precision import StableFSDPPrecision

__all__ = ["StableFSDPPrecision", "StableFSDPStrategy", "consolidate_checkpoint"]
