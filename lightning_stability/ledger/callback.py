"""LedgerCallback: the template every lightning_stability callback fills in."""

from __future__ import annotations

from typing import Any, ClassVar

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from torch import Tensor
from torch.optim import Optimizer

from lightning_stability import _compat
from lightning_stability.errors import StabilityConfigError, check_positive_int
from lightning_stability.ledger.gradients import forget_layouts
from lightning_stability.ledger.step_ledger import StepLedger


class LedgerCallback(Callback):
    """Template of the callbacks that share the trainer's :class:`~lightning_stability.ledger.step_ledger.StepLedger`.

    A callback fills in (all optional):

    * :meth:`state_fields`: the settings that identify it in a checkpoint (its ``state_key``);
    * :meth:`on_setup`: its checks and installation at ``setup("fit")``;
    * :meth:`on_step`: its work on each optimizer step, in ``on_before_optimizer_step``, with the step
      already open in the ledger and ``logging`` telling whether this step logs;
    * ``state_dict``/``load_state_dict`` for its own state, as for any Lightning callback.

    The template does the rest, the same way for every callback:

    * **One instance.** ``setup`` refuses a second callback of the same kind (two would write the same
      ledger entries and metrics), with the package's own message. Until ``setup`` has checked, the
      ``state_key`` carries the instance's id, so Lightning's generic duplicate check at ``Trainer(...)``
      does not pre-empt that message; afterwards it is the stable key that checkpoints use.
    * **Logging cadence.** ``log_every_n_steps`` (default: the Trainer's), by Lightning's own rule and step
      labels, so ``stability/`` metrics share rows with the module's ``self.log`` metrics.
    * **Opening the step** in ``on_before_optimizer_step``; **closing** it at ``on_train_batch_end`` (when the
      loss scaler skipped ``optimizer.step()``, its post-hook never ran) and **flushing** the queued metrics
      in one transfer. Whichever callback gets there first does it; the calls are idempotent.
    * **The ledger in checkpoints**, once, under ``checkpoint["lightning_stability"]["ledger"]``.

    Subclasses that override ``on_train_batch_end`` call ``super().on_train_batch_end(...)`` first.
    """

    #: Why two callbacks of this kind cannot share a Trainer (completes the one-instance error).
    one_instance_reason: ClassVar[str] = "each would write the same ledger entries and metrics"

    def __init__(self, log_every_n_steps: int | None = None) -> None:
        if log_every_n_steps is not None:
            check_positive_int("log_every_n_steps", log_every_n_steps, "50, or None for the Trainer's")
        self.log_every_n_steps = log_every_n_steps
        self._every_n = log_every_n_steps or 50
        self._state_key: str | None = None
        self._alone = False  # setup has checked that this is the only callback of its kind
        self._last = True  # the last lightning_stability callback in the Trainer's list: enforces the votes

    # ------------------------------------------------------------------ to fill in
    def state_fields(self) -> dict[str, Any]:
        """Settings that identify this callback in a checkpoint; default: none (the class name alone)."""
        return {}

    def on_setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Checks and installation at ``setup("fit")``, after the one-instance check."""

    def on_step(self, trainer: pl.Trainer, ledger: StepLedger, optimizer: Optimizer, logging: bool) -> None:
        """This callback's work on the optimizer step that ``ledger`` has open."""

    # ------------------------------------------------------------------ provided
    @classmethod
    def kind(cls) -> type[LedgerCallback]:
        """The family a callback belongs to: ``WarmupConstantCosineLR`` is a ``ScheduledLR``."""
        for klass in cls.__mro__:
            if LedgerCallback in klass.__bases__:
                return klass
        return cls

    @property
    def state_key(self) -> str:
        if not self._alone:
            return f"{type(self).__qualname__}#{id(self)}"
        # Lightning reads this around every hook call: build the string once.
        if self._state_key is None:
            self._state_key = _compat.callback_state_key(self, **self.state_fields())
        return self._state_key

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        _compat.check_supported(trainer)
        kind = self.kind()
        same = [cb for cb in trainer.callbacks if isinstance(cb, kind)]  # type: ignore[attr-defined]
        if len(same) > 1:
            raise StabilityConfigError(
                f"{len(same)} {kind.__name__} callbacks are attached ({', '.join(type(cb).__name__ for cb in same)}): "
                f"{self.one_instance_reason}. Fix: keep exactly one {kind.__name__} in the Trainer's callbacks."
            )
        self._alone = True
        # Trainer(log_every_n_steps=0) logs nothing; the metrics stay monitorable in callback_metrics
        self._every_n = self.log_every_n_steps or trainer.log_every_n_steps  # type: ignore[attr-defined]
        # the model's own callbacks are attached before setup, so the list is complete here
        ours = [cb for cb in trainer.callbacks if isinstance(cb, LedgerCallback)]  # type: ignore[attr-defined]
        self._last = ours[-1] is self
        StepLedger.of(trainer).callbacks_enforce = True
        forget_layouts()
        self.on_setup(trainer, pl_module)

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        ledger = StepLedger.of(trainer)
        ledger.open_step(optimizer)
        self.on_step(trainer, ledger, optimizer, ledger.is_logging_step(self._every_n))
        if self._last:
            # Every lightning_stability callback has voted: enforce the skip votes together (one read at most).
            ledger.enforce_votes()

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        if self._last:  # one of our callbacks records the loss (if any callback asked for it)
            StepLedger.of(trainer).add_loss(loss)

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

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.update(self.transient_state())
        return state

    def transient_state(self) -> dict[str, Any]:
        """Attributes reset when the callback is pickled (references to the run: tensors, optimizers)."""
        return {}
