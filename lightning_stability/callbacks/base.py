"""LedgerCallback: what every lightning_stability callback does with the shared StepLedger."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

from lightning_stability.ledger import StepLedger


class LedgerCallback(Callback):
    """Base class of the callbacks that share the trainer's :class:`~lightning_stability.ledger.StepLedger`.

    * ``on_train_batch_end`` closes the step (when the loss scaler skipped ``optimizer.step()`` the
      optimizer's post-hook never ran) and flushes the metrics queued on a logging step, in one transfer.
      Whichever callback gets there first does it; the calls are idempotent.
    * The ledger is saved once in the checkpoint, under ``checkpoint["lightning_stability"]["ledger"]``:
      every subclass writes the same entry, and every subclass restores from it.

    Subclasses that override ``on_train_batch_end`` call ``super().on_train_batch_end(...)`` first.
    """

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        ledger = StepLedger.of(trainer)
        ledger.close_step()
        ledger.flush()

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        StepLedger.of(trainer).save_into(checkpoint)

    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        StepLedger.of(trainer).load_from(checkpoint)
