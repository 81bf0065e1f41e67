"""Strategies: :class:`StableFSDPStrategy` (registered with Lightning as ``"stable_fsdp"``)."""

from lightning_stability.strategies.fsdp import StableFSDPStrategy
from lightning_stability.strategies.fsdp_checkpoint import consolidate_checkpoint
from lightning_stability.strategies.fsdp_precision import StableFSDPPrecision
from lightning_stability.strategies.tensor_parallel import gpt_block_plan, parallelize_blocks

__all__ = [
    "StableFSDPPrecision",
    "StableFSDPStrategy",
    "consolidate_checkpoint",
    "gpt_block_plan",
    "parallelize_blocks",
]
