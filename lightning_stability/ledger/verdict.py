"""Where health and checkpoints meet: the health verdict of a step, as data, and what a rollback needs of a
checkpoint callback.

``TrainingHealthMonitor`` scores every optimizer step and writes its verdict into the step ledger
(:attr:`StepLedger.health <lightning_stability.ledger.step_ledger.StepLedger.health>`): one
:class:`HealthVerdict` of device flags, no host sync. ``StableCheckpoint`` reads it there to decide whether a state
may be saved, and the monitor's history (hence the stability report) records the same flags: "spike" has one
definition, the monitor's rule (``health/spike_stats.py``: above ``spike_z`` standard deviations, unless the signal
has settled at a new level).

A rollback to disk finds the checkpoint callbacks by :class:`CheckpointRing` (``StableCheckpoint`` is one), so that
neither ``health/`` nor ``checkpoint/`` imports the other's callback.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Protocol, runtime_checkable

from torch import Tensor

if TYPE_CHECKING:
    import lightning.pytorch as pl

#: the history flag of a value more than ``spike_z`` standard deviations above its running mean: a spike
SPIKE = 1
#: the history flag of such a value once its signal has settled there (a new level): not a spike
NEW_LEVEL = 2


@dataclass(frozen=True)
class HealthVerdict:
    """``TrainingHealthMonitor``'s verdict of one optimizer step: device tensors, read on the host only where a
    decision needs them (``StableCheckpoint``, where a save is due). The same on every rank (scored on values
    averaged over ranks).

    Attributes:
        flags: per signal (:attr:`SIGNALS`): 0 below the spike threshold, ``SPIKE`` (1) a spike, ``NEW_LEVEL`` (2)
            above it but at the new level the signal has settled at (the history's ``loss_spike`` and
            ``grad_spike`` columns); float32, or bool where the monitor learns no new level (``"rollback"``).
        spikes: per signal, bool: the spikes (``flags == SPIKE``).
        rollback_pending: under ``response="rollback"``: this step spiked on the weights of a spike whose update
            was skipped, so the damage is in the weights and the next step rolls back (0-dim bool tensor, or a
            host ``False`` where no rollback can follow; ``False`` again once the rollback is done).

    The monitor does not score the steps whose update a rollback drops (the rollback step and the batches skipped
    after it: their outcome is ``SKIPPED_ROLLBACK``); the ledger keeps the last scored step's verdict through them.
    """

    #: the scored signals, in the order of :attr:`flags`
    SIGNALS: ClassVar[tuple[str, str]] = ("loss", "grad_norm")

    flags: Tensor
    spikes: Tensor
    rollback_pending: Tensor | bool = False

    @property
    def spike(self) -> Tensor:
        """0-dim bool: the step is a spike (by the loss or by the gradient norm)."""
        return self.spikes.any()

    @property
    def new_level(self) -> Tensor:
        """0-dim bool: a signal is at a new level (above the old threshold, taken into the statistics)."""
        return (self.flags == NEW_LEVEL).any()


@runtime_checkable
class CheckpointRing(Protocol):
    """A callback that keeps a list of healthy checkpoints on disk (``StableCheckpoint``): what
    ``TrainingHealthMonitor`` needs to roll back to one of them and to take the damaged ones off the list."""

    def healthy_checkpoints(self, up_to_step: int | None = None) -> list[tuple[Path, int]]:
        """This run's healthy checkpoints, newest first, as ``(path, global step at the save)``; with
        ``up_to_step``, those saved at or before it."""
        ...

    def discard_newer_than(self, trainer: pl.Trainer, step: int) -> list[Path]:
        """Take the checkpoints saved after global step ``step`` off the list (every rank); their paths."""
        ...
