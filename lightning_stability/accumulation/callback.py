"""GradientAccumulation: drives Lightning's automatic optimization window by window.

The arithmetic is in :mod:`~lightning_stability.accumulation.schedule`; BatchNorm handling and AdaScale live
beside it (``batchnorm``, ``adascale``). Also here:

* :func:`check_trainer`, :func:`check_lr_schedulers`: what else in the Trainer would accumulate or write the LR.
  Each check raises a ``StabilityConfigError`` that names the conflict and the fix; none changes anything.
* :class:`AccumulationLR`: the LR written when no LR schedule does, ``base * scale(k)`` per param group.
* :class:`TunerSearchGuard`: runs Lightning's tuner searches (LR finder, batch-size finder, as ``Tuner`` calls or
  as callbacks) inside a context the caller provides. Each search runs from one public method of the tuner
  callback (``lr_find(trainer, pl_module)`` or ``scale_batch_size(trainer, pl_module)``) and swaps
  ``trainer.callbacks`` for Lightning's own while it runs, so no other callback hook can undo what this callback
  changed on the Trainer (the accumulation factor, the "last micro-batch" decision). The guard wraps that method
  on the tuner callbacks attached to the Trainer, for one fit.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import BatchSizeFinder, Callback, GradientAccumulationScheduler, LearningRateFinder
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor
from torch.optim import Optimizer

from lightning_stability import _compat
from lightning_stability.accumulation import adascale
from lightning_stability.accumulation.batchnorm import BATCHNORM_MODES, handle_batchnorm
from lightning_stability.accumulation.schedule import LR_SCALINGS, AccumulationSchedule, lr_scale
from lightning_stability.errors import StabilityConfigError, config_error, require_fairscale
from lightning_stability.ledger.callback import LedgerCallback
from lightning_stability.ledger.step_ledger import StepLedger

__all__ = ["GradientAccumulation"]


class GradientAccumulation(LedgerCallback):
    """Accumulate gradients over several micro-batches per optimizer step; the factor may change by step.

    Each micro-batch's loss is divided by the number of micro-batches of its optimizer step (also in the shorter
    last step of an epoch), so the gradient is the mean over the accumulated batch. Under DDP gradients are
    all-reduced once per optimizer step; under FSDP2 they are reduce-scattered on the last micro-batch only.
    Unlike Lightning's ``GradientAccumulationScheduler``, which switches at epoch boundaries, a schedule here
    switches between any two optimizer steps.

    Logged keys:

    ==================================  =====================================================
    Key                                 Meaning
    ==================================  =====================================================
    ``stability/accumulation_steps``    micro-batches accumulated into this optimizer step
    ``stability/lr_scale``              LR factor from accumulation (``k``, ``sqrt(k)``, 1, gain)
    ==================================  =====================================================

    Args:
        steps: micro-batches per optimizer step: an int, or a schedule ``{applied_updates: factor}`` keyed by the
            number of applied optimizer updates (``{0: 2, 1000: 4}``: 2 for the first 1000 updates, then 4; the
            clock of :class:`~lightning_stability.schedules.callback.ScheduledLR`, which skipped steps do not
            move). Before the first key the factor is 1.
        lr_scaling: the LR of a step of ``k`` micro-batches. ``"none"`` (default): as set in
            ``configure_optimizers``, as with Lightning's ``accumulate_grad_batches``. ``"linear"``: ``lr * k``
            (Goyal et al. 2017; SGD). ``"sqrt"``: ``lr * sqrt(k)`` (Malladi et al. 2022; Adam with an LR tuned for
            one micro-batch). ``"adascale"``: ``lr * gain``, FairScale's AdaScale gain between 1 and ``k``,
            measured every step with host syncs (the ``fairscale`` extra). A rule that changes the LR says so in
            one info line at fit start. With an LR schedule callback the LR is ``base * schedule * scale``.
        batchnorm: BatchNorm sees one micro-batch's statistics. ``"warn"`` (default): say so at ``setup``;
            ``"group_norm"``: replace each BatchNorm by a GroupNorm with the same channels and affine weights
            before the optimizer is built (retrain: no running statistics); ``"sync_batchnorm"``: convert to
            ``SyncBatchNorm`` (GPUs under DDP); ``"ignore"``.
        log_every_n_steps: log every this many optimizer steps; default: the Trainer's.

    Raises:
        StabilityConfigError: for a bad argument or a missing ``fairscale``; at ``setup`` when the Trainer also
            accumulates (``accumulate_grad_batches``, ``GradientAccumulationScheduler``), under manual
            optimization, or for ``batchnorm="sync_batchnorm"`` without DDP on GPUs; at fit start when
            ``"linear"``/``"sqrt"`` meets an LR scheduler from ``configure_optimizers`` (both would write the LR:
            use :class:`~lightning_stability.schedules.callback.ScheduledLR`).

    Example::

        trainer = L.Trainer(callbacks=[GradientAccumulation(steps={0: 2, 1000: 8}, lr_scaling="sqrt")])
    """

    one_instance_reason = "each would set the accumulation factor"

    def __init__(
        self,
        steps: int | Mapping[int, int] = 1,
        lr_scaling: str = "none",
        batchnorm: str = "warn",
        log_every_n_steps: int | None = None,
    ) -> None:
        super().__init__(log_every_n_steps)
        self._schedule = self._configured = AccumulationSchedule.parse(steps)
        self._grown: dict[int, int] = {}  # the switches a ramp added (`grow`): {applied_updates: factor}
        if lr_scaling not in LR_SCALINGS:
            raise config_error("lr_scaling", lr_scaling, f"is not one of {LR_SCALINGS}", "pass e.g. 'sqrt' for AdamW")
        if lr_scaling == "adascale":
            require_fairscale("lr_scaling", lr_scaling, "pick lr_scaling='linear', 'sqrt' or 'none'")
        if batchnorm not in BATCHNORM_MODES:
            raise config_error(
                "batchnorm", batchnorm, f"is not one of {BATCHNORM_MODES}", "pass 'warn' or 'group_norm'"
            )
        schedule = self._schedule
        self.steps = dict(zip(schedule.keys, schedule.factors, strict=True)) if isinstance(steps, Mapping) else steps
        self.lr_scaling = lr_scaling
        self.batchnorm = batchnorm
        self._optimizer: Optimizer | None = None
        self._micro = 0  # micro-batches seen in the current window
        self._size = 0  # micro-batches in the current window (the factor, or fewer at the end of an epoch)
        self._factor = schedule.factors[0]
        self._known_applied = 0  # a lower bound of the applied count, exact after each host read
        self._opened = False
        self._decided: int | None = None  # the next window's factor, decided as the last step closed (row 13)
        self._lr = AccumulationLR(lr_scaling)
        self._stash: list[tuple[Tensor, Tensor]] = []
        self._adascale = adascale.AdaScaleGain()
        self._tuner = TunerSearchGuard()
        self._user_factor = 1  # the Trainer's accumulate_grad_batches as configured (setup refuses others)
        self._fsdp: list[Any] = []  # FSDP2 modules whose gradient sync this callback drives (see `fsdp_to_drive`)

    def state_fields(self) -> dict[str, Any]:
        return {"steps": repr(self.steps), "lr_scaling": self.lr_scaling}

    # ------------------------------------------------------------------ the schedule (pure)
    @property
    def is_constant(self) -> bool:
        return self._schedule.is_constant

    def factor_at(self, applied_steps: int) -> int:
        """Micro-batches per optimizer step after ``applied_steps`` applied updates."""
        return self._schedule.factor_at(applied_steps)

    def lr_scale_at(self, applied_steps: int) -> float:
        """The LR factor of the update after ``applied_steps`` updates (1 for ``"none"``/``"adascale"``)."""
        return self._schedule.lr_scale_at(applied_steps, self.lr_scaling)

    def estimated_optimizer_steps(self, trainer: pl.Trainer) -> int | None:
        """Optimizer steps of the whole run for a changing factor (``None``: use the Trainer's estimate).

        Assumes no skipped updates; a skip delays every later switch by one step. A ramp's switches (:meth:`grow`)
        are left out: with them the LR schedule counts samples (:meth:`schedule_position`), and its length is the
        run's steps as configured.
        """
        if self._configured.is_constant:
            return None
        return self._configured.optimizer_steps(trainer.num_training_batches, trainer.max_steps, trainer.max_epochs)

    # ------------------------------------------------------------------ a ramp's changes
    @property
    def factor(self) -> int:
        """Micro-batches per optimizer step of the current window (of the next one, between windows)."""
        return self._factor

    @property
    def micro_batch(self) -> int:
        """The current micro-batch's place in its window, from 1 (0 between windows)."""
        return self._micro

    @property
    def window_size(self) -> int:
        """Micro-batches in the current window: the factor, or fewer at the end of an epoch."""
        return self._size

    @property
    def revision(self) -> int:
        """How many times :meth:`grow` changed the schedule (a cache of its values is stale when this moved)."""
        return len(self._grown)

    def grow(self, applied_steps: int, factor: int) -> None:
        """From the update after ``applied_steps`` applied updates on, ``factor`` micro-batches per step (a batch
        ramp's change, made at row 13 of the step table before this callback's own). Only on a constant ``steps``;
        the factor never shrinks. Saved in checkpoints."""
        if not self._configured.is_constant:
            raise StabilityConfigError(
                f"GradientAccumulation(steps={self.steps!r}) follows its own schedule; a batch ramp grows a constant "
                "factor only. Fix: pass GradientAccumulation(steps=<the starting factor>)."
            )
        if factor < self._schedule.factor_at(applied_steps):
            raise ValueError(f"grow: factor {factor} is below the current {self._schedule.factor_at(applied_steps)}")
        self._grown[int(applied_steps)] = int(factor)
        self._rebuild()

    def _rebuild(self) -> None:
        switches = dict(zip(self._configured.keys, self._configured.factors, strict=True))
        switches.update(self._grown)
        keys = sorted(switches)
        self._schedule = AccumulationSchedule(tuple(keys), tuple(switches[k] for k in keys))

    def schedule_position(self, applied_steps: int) -> int:
        """Where an LR schedule stands after ``applied_steps`` updates: ``applied_steps``, or, once a ramp grew the
        factor, the samples those updates trained on counted in updates of the starting batch (the schedule counts
        samples, not steps)."""
        if not self._grown:
            return applied_steps
        return self._schedule.micro_batches_before(applied_steps) // self._configured.factors[0]

    # ------------------------------------------------------------------ setup
    def on_setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        check_trainer(trainer, pl_module, f"GradientAccumulation(steps={self.steps!r})")
        self._grown = {}  # a checkpoint loaded after setup brings a ramp's switches back
        self._rebuild()
        self._lr.reset()
        self._adascale.saved_statistics = None
        if self._schedule.max_factor > 1:
            handle_batchnorm(
                pl_module,
                self.batchnorm,
                self._schedule.max_factor,
                trainer.world_size,
                trainer.strategy.root_device.type,
                lambda message: rank_zero_warn(message, category=UserWarning),
            )
        self._user_factor = trainer.accumulate_grad_batches
        # Before `configure_optimizers`: `trainer.estimated_stepping_batches` counts optimizer steps.
        trainer.accumulate_grad_batches = self._schedule.factors[0] if self.is_constant else 1
        self._tuner.install(trainer, self._as_configured)

    @contextmanager
    def _as_configured(self, trainer: pl.Trainer) -> Iterator[None]:
        """The Trainer as configured (every micro-batch steps, no gain) for a tuner search; none of our hooks
        run in it. Afterwards all is as before, except that an LR the search wrote becomes the base LR."""
        factor = trainer.accumulate_grad_batches
        decision = _compat.accumulation_override(trainer)  # installed mid-fit
        _compat.override_accumulation_decision(trainer, None)
        self._adascale.suspend()
        trainer.accumulate_grad_batches = self._user_factor
        try:
            yield
        finally:
            trainer.accumulate_grad_batches = factor
            if decision is not None:
                _compat.override_accumulation_decision(trainer, decision)
            self._adascale.resume()
            self._lr.adopt_written(self._optimizer)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from lightning_stability.schedules.callback import ScheduledLR

        # `configure_optimizers` has run by now (strategy setup), so its schedulers are known.
        has_schedule = any(isinstance(cb, ScheduledLR) for cb in trainer.callbacks)  # type: ignore[attr-defined]
        check_lr_schedulers(trainer, self.lr_scaling, self._schedule.max_factor, has_schedule)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from lightning_stability.schedules.callback import ScheduledLR

        self._optimizer = trainer.optimizers[0]
        # Lightning decides "is this micro-batch the last of the step?" by `batches_this_epoch % factor`,
        # which is right only for a constant factor. The window count decides instead; everything that
        # depends on that decision (optimizer step, DDP no_sync, LR schedulers, logging) follows it.
        _compat.override_accumulation_decision(trainer, self._window_full)
        # HOST SYNC (once, before the first step) at most: the ledger may hold device-decided counts.
        self._known_applied = int(StepLedger.of(trainer).record_of().applied_steps)  # HOST SYNC (once) at most
        self._opened = False
        self._decided = None
        has_schedule = any(isinstance(cb, ScheduledLR) for cb in trainer.callbacks)  # type: ignore[attr-defined]
        self._lr.start(self._optimizer, active=self.lr_scaling in ("linear", "sqrt") and not has_schedule)
        self._say_lr_change(has_schedule)
        if self.lr_scaling == "adascale":
            self._adascale.start(self._optimizer)
        self._fsdp = fsdp_to_drive(trainer.strategy, pl_module)

    def _say_lr_change(self, has_schedule: bool) -> None:
        """One info line at fit start when ``lr_scaling`` changes the configured LR, with the way to turn it off."""
        if self.lr_scaling == "none" or self._schedule.max_factor == 1 or self._optimizer is None:
            return
        where = "the peak of the LR schedule" if has_schedule else "the LR"
        if self.lr_scaling == "adascale":
            change = "x AdaScale's gain (1 to k, measured every step)"
        else:
            scales = list(dict.fromkeys(lr_scale(k, self.lr_scaling) for k in self._schedule.factors))
            change = " then ".join(f"x{s:g}" for s in scales)
            if not has_schedule and self._lr.base_lrs:
                base = self._lr.base_lrs[0]
                change = " then ".join(f"{base:g} -> {base * s:g}" for s in scales) + f" ({change})"
        rank_zero_info(
            f"GradientAccumulation(steps={self.steps!r}, lr_scaling={self.lr_scaling!r}) scales {where} with the "
            f"micro-batches per step: {change}. To keep the LR as configured, pass lr_scaling='none'."
        )

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Lightning steps on the last batch of every epoch, so an epoch always starts a new window.
        self._micro = self._size = 0

    def _window_full(self) -> bool:
        return self._micro >= self._size

    # ------------------------------------------------------------------ the micro-batches
    def _next_factor(self, ledger: StepLedger) -> int:
        if self.is_constant:
            return self._schedule.factors[0]
        record = ledger.record_of()
        if record.counted_on_host:
            applied = int(record.applied_steps)  # a host int: no sync
        else:
            next_key = self._schedule.next_switch(self._known_applied)
            # applied <= attempted: no switch can be due before the attempted count reaches the next key.
            if next_key is None or record.steps < next_key or not self._opened:
                return self.factor_at(self._known_applied)
            applied = int(record.applied_steps)  # HOST SYNC: only near a switch, on device-decided runs
        self._known_applied = applied
        return self.factor_at(applied)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        if self._micro >= self._size:
            self._start_window(trainer, pl_module, batch_idx)
        self._micro += 1
        last = self._micro >= self._size
        for module in self._fsdp:  # reduce-scatter (and, hybrid, all-reduce) on the last micro-batch only
            module.set_requires_gradient_sync(last, recurse=False)

    def _start_window(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch_idx: int) -> None:
        k = self._decided if self._decided is not None else self._next_factor(StepLedger.of(trainer))
        self._decided = None
        batches = trainer.num_training_batches
        size = k if not math.isfinite(batches) else max(1, min(k, int(batches) - batch_idx))
        self._factor, self._size, self._micro = k, size, 0
        # The closure divides each micro-batch's loss by this: the gradient is the mean over the window.
        trainer.accumulate_grad_batches = size
        assert self._optimizer is not None
        if batch_idx % size != 0:
            # Lightning zeroes gradients only where `batch_idx % factor == 0`; do it here as it would.
            pl_module.optimizer_zero_grad(trainer.current_epoch, batch_idx, self._optimizer)
        self._lr.set_factor(self._optimizer, k)  # the first window of a fit; later ones at row 13 (after_step)
        if self.lr_scaling == "adascale":
            self._adascale.configure(trainer.world_size, size)

    def on_before_zero_grad(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer) -> None:
        if self._micro > 1:
            # Lightning is about to zero in the middle of a window (its `batch_idx % factor` rule); keep the
            # accumulated gradients aside (no copy) and put them back before this micro-batch's backward.
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        self._stash.append((p, p.grad))
                        p.grad = None

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        super().on_before_backward(trainer, pl_module, loss)
        self._restore_stash()

    def _restore_stash(self) -> None:
        for p, grad in self._stash:
            p.grad = grad
        self._stash = []

    # ------------------------------------------------------------------ the step
    def on_step(self, trainer: pl.Trainer, ledger: StepLedger, optimizer: Optimizer) -> None:
        self._opened = True
        if self.lr_scaling == "adascale":
            ledger.scale_update("adascale", self._adascale.read_gain())  # this update's LR times the gain
        self.record_metric("stability/accumulation_steps", float(self._size))
        scale = self._adascale.gain if self.lr_scaling == "adascale" else lr_scale(self._factor, self.lr_scaling)
        self.record_metric("stability/lr_scale", scale)

    def after_step(self, trainer: pl.Trainer, ledger: StepLedger) -> None:
        """Row 13 of the step table, beside the LR schedule: the next window's factor, and the LR of its update (with
        ``lr_scaling`` and no ``ScheduledLR``, which otherwise folds the scaling into its own LR)."""
        self._decided = self._next_factor(ledger)
        if self._optimizer is not None:
            self._lr.set_factor(self._optimizer, self._decided)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._restore_stash()  # training_step returned None: no backward ran
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    # ------------------------------------------------------------------ teardown and checkpointing
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        _compat.override_accumulation_decision(trainer, None)  # Lightning's own decision again
        trainer.accumulate_grad_batches = 1
        for module in self._fsdp:
            module.set_requires_gradient_sync(True, recurse=False)
        self._fsdp = []
        self._tuner.remove()
        self._adascale.stop()
        self._restore_stash()

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        super().on_save_checkpoint(trainer, pl_module, checkpoint)
        # AdaScale keeps numpy arrays in the optimizer state, which `torch.load(weights_only=True)` refuses;
        # they travel as lists in this callback's state instead.
        adascale.strip_from_checkpoint(checkpoint)

    def state_dict(self) -> dict[str, Any]:
        return {
            "micro": self._micro,
            "size": self._size,
            "factor": self._factor,
            "base_lrs": list(self._lr.base_lrs),
            "adascale": adascale.export_statistics(self._optimizer),
            "grown": [[k, v] for k, v in sorted(self._grown.items())],
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._micro = int(state_dict.get("micro", 0))
        self._size = int(state_dict.get("size", 0))
        self._factor = int(state_dict.get("factor", self._schedule.factors[0]))
        self._lr.base_lrs = [float(x) for x in state_dict.get("base_lrs", [])]
        self._adascale.saved_statistics = state_dict.get("adascale")
        self._grown = {int(k): int(v) for k, v in state_dict.get("grown", [])}
        self._rebuild()

    def transient_state(self) -> dict[str, Any]:
        return {"_optimizer": None, "_stash": [], "_tuner": TunerSearchGuard(), "_fsdp": []}


def fsdp_to_drive(strategy: Any, pl_module: pl.LightningModule) -> list[Any]:
    """The FSDP2 modules (``fully_shard``) in ``pl_module`` whose gradient sync nobody else turns off on the
    non-final micro-batches: under a strategy that keeps Lightning's default ``block_backward_sync`` (DDP's
    ``no_sync`` only), such as Lightning's ``ModelParallelStrategy``, where ``configure_model`` applied
    ``fully_shard``. Left alone, FSDP2 reduce-scatters every micro-batch's gradients across the data-parallel ranks:
    the same sum, at ``k`` times the communication. A strategy with its own ``block_backward_sync``
    (``StableFSDPStrategy``) drives them itself: none."""
    from lightning.pytorch.strategies import ParallelStrategy

    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch built without distributed
        return []
    if not isinstance(strategy, ParallelStrategy):
        return []
    if type(strategy).block_backward_sync is not ParallelStrategy.block_backward_sync:
        return []
    return [m for m in pl_module.modules() if isinstance(m, FSDPModule)]


def check_trainer(trainer: pl.Trainer, pl_module: pl.LightningModule, me: str) -> None:
    """At ``setup("fit")``: nothing else accumulates, automatic optimization, Lightning internals present.

    ``me`` names the callback in the messages (the one-instance check is the template's).
    """
    if trainer.accumulate_grad_batches != 1:
        raise StabilityConfigError(
            f"Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}) and {me} would both "
            "accumulate gradients. Fix: remove `accumulate_grad_batches` from the Trainer and give the "
            f"factor to GradientAccumulation(steps={trainer.accumulate_grad_batches})."
        )
    callbacks = trainer.callbacks  # type: ignore[attr-defined]
    if any(isinstance(cb, GradientAccumulationScheduler) for cb in callbacks):
        raise StabilityConfigError(
            f"Lightning's GradientAccumulationScheduler and {me} would both set the accumulation factor. "
            "Fix: remove GradientAccumulationScheduler; GradientAccumulation(steps={update: factor}) "
            "switches at any optimizer step, epoch boundaries included."
        )
    if not pl_module.automatic_optimization:
        raise StabilityConfigError(
            f"{me} drives Lightning's automatic optimization, but the module sets "
            "`automatic_optimization = False`. Fix: accumulate in your own training_step, or remove "
            "the callback."
        )
    if trainer.strategy.handles_gradient_accumulation:
        raise StabilityConfigError(
            f"strategy={type(trainer.strategy).__name__} accumulates gradients itself. Fix: configure "
            "accumulation in the strategy (e.g. DeepSpeed's gradient_accumulation_steps) and remove "
            f"{me}."
        )


def check_lr_schedulers(trainer: pl.Trainer, lr_scaling: str, max_factor: int, has_schedule: bool) -> None:
    """At ``on_fit_start`` (after ``configure_optimizers``): the LR has one writer.

    ``lr_scaling="linear"``/``"sqrt"`` writes the LR; so does an LR scheduler returned by
    ``configure_optimizers``, unless a ``ScheduledLR`` (``has_schedule``) folds the scaling in.
    """
    scales = lr_scaling in ("linear", "sqrt") and max_factor > 1
    if scales and trainer.lr_scheduler_configs and not has_schedule:
        names = [type(config.scheduler).__name__ for config in trainer.lr_scheduler_configs]
        raise config_error(
            "lr_scaling",
            lr_scaling,
            f"writes the LR, and so do the LR scheduler(s) {names} from `configure_optimizers`: one would "
            "silently undo the other",
            "let ScheduledLR (or WarmupConstantCosineLR) schedule the LR, which folds the accumulation scaling "
            "in, or pass lr_scaling='none' and scale the LR yourself",
        )


class AccumulationLR:
    """Writes ``base_lr * lr_scale(k, scaling)`` into each param group whenever the factor ``k`` changes.

    The base LRs are read once per run from the optimizer (the LR ``configure_optimizers`` set, for one
    micro-batch), unless a checkpoint supplied them (:attr:`base_lrs`).
    """

    def __init__(self, scaling: str) -> None:
        self.scaling = scaling
        self.active = False  # this callback writes the LR (no ScheduledLR folds the scaling in)
        self.base_lrs: list[float] = []
        self._factor: int | None = None  # the factor whose scale is in the param groups

    def reset(self) -> None:
        """At setup: forget the previous run (a checkpoint loaded afterwards refills :attr:`base_lrs`)."""
        self.base_lrs, self._factor = [], None

    def start(self, optimizer: Optimizer, active: bool) -> None:
        """At train start: read the base LRs unless a checkpoint gave them."""
        self.active = active
        if active and not self.base_lrs:
            # HOST SYNC (once): a user-supplied tensor LR is read on the host here.
            self.base_lrs = [float(g["lr"]) for g in optimizer.param_groups]
        self._factor = None

    def set_factor(self, optimizer: Optimizer, k: int) -> None:
        """At a window start: write the LR of factor ``k`` if it is not already in the param groups."""
        if self.active and k != self._factor:
            scale = lr_scale(k, self.scaling)
            for group, base in zip(optimizer.param_groups, self.base_lrs, strict=True):
                group["lr"] = base * scale
            self._factor = k

    def adopt_written(self, optimizer: Optimizer | None) -> None:
        """After a search during training: an LR it wrote (not ours) becomes the base for one micro-batch.

        A search before train start (``Tuner.lr_find``, ``LearningRateFinder`` at fit start) leaves its LR
        in the optimizer for :meth:`start` to read; then there is nothing to do here.
        """
        if not (self.active and self.base_lrs and self._factor is not None and optimizer is not None):
            return
        written = [base * lr_scale(self._factor, self.scaling) for base in self.base_lrs]
        current = [float(g["lr"]) for g in optimizer.param_groups]
        if current != written:  # the next window scales the new base
            self.base_lrs, self._factor = current, None


#: The tuner callbacks and the public method that runs each one's search.
# private: relies on Lightning calling these through the instance (`LearningRateFinder.on_fit_start` ->
# `self.lr_find`, `BatchSizeFinder.on_fit_start` -> `self.scale_batch_size`) and on the search replacing
# `trainer.callbacks` while it runs (lightning/pytorch/tuner/lr_finder.py, batch_size_scaling.py).
SEARCHES: tuple[tuple[type[Callback], str], ...] = (
    (LearningRateFinder, "lr_find"),
    (BatchSizeFinder, "scale_batch_size"),
)

Guard = Callable[[pl.Trainer], AbstractContextManager[Any]]


class _Guarded:
    """A tuner callback's search method, run inside ``guard(trainer)``."""

    def __init__(self, search: Callable[..., Any], guard: Guard, replaced: Any) -> None:
        self.search = search
        self.guard = guard
        self.replaced = replaced  # the instance attribute this one replaced (None: the class's method)

    def __call__(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> Any:
        with self.guard(trainer):
            return self.search(trainer, *args, **kwargs)


class TunerSearchGuard:
    """Wraps the searches of the tuner callbacks attached to a Trainer; :meth:`remove` undoes it."""

    def __init__(self) -> None:
        self._wrapped: list[tuple[Callback, str]] = []

    def install(self, trainer: pl.Trainer, guard: Guard) -> None:
        """Wrap every attached tuner callback's search in ``guard`` (once per instance; idempotent)."""
        self.remove()
        for cb in trainer.callbacks:  # type: ignore[attr-defined]
            for kind, name in SEARCHES:
                if not isinstance(cb, kind):
                    continue
                own = vars(cb).get(name)
                if isinstance(own, _Guarded):  # left over from a fit that did not reach teardown
                    wrapper = _Guarded(own.search, guard, own.replaced)
                else:
                    wrapper = _Guarded(getattr(cb, name), guard, own)
                setattr(cb, name, wrapper)
                self._wrapped.append((cb, name))

    def remove(self) -> None:
        for cb, name in self._wrapped:
            own = vars(cb).get(name)
            if not isinstance(own, _Guarded):
                continue
            if own.replaced is None:
                delattr(cb, name)
            else:
                setattr(cb, name, own.replaced)
        self._wrapped = []
