"""Every ``lightning_stability`` callback in one place, for ``from lightning_stability.callbacks import ...``
(each lives in its feature's folder). ``StableCheckpoint``, a ``ModelCheckpoint``, is with the checkpoints."""

from lightning_stability.accumulation.callback import GradientAccumulation
from lightning_stability.amp.callback import LossScaleTuner
from lightning_stability.checkpoint.exact_resume import ExactResume
from lightning_stability.checkpoint.preemption_checkpoint import PreemptionCheckpoint
from lightning_stability.cluster.callback import ClusterHealthMonitor
from lightning_stability.critical_batch.callback import BatchRamp, CriticalBatchMonitor
from lightning_stability.grad_norm import GradientNormMonitor
from lightning_stability.health.callback import TrainingHealthMonitor
from lightning_stability.moe.callback import RouterHealthMonitor
from lightning_stability.precursors.callback import PrecursorMonitor
from lightning_stability.replay.callback import StepReplay
from lightning_stability.schedules.callback import ScheduledLR, WarmupConstantCosineLR

__all__ = [
    "BatchRamp",
    "ClusterHealthMonitor",
    "CriticalBatchMonitor",
    "ExactResume",
    "GradientAccumulation",
    "GradientNormMonitor",
    "LossScaleTuner",
    "PreemptionCheckpoint",
    "PrecursorMonitor",
    "RouterHealthMonitor",
    "ScheduledLR",
    "StepReplay",
    "TrainingHealthMonitor",
    "WarmupConstantCosineLR",
]
