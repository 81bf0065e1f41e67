"""lightning_stability: keep large-model training with PyTorch Lightning stable."""

from lightning_stability.callbacks.accumulation import GradientAccumulation
from lightning_stability.callbacks.grad_norm import GradientNormMonitor
from lightning_stability.callbacks.lr_schedule import ScheduledLR, WarmupConstantCosineLR
from lightning_stability.errors import StabilityConfigError
from lightning_stability.ledger import Outcome, StepLedger
from lightning_stability.schedules import (
    CosineSchedule,
    InverseSqrtSchedule,
    LinearSchedule,
    Schedule,
    StepSchedule,
    WarmupConstantCosineSchedule,
)
from lightning_stability.strategies import StableFSDPPrecision, StableFSDPStrategy, consolidate_checkpoint

__all__ = [
    "CosineSchedule",
    "GradientAccumulation",
    "GradientNormMonitor",
    "InverseSqrtSchedule",
    "LinearSchedule",
    "Outcome",
    "Schedule",
    "ScheduledLR",
    "StabilityConfigError",
    "StableFSDPPrecision",
    "StableFSDPStrategy",
    "StepLedger",
    "StepSchedule",
    "WarmupConstantCosineLR",
    "WarmupConstantCosineSchedule",
    "consolidate_checkpoint",
]
__version__ = "0.1.0"
