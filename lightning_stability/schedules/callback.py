"""ScheduledLR and WarmupConstantCosineLR: the learning rate as a function of applied optimizer updates.

Also here, what :class:`ScheduledLR` reads from around it: a callback that scales the LR (:class:`LRScaleSource`),
the schedule's name for the
callback's ``state_key`` (:func:`schedule_name`), and how many updates a schedule runs over, per optimizer, from
the Trainer's limits or ``total_steps`` (:func:`run_lengths`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor
from torch.optim import Optimizer

from lightning_stability.errors import StabilityConfigError, config_error
from lightning_stability.ledger.callback import LedgerCallback
from lightning_stability.ledger.step_ledger import StepLedger
from lightning_stability.ledger.track import device_of
from lightning_stability.ledger.update import supports_tensor_lr
from lightning_stability.schedules.specs import (
    Schedule,
    WarmupConstantCosineSchedule,
    check_multiplier,
    check_schedule_callable,
)


class ScheduledLR(LedgerCallback):
    """Set every param group's LR to ``base_lr * schedule(applied_updates)`` before each optimizer update.

    ``applied_updates`` is the :class:`~lightning_stability.ledger.step_ledger.StepLedger`'s count of updates that
    were actually applied: a step skipped by the fp16 loss scaler, for a non-finite gradient or for a
    spike does not advance the curve. The LR of the first update is ``schedule(0)``, set at
    ``on_train_start``; after each step closes the LR of the next update is set, so
    ``LearningRateMonitor`` (which reads ``optimizer.param_groups``) sees the LR the coming update uses.
    Each param group keeps its own base LR, recorded once from the optimizer at the start of training
    (the optimizer's arguments are not changed) and saved in the checkpoint; a resumed run continues
    the curve exactly. The run length comes from ``total_steps`` or, by default, from
    ``trainer.estimated_stepping_batches`` (or from :class:`GradientAccumulation` when it changes the
    number of batches per step); a ``total_steps`` that disagrees with the Trainer's run length is
    warned about once at the start.

    **Several optimizers** (a GAN, manual optimization): each optimizer has its own clock, its own
    applied updates, and its own run length. By default every optimizer is expected to step once per
    batch (the Trainer's count of batches); pass ``total_steps=[n_0, n_1, ...]`` when they step at other
    rates (e.g. a discriminator that steps five times per generator step). An optimizer that steps more
    often than its run length is warned about once, when it passes the end.

    With :class:`GradientAccumulation` among the callbacks, its LR scaling is folded in here:
    ``lr = base_lr * schedule(n) * accumulation.lr_scale_at(n)`` is computed in this one place. Once a
    :class:`~lightning_stability.critical_batch.BatchRamp` grew the batch, ``n`` counts samples: the samples the
    applied updates trained on, in updates of the starting batch (``GradientAccumulation.schedule_position``), so
    the run length is the run's steps at the starting batch.

    No host sync is added to a training step: where skips are decided on the device (fused optimizers), the LR is
    looked up on the device in a table of the schedule (4 bytes per step) and written as a tensor ``lr``.

    Logged keys (to the loggers on logging steps; in ``trainer.callback_metrics`` after every step):

    =================================  ===========================================================
    Key                                Meaning
    =================================  ===========================================================
    ``stability/lr``                   LR the update used in the first param group (times every factor on it)
    ``stability/lr_by_group/pg<i>``    LR of each param group ``i`` (``pg0`` too), when there are several
    =================================  ===========================================================

    With several optimizers each key ends in ``/<optimizer>`` (``LearningRateMonitor``'s names).

    Args:
        schedule: a :class:`~lightning_stability.schedules.Schedule` (``CosineSchedule(warmup=0.05)``,
            ``LinearSchedule``, ``StepSchedule``, ``InverseSqrtSchedule``,
            ``WarmupConstantCosineSchedule``) or any ``f(step, total_steps) -> multiplier`` returning a
            finite number ``>= 0``.
        total_steps: optimizer updates in the run (one int, or one per optimizer); default: from the Trainer.
        log_every_n_steps: log every this many optimizer steps; default: the Trainer's.

    Raises:
        StabilityConfigError: for a bad argument (a schedule that does not take ``(step, total_steps)``);
            when the schedule returns a NaN, infinite or negative multiplier; at ``on_fit_start`` when
            ``configure_optimizers`` also returns an LR scheduler, or when two LR schedule callbacks are
            attached; at ``on_train_start`` when the run length is needed but the run has none.

    Example::

        trainer = L.Trainer(callbacks=[ScheduledLR(CosineSchedule(warmup=0.05, min_lr_ratio=0.1))])
    """

    one_instance_reason = "each would overwrite the others' learning rate"

    def __init__(
        self,
        schedule: Schedule | ScheduleFn,
        total_steps: int | Sequence[int] | None = None,
        log_every_n_steps: int | None = None,
    ) -> None:
        super().__init__(log_every_n_steps)
        if not callable(schedule):
            raise config_error(
                "schedule",
                schedule,
                "is not a schedule",
                "pass e.g. CosineSchedule(warmup=0.05) or f(step, total)",
            )
        if not isinstance(schedule, Schedule):
            check_schedule_callable(schedule)
        if total_steps is None or isinstance(total_steps, int):
            totals: list[Any] = [total_steps]
        elif isinstance(total_steps, Sequence) and not isinstance(total_steps, str):
            totals = list(total_steps)
        else:
            totals = []
        if total_steps is not None and (
            not totals or any(isinstance(t, bool) or not isinstance(t, int) or t < 1 for t in totals)
        ):
            raise config_error(
                "total_steps", total_steps, "must be an int >= 1, or one per optimizer", "pass e.g. 10000, or None"
            )
        if isinstance(schedule, Schedule) and total_steps is not None:
            for total in totals:
                schedule.validate(total)
        self.schedule = schedule
        self.total_steps = total_steps
        self._base_lrs: list[list[float]] = []
        self._totals: list[int | None] = []
        self._source: LRScaleSource | None = None
        self._optimizers: list[Optimizer] = []
        self._tables: dict[int, Tensor] = {}
        self._table_revision: dict[int, int] = {}
        self._warned_past_end: set[int] = set()

    def state_fields(self) -> dict[str, Any]:
        return {"schedule": schedule_name(self.schedule)}

    # ------------------------------------------------------------------ the formula
    def multiplier(self, applied_steps: int, optimizer_index: int = 0) -> float:
        """The factor on each base LR for the update after ``applied_steps`` applied updates.

        The schedule stands at ``source.schedule_position(applied_steps)``: the applied count, or, once a batch
        ramp grew the batch, the samples trained on in updates of the starting batch."""
        total = self._totals[optimizer_index] if optimizer_index < len(self._totals) else None
        position = applied_steps if self._source is None else self._source.schedule_position(applied_steps)
        if total is not None:
            # past its end a schedule holds its final value, on the host as in the device table
            position = min(position, total)
        value = check_multiplier(self.schedule(position, total), position, self.schedule)
        if self._source is not None:
            value *= self._source.lr_scale_at(applied_steps)
        return value

    # ------------------------------------------------------------------ setup
    def on_setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # A checkpoint, if any, is loaded after this hook and refills them.
        self._base_lrs = []

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # `configure_optimizers` has run by now (strategy setup), so its schedulers are known.
        if trainer.lr_scheduler_configs:
            names = [type(config.scheduler).__name__ for config in trainer.lr_scheduler_configs]
            raise StabilityConfigError(
                f"`configure_optimizers` returns LR scheduler(s) {names} and {type(self).__name__} also sets "
                "the learning rate: both would write it. Fix: return only the optimizer from "
                f"`configure_optimizers`, or remove {type(self).__name__} from the Trainer's callbacks "
                "(from a preset: StableTrainer.from_preset(..., lr_schedule=False) keeps your scheduler)."
            )

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._optimizers = list(trainer.optimizers)
        groups = [len(opt.param_groups) for opt in self._optimizers]
        if not self._base_lrs:
            # HOST SYNC (once): a user-supplied tensor LR is read on the host here.
            self._base_lrs = [[float(g["lr"]) for g in opt.param_groups] for opt in self._optimizers]
        elif [len(b) for b in self._base_lrs] != groups:
            raise StabilityConfigError(
                f"The checkpoint holds base LRs for param groups {[len(b) for b in self._base_lrs]} but the "
                f"optimizers now have {groups}. Fix: resume with the same `configure_optimizers`."
            )
        sources = [cb for cb in trainer.callbacks if isinstance(cb, LRScaleSource)]  # type: ignore[attr-defined]
        self._source = sources[0] if sources else None
        # an optimizer already told at fit start that its schedule ends early is not warned again
        self._totals, self._warned_past_end = self._resolve_totals(trainer)
        if isinstance(self.schedule, Schedule):
            for total in set(self._totals):
                self.schedule.validate(total)
        self._tables = {}
        ledger = StepLedger.of(trainer)
        for index, opt in enumerate(self._optimizers):
            applied = ledger.record_of(opt).applied_steps
            # The LR's type follows the ledger: a float while counts are on the host, a device tensor once a
            # decision stayed on the device. A resumed run restores the ledger, hence the same type as before.
            as_tensor = isinstance(applied, Tensor) and self._tensor_lr_ok(index)
            self._set_host(index, int(applied), as_tensor)  # HOST SYNC (once) at most

    def _resolve_totals(self, trainer: pl.Trainer) -> tuple[list[int | None], set[int]]:
        needs_total = self.schedule.needs_total_steps if isinstance(self.schedule, Schedule) else True
        return run_lengths(
            trainer, type(self).__name__, self.total_steps, len(self._optimizers), self._source, needs_total
        )

    # ------------------------------------------------------------------ writing the LR
    def _tensor_lr_ok(self, index: int) -> bool:
        return self._totals[index] is not None and supports_tensor_lr(self._optimizers[index])

    def _set_host(self, index: int, applied: int, as_tensor: bool = False) -> None:
        mult = self.multiplier(applied, index)
        opt = self._optimizers[index]
        # the same float32 value the device table holds, so both paths give bit-identical LRs
        factor: float | Tensor = torch.tensor(mult, dtype=torch.float32, device=device_of(opt)) if as_tensor else mult
        for group, base in zip(opt.param_groups, self._base_lrs[index], strict=True):
            group["lr"] = factor * base

    def _device_table(self, index: int, device: torch.device) -> Tensor:
        table = self._tables.get(index)
        revision = self._source.revision if self._source is not None else 0  # a ramp's change: new values
        if table is None or table.device != device or self._table_revision.get(index) != revision:
            total = self._totals[index]
            assert total is not None
            values = [self.multiplier(n, index) for n in range(total + 1)]
            table = self._tables[index] = torch.tensor(values, dtype=torch.float32, device=device)
            self._table_revision[index] = revision
        return table

    def after_step(self, trainer: pl.Trainer, ledger: StepLedger) -> None:
        """Log the LR this update used (the schedule's, times every factor on the update: ``ledger/step.py`` row
        8), then write the LR of this optimizer's next update, from its own applied-update count."""
        track = ledger.record_of()
        index = track.index
        step = ledger.step
        lrs = step.scale.used_lrs(step.optimizer)
        for i, lr in enumerate(lrs):
            value = lr if isinstance(lr, Tensor) else float(lr)
            if i == 0:
                self.record_metric("stability/lr", value)
            if len(lrs) > 1:  # every group, the first too, beside (never below) stability/lr
                self.record_metric(f"stability/lr_by_group/pg{i}", value)
        if index >= len(self._optimizers):
            return
        total = self._totals[index]
        if total is not None and track.steps > total and index not in self._warned_past_end:
            self._warned_past_end.add(index)
            rank_zero_warn(
                f"Optimizer {index} ({track.name}) has taken {track.steps} steps, more than the LR schedule's run "
                f"length of {total}: from here its LR stays at the schedule's final value. With several "
                "optimizers that step at different rates, pass ScheduledLR(total_steps=[...]) with each one's "
                "number of updates.",
                category=UserWarning,
            )
        count = track.applied_steps
        if not isinstance(count, Tensor):
            self._set_host(index, count)
            return
        if not self._tensor_lr_ok(index):
            # HOST SYNC: this optimizer cannot read a tensor LR without syncing once per parameter, or the
            # schedule has no end to tabulate; one sync per step is the cheaper choice.
            self._set_host(index, int(count))
            return
        assert total is not None
        table = self._device_table(index, count.device)
        # index_select keeps the lookup on the device (indexing with a 0-dim tensor would sync).
        mult = table.index_select(0, count.clamp(max=total).view(1)).view(())
        opt = self._optimizers[index]
        for group, base in zip(opt.param_groups, self._base_lrs[index], strict=True):
            # A new tensor each step: LearningRateMonitor keeps references to the values it logged.
            group["lr"] = mult * base

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._tables = {}

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        # The position on each curve is the ledger's applied count, saved once with the ledger.
        return {"base_lrs": [list(b) for b in self._base_lrs], "total_steps": list(self._totals)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._base_lrs = [list(map(float, b)) for b in state_dict.get("base_lrs", [])]

    def transient_state(self) -> dict[str, Any]:
        return {"_optimizers": [], "_tables": {}, "_table_revision": {}, "_source": None}


class WarmupConstantCosineLR(ScheduledLR):
    """The presets' LR schedule: linear warmup, constant, cosine decay at the end (warmup-stable-decay).

    With the defaults (``warmup=0.05, decay=0.20``): 5% linear warmup, constant to 80% of the run,
    cosine over the last 20% (a common recipe for 100B-scale models). ``warmup=0.05,
    decay=0.95`` is plain cosine with 5% warmup (the ``175b`` preset's schedule). Lengths ``< 1`` are fractions of
    the run, lengths ``>= 1`` step counts. Everything else is :class:`ScheduledLR`: the LR follows
    applied updates only, the first update uses ``base_lr / warmup_steps``, warmup and decay never
    overlap, each param group keeps its base LR, and a resumed run continues the curve exactly.

    Logged keys: as :class:`ScheduledLR` (``stability/lr``, ``stability/lr_by_group/pg<i>``).

    Args:
        warmup: warmup length; default 5% of the run.
        decay: length of the final cosine decay; default 20% of the run.
        min_lr_ratio: the floor of the decay, as a fraction of the base LR.
        total_steps: number of optimizer updates; default ``trainer.estimated_stepping_batches``.
        log_every_n_steps: log every this many optimizer steps; default: the Trainer's.

    Raises:
        StabilityConfigError: a bad length or floor, phases that overlap; see :class:`ScheduledLR`.

    Example::

        trainer = L.Trainer(max_steps=10_000, callbacks=[WarmupConstantCosineLR(min_lr_ratio=0.1)])
    """

    def __init__(
        self,
        warmup: float = 0.05,
        decay: float = 0.20,
        min_lr_ratio: float = 0.0,
        total_steps: int | None = None,
        log_every_n_steps: int | None = None,
    ) -> None:
        super().__init__(
            WarmupConstantCosineSchedule(warmup=warmup, decay=decay, min_lr_ratio=min_lr_ratio),
            total_steps=total_steps,
            log_every_n_steps=log_every_n_steps,
        )


ScheduleFn = Callable[[int, "int | None"], float]


@runtime_checkable
class LRScaleSource(Protocol):
    """A callback that contributes a factor to the learning rate (e.g. :class:`GradientAccumulation`).

    :class:`ScheduledLR` looks for one among the Trainer's callbacks and folds it into the one formula
    ``lr = base_lr * schedule(source.schedule_position(applied)) * source.lr_scale_at(applied)``.
    """

    #: bumped whenever the source's values change after the fact (a batch ramp's change)
    revision: int

    def schedule_position(self, applied_steps: int) -> int:
        """Where the schedule stands after ``applied_steps`` applied updates (``applied_steps``, or a count of
        samples in updates of the starting batch once a batch ramp changed the batch)."""
        ...

    def lr_scale_at(self, applied_steps: int) -> float:
        """The LR factor for the update that follows ``applied_steps`` applied updates."""
        ...

    def estimated_optimizer_steps(self, trainer: pl.Trainer) -> int | None:
        """Optimizer steps in the whole run, when the source changes how batches map to steps."""
        ...


def schedule_name(schedule: Schedule | ScheduleFn) -> str:
    """The schedule's name in the callback's ``state_key``: the same in every process.

    A function's ``repr`` holds its memory address, which changes from run to run: keyed by it, a resumed
    run would not find its saved state (the base LRs) and would take the scheduled LR for the base.
    """
    if isinstance(schedule, Schedule):
        return repr(schedule)
    named = schedule if hasattr(schedule, "__qualname__") else type(schedule)
    return f"{named.__module__}.{named.__qualname__}"


def run_lengths(
    trainer: pl.Trainer,
    owner: str,
    total_steps: int | Sequence[int] | None,
    n_optimizers: int,
    source: Any | None,
    needs_total: bool,
) -> tuple[list[int | None], set[int]]:
    """Each optimizer's number of updates: ``total_steps`` (one for all, or one each) or the Trainer's estimate.

    With one optimizer, warns once when ``total_steps`` disagrees with the run. With several (manual
    optimization), how often each one steps is the module's choice, so there is nothing to compare with
    until the run shows it: the schedule warns when an optimizer passes its end. Raises, naming the real
    cause, when the schedule needs a length that the run does not have.

    Returns:
        the run lengths, and the optimizers already warned that their schedule ends before the run does.
    """
    n = n_optimizers
    estimate = estimated_updates(trainer, n, source)
    if total_steps is not None:
        totals = [total_steps] * n if isinstance(total_steps, int) else list(total_steps)
        if len(totals) != n:
            raise config_error(
                "total_steps",
                total_steps,
                f"gives {len(totals)} run lengths for {n} optimizer(s)",
                f"pass one int for all, or one per optimizer ({n})",
            )
        if n > 1 or estimate is None or totals[0] == estimate:
            return list(totals), set()
        ends_early = totals[0] < estimate
        rank_zero_warn(
            f"{owner}(total_steps={total_steps}) but the Trainer will run {estimate} optimizer steps: the schedule "
            + (
                "ends early and the LR stays at its final value for the rest of the run"
                if ends_early
                else "will not reach its end (no full decay)"
            )
            + ". Fix: drop `total_steps` to follow the Trainer, or match it to the run.",
            category=UserWarning,
        )
        return list(totals), {0} if ends_early else set()
    if estimate is None and needs_total:
        raise StabilityConfigError(
            f"{owner} needs the run length but {_why_no_length(trainer)}. Fix: pass `total_steps=` or set "
            "`Trainer(max_steps=)`."
        )
    return [estimate] * n, set()


def estimated_updates(trainer: pl.Trainer, n_optimizers: int, source: Any | None) -> int | None:
    """Updates per optimizer in the whole run, as far as the Trainer can tell (``None``: endless or unknown)."""
    estimate = source.estimated_optimizer_steps(trainer) if source is not None else None
    n = n_optimizers
    if estimate is None and n > 1 and not trainer.lightning_module.automatic_optimization:
        # Manual optimization counts every optimizer's steps in `global_step` (and `max_steps`): with n
        # optimizers that each step once per batch, each takes one update per batch.
        batches, epochs = trainer.num_training_batches, trainer.max_epochs
        by_epochs = batches * epochs if epochs is not None and epochs >= 0 else math.inf
        by_steps = trainer.max_steps // n if trainer.max_steps >= 0 else math.inf
        total = min(by_epochs, by_steps)
        return int(total) if math.isfinite(total) and total > 0 else None
    if estimate is None:
        stepping = trainer.estimated_stepping_batches
        # inf for endless runs; `max_steps` (-1 when unset) for iterable datasets without a length
        estimate = int(stepping) if math.isfinite(stepping) and stepping > 0 else None
    return estimate


def _why_no_length(trainer: pl.Trainer) -> str:
    """Why the Trainer cannot say how many steps the run has, in the user's own settings."""
    from lightning.pytorch.callbacks import Timer

    if trainer.max_epochs == -1 and trainer.max_steps == -1:
        timers = [cb for cb in trainer.callbacks if isinstance(cb, Timer)]  # type: ignore[attr-defined]
        limit = "; it stops on `max_time` only" if timers else ""
        return f"the run has no set length (max_epochs=-1 and no max_steps{limit}), so no step count to schedule over"
    return "the training data is an iterable dataset without a length and no `max_steps` is set"
