"""LedgerCallback: the template every ``lightning_stability`` callback fills in."""

from __future__ import annotations

from typing import Any, ClassVar

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from torch import Tensor
from torch.optim import Optimizer

from lightning_stability import _compat
from lightning_stability.errors import StabilityConfigError, check_int
from lightning_stability.ledger.gradients import forget_layouts
from lightning_stability.ledger.metrics import FlushValues, OnHost
from lightning_stability.ledger.stages import Stage
from lightning_stability.ledger.step_ledger import StepLedger
from lightning_stability.ledger.track import OptimizerRecord


class LedgerCallback(Callback):
    """Template of the callbacks that share the trainer's :class:`~lightning_stability.ledger.StepLedger`.

    A callback fills in (all optional):

    * :meth:`on_step`: its work on each optimizer step, before the update: read ``ledger.gradients()`` and
      ``ledger.step``, vote with ``ledger.mark_skip(reason, flag)``, record metrics with :meth:`record_metric`;
    * :meth:`after_step`: its work once the update was applied or skipped (``ledger.outcome`` says which);
    * :meth:`on_host`: on logging steps, after the step's one device-to-host transfer: read what it sent with
      :meth:`to_host` (and the metrics it recorded) as host numbers, to warn or to log more;
    * :meth:`on_setup` (its checks at ``setup("fit")``), :meth:`state_fields` (the settings that identify it in
      a checkpoint), and ``state_dict``/``load_state_dict`` as for any Lightning callback.

    It records metrics with one verb, :meth:`record_metric` (not ``log``: Lightning attaches the module's ``log``
    to every callback), which knows whether the step logs; :attr:`is_logging_step` tells it too, for work worth
    doing on logging steps only.

    Skip votes: every vote cast before ``optimizer.step()`` (by any callback, in any order, or by the module) is
    enforced together right before the update, at one host read of the votes at most (``ledger/step.py``).

    The template does the rest, the same way for every callback:

    * **One instance.** ``setup`` refuses a second callback of the same kind (two would write the same
      ledger entries and metrics), with the package's own message. Until ``setup`` has checked, the
      ``state_key`` carries the instance's id, so Lightning's generic duplicate check at ``Trainer(...)``
      does not pre-empt that message; afterwards it is the stable key that checkpoints use.
    * **Logging cadence.** ``log_every_n_steps`` (default: the Trainer's), by Lightning's own rule and step
      labels, so ``stability/`` metrics share rows with the module's ``self.log`` metrics.
    * **Hooking each optimizer** at ``on_train_batch_start``, before its first step; **opening the step** in
      ``on_before_optimizer_step``; **closing** it at ``on_train_batch_end`` (when the
      loss scaler skipped ``optimizer.step()``, its post-hook never ran) and **flushing** the queued metrics
      in one transfer. Whichever callback gets there first does it; the calls are idempotent.
    * **The ledger in checkpoints**, once, under ``checkpoint["lightning_stability"]["ledger"]``.

    Subclasses that override ``on_train_batch_start``, ``on_train_batch_end`` or ``on_before_backward`` call
    ``super()`` in them.
    """

    #: Why two callbacks of this kind cannot share a Trainer (completes the one-instance error).
    one_instance_reason: ClassVar[str] = "each would write the same ledger entries and metrics"
    #: Set to ``True`` to have ``ledger.step.loss`` in ``on_step``, the update's loss (the mean over its
    #: micro-batches, unscaled, on the device).
    needs_loss: ClassVar[bool] = False

    def __init__(self, log_every_n_steps: int | None = None) -> None:
        if log_every_n_steps is not None:
            check_int("log_every_n_steps", log_every_n_steps, 1, "50, or None for the Trainer's")
        self.log_every_n_steps = log_every_n_steps
        self._every_n = log_every_n_steps or 50
        self._state_key: str | None = None
        self._alone = False  # setup has checked that this is the only callback of its kind
        self._last = True  # the last lightning_stability callback in the Trainer's list: does the ledger's chores
        self._ledger: StepLedger | None = None
        self._logging = False  # the current step logs
        self._host_hooked: set[int] = set()  # records whose next flush runs on_host
        # which optional hooks this class fills in (the template registers only those)
        self._has_after_step = type(self).after_step is not LedgerCallback.after_step
        self._has_on_host = type(self).on_host is not LedgerCallback.on_host

    # ------------------------------------------------------------------ to fill in
    def state_fields(self) -> dict[str, Any]:
        """Settings that identify this callback in a checkpoint; default: none (the class name alone)."""
        return {}

    def on_setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Checks and installation at ``setup("fit")``, after the one-instance check."""

    def on_step(self, trainer: pl.Trainer, ledger: StepLedger, optimizer: Optimizer) -> None:
        """This callback's work on the optimizer step that ``ledger`` has open, before the update."""

    def after_step(self, trainer: pl.Trainer, ledger: StepLedger) -> None:
        """This callback's work once the step closed: the update was applied or skipped (``ledger.outcome``)."""

    def on_host(self, trainer: pl.Trainer, record: OptimizerRecord) -> dict[str, float] | None:
        """On a logging step after the transfer, once per optimizer (``record``) this callback recorded or sent
        something for: the :class:`OnHost` values that :meth:`to_host` and :meth:`record_metric` returned hold
        their host numbers now. Return extra metrics to log, or ``None``."""
        return None

    # ------------------------------------------------------------------ provided
    @property
    def is_logging_step(self) -> bool:
        """Whether the current step logs (by this callback's ``log_every_n_steps``)."""
        return self._logging

    def record_metric(self, key: str, value: Tensor | float, *, to_loggers: bool | None = None) -> OnHost:
        """Record a metric of the current step (``"stability/..."``).

        A scalar is in ``trainer.callback_metrics[key]`` at once, so ``ModelCheckpoint``/``EarlyStopping`` can
        monitor it (a device tensor stays on the device: nothing moves until a monitor reads it). On logging
        steps it also goes to every logger with the step's one transfer. With several optimizers the key ends
        in ``/<optimizer>``. ``to_loggers=False`` keeps it from the loggers (``None``: on logging steps).
        Returns its host copy, readable in :meth:`on_host` when it went to the loggers.
        """
        ledger = self._ledger_now()
        send = self._logging if to_loggers is None else to_loggers
        handle = ledger._log(((key, value),), send)
        if send:
            self._hook_host(ledger)
        return handle

    def to_host(self, value: Tensor) -> OnHost:
        """Send ``value`` to the host with the step's one transfer; read the returned :class:`OnHost` in
        :meth:`on_host` (``.number()`` for a 0-dim tensor, ``.numbers()`` for a vector). Call it on logging steps
        (:attr:`is_logging_step`) or after training: on any other step it makes that step transfer too (a host
        sync)."""
        ledger = self._ledger_now()
        handle = ledger._send(value)
        self._hook_host(ledger)
        return handle

    def _ledger_now(self) -> StepLedger:
        if self._ledger is None:
            raise RuntimeError(f"{type(self).__name__}: record_metric() or to_host() called before setup")
        return self._ledger

    def _hook_host(self, ledger: StepLedger) -> None:
        if not self._has_on_host:
            return
        index = ledger.record_of().index
        if index not in self._host_hooked:
            self._host_hooked.add(index)
            ledger._on_flush(lambda values: self._run_on_host(index, values))

    def _run_on_host(self, index: int, values: FlushValues) -> dict[str, float] | None:
        self._host_hooked.discard(index)
        ledger = self._ledger_now()
        trainer = ledger.trainer
        if trainer is None:
            return None
        return self.on_host(trainer, ledger._record_at(index))

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
        refuse_foreign_sharding(trainer.strategy, type(self).__name__)
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
        ledger = self._ledger = StepLedger.of(trainer)
        if self.needs_loss:
            ledger._want_loss()
        if self._has_after_step:  # row 13 of the step table, in the order of the callbacks' names
            ledger.at(Stage.AFTER_STEP, self.kind().__name__, self._after_step)
        self._host_hooked = set()
        forget_layouts()
        self.on_setup(trainer, pl_module)

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        ledger = self._ledger = StepLedger.of(trainer)
        ledger.open_step(optimizer)
        self._logging = ledger.is_logging_step(self._every_n)
        self.on_step(trainer, ledger, optimizer)

    def _after_step(self, ledger: StepLedger) -> None:
        trainer = ledger.trainer
        if trainer is not None:
            self.after_step(trainer, ledger)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._last:  # the optimizers' step hooks, in place before their first step (ledger/step.py)
            StepLedger.of(trainer)._watch(trainer.optimizers)

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        if self._last:  # row 1's functions, and the loss (if any callback asked for it): once, by one of our callbacks
            StepLedger.of(trainer)._before_backward(loss)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        ledger = StepLedger.of(trainer)
        ledger.close_step()
        ledger._flush_at_batch_end()

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        StepLedger.of(trainer)._save_into(checkpoint)

    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        StepLedger.of(trainer)._load_from(checkpoint)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.update({"_ledger": None, "_host_hooked": set()})
        state.update(self.transient_state())
        return state

    def transient_state(self) -> dict[str, Any]:
        """Attributes reset when the callback is pickled (references to the run: tensors, optimizers)."""
        return {}


def refuse_foreign_sharding(strategy: Any, callback: str) -> None:
    """At setup: refuse Lightning's ``FSDPStrategy`` (FSDP1) and ``DeepSpeedStrategy``, naming the one-word switch.

    Under both, each rank's gradients are flat local shards that the Lightning hooks see only in part, and the
    optimizer step belongs to the wrapper: no callback can measure the global norm, clip by it, or skip a step
    exactly there (Lightning's own ``gradient_clip_val`` raises under ``FSDPStrategy``, Lightning issue #19235).
    """
    from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy

    if isinstance(strategy, FSDPStrategy):
        raise StabilityConfigError(
            f"{callback} cannot run under Lightning's FSDPStrategy (strategy='fsdp'): FSDP1 keeps each rank's "
            "gradients as flat local shards, so the global norm, clipping by it and skipping a step are not exact "
            "there. Fix: change one word, FSDPStrategy(...) -> StableFSDPStrategy(...) with the same arguments "
            "(strategy='fsdp' -> strategy='stable_fsdp'; `from lightning_stability import StableFSDPStrategy`), "
            "or use Lightning's ModelParallelStrategy (FSDP2)."
        )
    if isinstance(strategy, DeepSpeedStrategy):
        raise StabilityConfigError(
            f"{callback} cannot run under DeepSpeedStrategy: DeepSpeed's engine owns the step (its own clipping, "
            "loss scaling and accumulation over flat partitioned gradients), so no callback can measure, clip or "
            "skip it exactly. Fix: shard with StableFSDPStrategy (strategy='stable_fsdp'; full sharding is ZeRO-3, "
            "sharding_strategy='SHARD_GRAD_OP' is ZeRO-2's communication) or Lightning's ModelParallelStrategy "
            "(FSDP2)."
        )
