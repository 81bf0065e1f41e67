"""lightning_stability: keep large-model training with PyTorch Lightning stable."""

from lightning_stability.callbacks.accumulation import GradientAccumulation
from lightning_stability.callbacks.grad_norm import GradientNormMonitor
from lightning_stability.callbacks.health import TrainingHealthMonitor
from lightning_stability.callbacks.loss_scale import LossScaleFloorError, LossScaleTuner
from lightning_stability.callbacks.lr_schedule import ScheduledLR, WarmupConstantCosineLR
from lightning_stability.diagnostics import PrecisionDiagnostics, TrainingStatus, check_training_status
from lightning_stability.errors import StabilityConfigError
from lightning_stability.fused_clip import FusedClipMixedPrecision
from lightning_stability.grad_scaler import TunedGradScaler
from lightning_stability.ledger import Outcome, StepLedger
from lightning_stability.planner import MemoryPlan, ModelShape, plan_memory
from lightning_stability.presets import Preset, describe, list_presets
from lightning_stability.rollback import TrainingDivergedError
from lightning_stability.scaling import ScaleRule, auto_initial_scale, update_scale
from lightning_stability.schedules import (
    CosineSchedule,
    InverseSqrtSchedule,
    LinearSchedule,
    Schedule,
    StepSchedule,
    WarmupConstantCosineSchedule,
)
from lightning_stability.strategies import StableFSDPPrecision, StableFSDPStrategy, consolidate_checkpoint
from lightning_stability.trainer import StableTrainer

__all__ = [
    "CosineSchedule",
    "FusedClipMixedPrecision",
    "GradientAccumulation",
    "GradientNormMonitor",
    "InverseSqrtSchedule",
    "LinearSchedule",
    "LossScaleFloorError",
    "LossScaleTuner",
    "MemoryPlan",
    "ModelShape",
    "Outcome",
    "Preset",
    "PrecisionDiagnostics",
    "ScaleRule",
    "Schedule",
    "ScheduledLR",
    "StabilityConfigError",
    "StableFSDPPrecision",
    "StableFSDPStrategy",
    "StableTrainer",
    "StepLedger",
    "TrainingDivergedError",
    "TrainingHealthMonitor",
    "StepSchedule",
    "TrainingStatus",
    "TunedGradScaler",
    "WarmupConstantCosineLR",
    "WarmupConstantCosineSchedule",
    "auto_initial_scale",
    "check_training_status",
    "consolidate_checkpoint",
    "describe",
    "list_presets",
    "plan_memory",
    "update_scale",
]
__version__ = "0.1.0"
