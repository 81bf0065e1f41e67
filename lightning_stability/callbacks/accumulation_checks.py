"""GradientAccumulation's conflict checks: what else in the Trainer would accumulate or write the LR.

Each check raises a ``StabilityConfigError`` that names the conflict and the fix; none changes anything.
"""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.callbacks import GradientAccumulationScheduler

from lightning_stability.errors import StabilityConfigError, config_error

__all__ = ["check_lr_schedulers", "check_trainer"]


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
