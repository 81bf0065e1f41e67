"""lightning_stability: keep large-model training with PyTorch Lightning stable.

Names are imported on first use (PEP 562), so ``import lightning_stability`` and the command line's help
do not import torch. The first name taken from the package also registers the ``"stable_fsdp"`` strategy
with Lightning. ``_EXPORTS`` is the one list of public names; ``__all__`` is derived from it, and the
``TYPE_CHECKING`` imports below (for type checkers) are tested to match it.
"""

from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS = {
    # the callbacks
    "BatchRamp": "lightning_stability.critical_batch.callback",
    "CriticalBatchMonitor": "lightning_stability.critical_batch.callback",
    "GradientAccumulation": "lightning_stability.accumulation.callback",
    "GradientNormMonitor": "lightning_stability.grad_norm",
    "LossScaleTuner": "lightning_stability.amp.callback",
    "ScheduledLR": "lightning_stability.schedules.callback",
    "TrainingHealthMonitor": "lightning_stability.health.callback",
    "WarmupConstantCosineLR": "lightning_stability.schedules.callback",
    # LR schedules for ScheduledLR
    "CosineSchedule": "lightning_stability.schedules.specs",
    "InverseSqrtSchedule": "lightning_stability.schedules.specs",
    "LinearSchedule": "lightning_stability.schedules.specs",
    "StepSchedule": "lightning_stability.schedules.specs",
    "WarmupConstantCosineSchedule": "lightning_stability.schedules.specs",
    # fp16
    "LossScaleFloorError": "lightning_stability.amp.callback",
    "PrecisionDiagnostics": "lightning_stability.amp.diagnostics",
    "TrainingStatus": "lightning_stability.amp.diagnostics",
    "TunedGradScaler": "lightning_stability.amp.scaler",
    "check_training_status": "lightning_stability.amp.diagnostics",
    # the step ledger, for callback authors
    "LedgerCallback": "lightning_stability.ledger.callback",
    "Outcome": "lightning_stability.ledger.track",
    "Stage": "lightning_stability.ledger.stages",
    "StepLedger": "lightning_stability.ledger.step_ledger",
    # checkpoints a crash cannot half-write
    "AtomicCheckpointIO": "lightning_stability.checkpoint.io",
    "CheckpointError": "lightning_stability.checkpoint.atomic",
    "ExactResume": "lightning_stability.checkpoint.exact_resume",
    "PreemptionCheckpoint": "lightning_stability.checkpoint.preemption_checkpoint",
    "StableCheckpoint": "lightning_stability.checkpoint.callback",
    "verify_checkpoint": "lightning_stability.checkpoint.atomic",
    # replay a flagged step: a bad batch or a bad chip
    "StepReplay": "lightning_stability.replay.callback",
    "FailingDeviceError": "lightning_stability.replay.callback",
    "BitFlip": "lightning_stability.replay.inject",
    "PoisonedSamples": "lightning_stability.replay.inject",
    "read_quarantine": "lightning_stability.replay.quarantine",
    # the cheap checks of a sick cluster
    "ClusterHealthMonitor": "lightning_stability.cluster.callback",
    # spike precursors and the early actions
    "PrecursorMonitor": "lightning_stability.precursors.callback",
    "LRBackoff": "lightning_stability.precursors.callback",
    "HeadBlocks": "lightning_stability.precursors.actions",
    "QKProjection": "lightning_stability.precursors.actions",
    "QueryKey": "lightning_stability.precursors.attention",
    "register_attention": "lightning_stability.precursors.attention",
    "WatchdogSettings": "lightning_stability.cluster.watchdog",
    "watchdog_environment": "lightning_stability.cluster.watchdog",
    "watchdog_settings": "lightning_stability.cluster.watchdog",
    # mixtures of experts: router health
    "RouterHealthMonitor": "lightning_stability.moe.callback",
    "RouterSpec": "lightning_stability.moe.routers",
    "Routing": "lightning_stability.moe.routers",
    "register_router": "lightning_stability.moe.routers",
    # the incident log
    "Incident": "lightning_stability.incidents.log",
    "read_incidents": "lightning_stability.incidents.log",
    "format_incidents": "lightning_stability.incidents.log",
    # the strategy
    "StableFSDPStrategy": "lightning_stability.strategies.fsdp",
    "consolidate_checkpoint": "lightning_stability.strategies.fsdp_checkpoint",
    "gpt_block_plan": "lightning_stability.strategies.tensor_parallel",
    "parallelize_blocks": "lightning_stability.strategies.tensor_parallel",
    # presets, the trainer, the planner
    "Preset": "lightning_stability.presets",
    "StableTrainer": "lightning_stability.trainer",
    "describe_preset": "lightning_stability.presets",
    "get_preset": "lightning_stability.presets",
    "list_presets": "lightning_stability.presets",
    "MemoryPlan": "lightning_stability.planner",
    "ModelShape": "lightning_stability.planner",
    "plan_memory": "lightning_stability.planner",
    "advise_tensor_parallel": "lightning_stability.planner",
    "TensorParallelAdvice": "lightning_stability.planner",
    # progress bars and errors
    "StabilityProgressBar": "lightning_stability.progress",
    "StabilityRichProgressBar": "lightning_stability.progress",
    "StabilityConfigError": "lightning_stability.errors",
    "TrainingDivergedError": "lightning_stability.health.rollback",
}
__all__ = sorted(_EXPORTS)


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
    from lightning_stability.accumulation.callback import GradientAccumulation
    from lightning_stability.amp.callback import LossScaleFloorError, LossScaleTuner
    from lightning_stability.amp.diagnostics import PrecisionDiagnostics, TrainingStatus, check_training_status
    from lightning_stability.amp.scaler import TunedGradScaler
    from lightning_stability.checkpoint.atomic import CheckpointError, verify_checkpoint
    from lightning_stability.checkpoint.callback import StableCheckpoint
    from lightning_stability.checkpoint.exact_resume import ExactResume
    from lightning_stability.checkpoint.io import AtomicCheckpointIO
    from lightning_stability.checkpoint.preemption_checkpoint import PreemptionCheckpoint
    from lightning_stability.cluster.callback import ClusterHealthMonitor
    from lightning_stability.cluster.watchdog import WatchdogSettings, watchdog_environment, watchdog_settings
    from lightning_stability.critical_batch.callback import BatchRamp, CriticalBatchMonitor
    from lightning_stability.errors import StabilityConfigError
    from lightning_stability.grad_norm import GradientNormMonitor
    from lightning_stability.health.callback import TrainingHealthMonitor
    from lightning_stability.health.rollback import TrainingDivergedError
    from lightning_stability.incidents.log import Incident, format_incidents, read_incidents
    from lightning_stability.ledger.callback import LedgerCallback
    from lightning_stability.ledger.stages import Stage
    from lightning_stability.ledger.step_ledger import StepLedger
    from lightning_stability.ledger.track import Outcome
    from lightning_stability.moe.callback import RouterHealthMonitor
    from lightning_stability.moe.routers import RouterSpec, Routing, register_router
    from lightning_stability.planner import (
        MemoryPlan,
        ModelShape,
        TensorParallelAdvice,
        advise_tensor_parallel,
        plan_memory,
    )
    from lightning_stability.precursors.actions import HeadBlocks, QKProjection
    from lightning_stability.precursors.attention import QueryKey, register_attention
    from lightning_stability.precursors.callback import LRBackoff, PrecursorMonitor
    from lightning_stability.presets import Preset, describe_preset, get_preset, list_presets
    from lightning_stability.progress import StabilityProgressBar, StabilityRichProgressBar
    from lightning_stability.replay.callback import FailingDeviceError, StepReplay
    from lightning_stability.replay.inject import BitFlip, PoisonedSamples
    from lightning_stability.replay.quarantine import read_quarantine
    from lightning_stability.schedules.callback import ScheduledLR, WarmupConstantCosineLR
    from lightning_stability.schedules.specs import (
        CosineSchedule,
        InverseSqrtSchedule,
        LinearSchedule,
        StepSchedule,
        WarmupConstantCosineSchedule,
    )
    from lightning_stability.strategies.fsdp import StableFSDPStrategy
    from lightning_stability.strategies.fsdp_checkpoint import consolidate_checkpoint
    from lightning_stability.strategies.tensor_parallel import gpt_block_plan, parallelize_blocks
    from lightning_stability.trainer import StableTrainer
