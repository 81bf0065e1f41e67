"""The step ledger: one record of every optimizer step, shared by every ``lightning_stability`` callback.

**To follow one optimizer step** (where it is measured, clipped, skipped): ``step.py``.

A callback author needs :class:`LedgerCallback` (the template: fill in ``on_step``), :class:`StepLedger` (what
``on_step`` receives), :class:`OptimizerStep` (``ledger.step``: the open step's loss, gradient norm, gradients),
:class:`OptimizerRecord` (one optimizer's counts) and :class:`Outcome` (why a step was skipped).

* ``step.py``: :class:`OptimizerStep`, one step from unscale to update, in order: measure, clip, vote, enforce,
  outcome; its docstring is the step table.
* ``stages.py``: :class:`Stage`, one member per row of that table (``StepLedger.at`` registers at a row), and the
  debug check that no row changes what it may not.
* ``callback.py``: :class:`LedgerCallback`, the template every callback fills in.
* ``step_ledger.py``: :class:`StepLedger`: opens and closes each optimizer step (its step hooks), takes skip
  votes, routes metrics; the update's loss.
* ``track.py``: :class:`Outcome`; :class:`OptimizerRecord`, one optimizer's record (steps, outcome counts,
  window sums).
* ``skips.py``: the mechanisms that skip an update (the fp16 scaler's flags, ``found_inf`` for fused optimizers,
  dropped gradients), used by ``step.py``.
* ``gradients.py``: the step's gradient norms, computed once for every callback; shared clipping.
* ``metrics.py``: ``stability/`` metrics into ``callback_metrics`` at once, to the loggers in one transfer.
* ``verdict.py``: :class:`HealthVerdict`, the health monitor's verdict of a step (spike, new level, rollback
  pending) that ``StableCheckpoint`` reads; :class:`CheckpointRing`, what a rollback needs of ``StableCheckpoint``.
"""

from lightning_stability.ledger.callback import LedgerCallback
from lightning_stability.ledger.gradients import StepGradients
from lightning_stability.ledger.metrics import OnHost
from lightning_stability.ledger.skips import loss_scaler
from lightning_stability.ledger.stages import Stage
from lightning_stability.ledger.step import OptimizerStep
from lightning_stability.ledger.step_ledger import CHECKPOINT_KEY, StepLedger
from lightning_stability.ledger.track import OptimizerRecord, Outcome
from lightning_stability.ledger.verdict import CheckpointRing, HealthVerdict

__all__ = [
    "CHECKPOINT_KEY",
    "CheckpointRing",
    "HealthVerdict",
    "LedgerCallback",
    "OnHost",
    "OptimizerRecord",
    "OptimizerStep",
    "Outcome",
    "Stage",
    "StepGradients",
    "StepLedger",
    "loss_scaler",
]
