"""How many updates an LR schedule runs over, per optimizer, from the Trainer's limits or ``total_steps``."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_warn

from lightning_stability.errors import StabilityConfigError, config_error


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
