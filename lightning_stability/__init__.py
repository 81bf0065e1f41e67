"""lightning_stability: keep large-model training with PyTorch Lightning stable.

Names are imported on first use (PEP 562), so ``import lightning_stability`` and the command line's help
do not import torch. The first name taken from the package also registers the ``"stable_fsdp"`` strategy
with Lightning.
"""

from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "FusedClipMixedPrecision": "lightning_stability.fused_clip",
    "GradientAccumulation": "lightning_stability.callbacks.accumulation",
    "GradientNormMonitor": "lightning_stability.callbacks.grad_norm",
    "LossScaleFloorError": "lightning_stability.callbacks.loss_scale",
    "LossScaleTuner": "lightning_stability.callbacks.loss_scale",
    "MemoryPlan": "lightning_stability.planner",
    "ModelShape": "lightning_stability.planner",
    "Outcome": "lightning_stability.ledger",
    "PrecisionDiagnostics": "lightning_stability.diagnostics",
    "Preset": "lightning_stability.presets",
    "ScaleRule": "lightning_stability.scaling",
    "ScheduledLR": "lightning_stability.callbacks.lr_schedule",
    "StabilityConfigError": "lightning_stability.errors",
    "StabilityProgressBar": "lightning_stability.progress",
    "StabilityRichProgressBar": "lightning_stability.progress",
    "StableFSDPPrecision": "lightning_stability.strategies",
    "StableFSDPStrategy": "lightning_stability.strategies",
    "StableTrainer": "lightning_stability.trainer",
    "StepLedger": "lightning_stability.ledger",
    "TrainingDivergedError": "lightning_stability.rollback",
    "TrainingHealthMonitor": "lightning_stability.callbacks.health",
    "TrainingStatus": "lightning_stability.diagnostics",
    "TunedGradScaler": "lightning_stability.grad_scaler",
    "WarmupConstantCosineLR": "lightning_stability.callbacks.lr_schedule",
    "auto_initial_scale": "lightning_stability.scaling",
    "check_training_status": "lightning_stability.diagnostics",
    "consolidate_checkpoint": "lightning_stability.strategies",
    "describe": "lightning_stability.presets",
    "list_presets": "lightning_stability.presets",
    "plan_memory": "lightning_stability.planner",
    "update_scale": "lightning_stability.scaling",
}
__all__ = [
    "FusedClipMixedPrecision",
    "GradientAccumulation",
    "GradientNormMonitor",
    "LossScaleFloorError",
    "LossScaleTuner",
    "MemoryPlan",
    "ModelShape",
    "Outcome",
    "PrecisionDiagnostics",
    "Preset",
    "ScaleRule",
    "ScheduledLR",
    "StabilityConfigError",
    "StabilityProgressBar",
    "StabilityRichProgressBar",
    "StableFSDPPrecision",
    "StableFSDPStrategy",
    "StableTrainer",
    "StepLedger",
    "TrainingDivergedError",
    "TrainingHealthMonitor",
    "TrainingStatus",
    "TunedGradScaler",
    "WarmupConstantCosineLR",
    "auto_initial_scale",
    "check_training_status",
    "consolidate_checkpoint",
    "describe",
    "list_presets",
    "plan_memory",
    "update_scale",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'lightning_stability' has no attribute {name!r}")
    importlib.import_module("lightning_stability.strategies")  # registers "stable_fsdp" with Lightning
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


if "lightning.pytorch" in sys.modules:  # Lightning is loaded already: register the strategy name now
    importlib.import_module("lightning_stability.strategies")

if TYPE_CHECKING:
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
    from lightning_stability.progress import StabilityProgressBar, StabilityRichProgressBar
    from lightning_stability.rollback import TrainingDivergedError
    from lightning_stability.scaling import ScaleRule, auto_initial_scale, update_scale
    from lightning_stability.strategies import StableFSDPPrecision, StableFSDPStrategy, consolidate_checkpoint
    from lightning_stability.trainer import StableTrainer
