"""ScheduledLR and WarmupConstantCosineLR: the learning rate as a function of applied optimizer updates."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_stability.callbacks.base import LedgerCallback
from lightning_stability.errors import StabilityConfigError, check_positive_int, config_error
from lightning_stability.ledger import StepLedger
from lightning_stability.schedules import Schedule, WarmupConstantCosineSchedule

ScheduleFn = Callable[[int, "int | None"], float]


@runtime_checkable
class LRScaleSource(Protocol):
    """A callback that contributes a factor to the learning rate (e.g. :class:`GradientAccumulation`).

    :class:`ScheduledLR` looks for one among the Trainer's callbacks and folds it into the one formula
    ``lr = base_lr * schedule(applied) * source.lr_scale_at(applied)``.
    """

    def lr_scale_at(self, applied_steps: int) -> float:
        """The LR factor for the update that follows ``applied_steps`` applied updates."""
        ...

    def estimated_optimizer_steps(self, trainer: pl.Trainer) -> int | None:
        """Optimizer steps in the whole run, when the source changes how batches map to steps."""
        ...


def supports_tensor_lr(optimizer: Optimizer) -> bool:
    """Whether every param group of ``optimizer`` can take a device tensor ``lr`` without host syncs.

    Fused Adam/AdamW/SGD and capturable Adam/AdamW read a tensor LR inside their kernels. The other
    implementations turn it into a Python number once per parameter (a host sync each).
    """
    return all(bool(g.get("fused")) or bool(g.get("capturable")) for g in optimizer.param_groups)


def _schedule_name(schedule: Schedule | ScheduleFn) -> str:
    """The schedule's name in the callback's ``state_key``: the same in every process.

    A function's ``repr`` holds its memory address, which changes from run to run: keyed by it, a resumed
    run would not find its saved state (the base LRs) and would take the scheduled LR for the base.
    """
    if isinstance(schedule, Schedule):
        return repr(schedule)
    named = schedule if hasattr(schedule, "__qualname__") else type(schedule)
    return f"{named.__module__}.{named.__qualname__}"


def _device_of(optimizer: Optimizer) -> torch.device:
    for group in optimizer.param_groups:
        for p in group["params"]:
            return (p.to_local() if hasattr(p, "to_local") else p).device
    return torch.device("cpu")


class ScheduledLR(LedgerCallback):
    """Set every param group's LR to ``base_lr * schedule(applied_updates)`` before each optimizer update.

    ``applied_updates`` is the :class:`~lightning_stability.ledger.StepLedger`'s count of updates that
    were actually applied: a step skipped by the fp16 loss scaler, for a non-finite gradient or for a
    spike does not advance the curve. The LR of the first update is ``schedule(0)``, set at
    ``on_train_start``; after each step closes the LR of the next update is set, so
    ``LearningRateMonitor`` (which reads ``optimizer.param_groups``) sees the LR the coming update uses.
    Each param group keeps its own base LR, recorded once from the optimizer at the start of training
    (the optimizer's arguments are not changed) and saved in the checkpoint; a resumed run continues
    the curve exactly. The run length comes from ``total_steps`` or, by default, from
    ``trainer.estimated_stepping_batches`` (or from :class:`GradientAccumulation` when it changes the
    number of batches per step).

    With :class:`GradientAccumulation` among the callbacks, its LR scaling is folded in here:
    ``lr = base_lr * schedule(n) * accumulation.lr_scale_at(n)`` is computed in this one place.

    No host sync is added to a training step: the applied count is a host integer while every skip
    decision was made on the host (no skips; non-finite skips of non-fused optimizers; the fp16 scaler's
    skips of non-fused optimizers). When a decision stayed on the device (fused optimizers skipping via
    ``found_inf``, with or without the fp16 scaler), the multiplier is looked up on the device in a table
    of the schedule (4 bytes per step) and written as a tensor ``lr``, which fused and capturable
    optimizers read in their kernels. (Non-fused optimizers leave no decision on the device; should they
    meet device-decided counts anyway, e.g. from a checkpoint of a fused run, they cost one sync a step.)

    Logged keys (on logging steps, through the ledger):

    ========================  ===========================================================
    Key                       Meaning
    ========================  ===========================================================
    ``stability/lr``          LR of the first param group for this update
    ``stability/lr/pg<i>``    LR of param group ``i`` (``i >= 1``), when there are several
    ========================  ===========================================================

    Args:
        schedule: a :class:`~lightning_stability.schedules.Schedule` (``CosineSchedule(warmup=0.05)``,
            ``LinearSchedule``, ``StepSchedule``, ``InverseSqrtSchedule``,
            ``WarmupConstantCosineSchedule``) or any ``f(step, total_steps) -> multiplier``.
        total_steps: number of optimizer updates in the run; default: from the Trainer.
        log_every_n_steps: log every this many optimizer steps; default: the Trainer's.

    Raises:
        StabilityConfigError: for a bad argument; at ``on_fit_start`` when ``configure_optimizers``
            also returns an LR scheduler, or when two LR schedule callbacks are attached.

    Example::

        trainer = L.Trainer(callbacks=[ScheduledLR(CosineSchedule(warmup=0.05, min_lr_ratio=0.1))])
    """

    def __init__(
        self,
        schedule: Schedule | ScheduleFn,
        total_steps: int | None = None,
        log_every_n_steps: int | None = None,
    ) -> None:
        if not callable(schedule):
            raise config_error(
                "schedule",
                schedule,
                "is not a schedule",
                "pass e.g. CosineSchedule(warmup=0.05) or f(step, total)",
            )
        if total_steps is not None and (
            isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps < 1
        ):
            raise config_error("total_steps", total_steps, "must be an int >= 1", "pass e.g. 10000, or None")
        if log_every_n_steps is not None:
            check_positive_int("log_every_n_steps", log_every_n_steps, "50, or None for the Trainer's")
        if isinstance(schedule, Schedule) and total_steps is not None:
            schedule.validate(total_steps)
        self.schedule = schedule
        self.total_steps = total_steps
        self.log_every_n_steps = log_every_n_steps
        self._every_n = log_every_n_steps or 50
        self._base_lrs: list[list[float]] = []
        self._total: int | None = None
        self._source: LRScaleSource | None = None
        self._optimizers: list[Optimizer] = []
        self._table: Tensor | None = None
        self._state_key: str | None = None

    @property
    def state_key(self) -> str:
        # Lightning reads this around every hook call: build the string once.
        if self._state_key is None:
            self._state_key = self._generate_state_key(schedule=_schedule_name(self.schedule))
        return self._state_key

    # ------------------------------------------------------------------ the formula
    def multiplier(self, applied_steps: int) -> float:
        """The factor on each base LR for the update after ``applied_steps`` applied updates."""
        value = self.schedule(applied_steps, self._total)
        if self._source is not None:
            value *= self._source.lr_scale_at(applied_steps)
        return value

    # ------------------------------------------------------------------ setup
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        schedulers = [cb for cb in trainer.callbacks if isinstance(cb, ScheduledLR)]  # type: ignore[attr-defined]
        if len(schedulers) > 1:
            raise StabilityConfigError(
                f"{len(schedulers)} LR schedule callbacks are attached "
                f"({[type(cb).__name__ for cb in schedulers]}); each would overwrite the others' "
                "learning rate. Fix: keep exactly one."
            )
        self._every_n = self.log_every_n_steps or trainer.log_every_n_steps or 1  # type: ignore[attr-defined]
        # A checkpoint, if any, is loaded after this hook and refills them.
        self._base_lrs = []

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # `configure_optimizers` has run by now (strategy setup), so its schedulers are known.
        if trainer.lr_scheduler_configs:
            names = [type(config.scheduler).__name__ for config in trainer.lr_scheduler_configs]
            raise StabilityConfigError(
                f"`configure_optimizers` returns LR scheduler(s) {names} and {type(self).__name__} also sets "
                "the learning rate: both would write it. Fix: return only the optimizer from "
                f"`configure_optimizers`, or remove {type(self).__name__} from the Trainer's callbacks."
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
        self._total = self._resolve_total(trainer)
        if isinstance(self.schedule, Schedule):
            self.schedule.validate(self._total)
        self._table = None
        ledger = StepLedger.of(trainer)
        # The LR's type follows the ledger: a float while counts are on the host, a device tensor once a
        # decision stayed on the device. A resumed run restores the ledger, hence the same type as before.
        as_tensor = ledger.applied_steps_host is None and self._tensor_lr_ok()
        self._set_host(ledger.applied_steps_now(), as_tensor)  # HOST SYNC (once, before the first step) at most

    def _resolve_total(self, trainer: pl.Trainer) -> int | None:
        if self.total_steps is not None:
            return self.total_steps
        estimate = self._source.estimated_optimizer_steps(trainer) if self._source is not None else None
        if estimate is None:
            stepping = trainer.estimated_stepping_batches
            # inf for endless runs; `max_steps` (-1 when unset) for iterable datasets without a length
            estimate = int(stepping) if math.isfinite(stepping) and stepping > 0 else None
        needs_total = self.schedule.needs_total_steps if isinstance(self.schedule, Schedule) else True
        if estimate is None and needs_total:
            raise StabilityConfigError(
                f"{type(self).__name__} needs the run length but the Trainer cannot estimate it (an iterable "
                "dataset without a length and no `max_steps`). Fix: pass `total_steps=` or set "
                "`Trainer(max_steps=)`."
            )
        return estimate

    # ------------------------------------------------------------------ writing the LR
    def _tensor_lr_ok(self) -> bool:
        return self._total is not None and all(supports_tensor_lr(opt) for opt in self._optimizers)

    def _set_host(self, applied: int, as_tensor: bool = False) -> None:
        mult = self.multiplier(applied)
        for opt, bases in zip(self._optimizers, self._base_lrs, strict=True):
            # the same float32 value the device table holds, so both paths give bit-identical LRs
            factor: float | Tensor = (
                torch.tensor(mult, dtype=torch.float32, device=_device_of(opt)) if as_tensor else mult
            )
            for group, base in zip(opt.param_groups, bases, strict=True):
                group["lr"] = factor * base

    def _device_table(self, device: torch.device) -> Tensor:
        if self._table is None or self._table.device != device:
            assert self._total is not None
            values = [self.multiplier(n) for n in range(self._total + 1)]
            self._table = torch.tensor(values, dtype=torch.float32, device=device)
        return self._table

    def _set_from_ledger(self, ledger: StepLedger) -> None:
        applied = ledger.applied_steps_host
        if applied is not None:
            self._set_host(applied)
            return
        count = ledger.applied_steps
        if not self._tensor_lr_ok():
            # HOST SYNC: this optimizer cannot read a tensor LR without syncing once per parameter, or the
            # schedule has no end to tabulate; one sync per step is the cheaper choice.
            self._set_host(int(count))
            return
        table = self._device_table(count.device)
        # index_select keeps the lookup on the device (indexing with a 0-dim tensor would sync).
        mult = table.index_select(0, count.clamp(max=self._total).view(1)).view(())
        for opt, bases in zip(self._optimizers, self._base_lrs, strict=True):
            for group, base in zip(opt.param_groups, bases, strict=True):
                # A new tensor each step: LearningRateMonitor keeps references to the values it logged.
                group["lr"] = mult * base

    # ------------------------------------------------------------------ the step
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        ledger = StepLedger.of(trainer)
        ledger.open_step(optimizer)
        if ledger.is_logging_step(self._every_n):
            for i, group in enumerate(optimizer.param_groups):
                lr = group["lr"]
                ledger.log(
                    "stability/lr" if i == 0 else f"stability/lr/pg{i}",
                    lr if isinstance(lr, Tensor) else float(lr),
                )
        ledger.on_close(self._set_from_ledger)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._table = None

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        # The position on the curve is the ledger's applied count, saved once with the ledger.
        return {"base_lrs": [list(b) for b in self._base_lrs], "total_steps": self._total}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._base_lrs = [list(map(float, b)) for b in state_dict.get("base_lrs", [])]

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.update(_optimizers=[], _table=None, _source=None)
        return state


class WarmupConstantCosineLR(ScheduledLR):
    """The design card's LR schedule: linear warmup, constant, cosine decay at the end (seed rows 5-8).

    With the defaults (``warmup=0.05, decay=0.20``): 5% linear warmup, constant to 80% of the run,
    cosine over the last 20% (the seed's mixed strategy for 100B-scale models). ``warmup=0.05,
    decay=0.95`` is the 175B recipe's plain cosine with 5% warmup. Lengths ``< 1`` are fractions of
    the run, lengths ``>= 1`` step counts. Everything else is :class:`ScheduledLR`: the LR follows
    applied updates only, the first update uses ``base_lr / warmup_steps``, warmup and decay never
    overlap, each param group keeps its base LR, and a resumed run continues the curve exactly.

    Logged keys: as :class:`ScheduledLR` (``stability/lr``, ``stability/lr/pg<i>``).

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
