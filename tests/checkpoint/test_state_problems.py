"""Each reason of ``state_problems`` on its own, with real Trainers: the state after a step is refused for that
reason alone, and ``StableCheckpoint`` does not save it.

* non-finite weights after a step whose loss was finite (nothing else wrong);
* an update that was skipped (a vote on the step ledger) with a finite loss, finite gradients and weights, and no
  spike.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor

from lightning_stability import AtomicCheckpointIO, GradientNormMonitor, StableCheckpoint
from lightning_stability.checkpoint.callback import state_problems
from lightning_stability.ledger.step_ledger import StepLedger
from lightning_stability.ledger.track import Outcome
from tests.checkpoint.test_stable_checkpoint import steps_on_disk
from tests.helpers import TinyModule, quiet_trainer

BAD = 3  # the step that starts at this global step goes wrong; it closes as step BAD + 1


class Reasons(pl.Callback):
    """``state_problems`` after every step (before ``StableCheckpoint`` looks), by the step it closed as."""

    def __init__(self) -> None:
        self.by_step: dict[int, list[str]] = {}

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, *args: Any) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.by_step[trainer.global_step] = state_problems(trainer, loss)


class NanWeightAfterStep(TinyModule):
    """After the optimizer step that starts at BAD, one weight is NaN; the loss of that step was finite. The next
    steps' losses are NaN (the weight stays), so only step BAD + 1 has this reason alone."""

    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        super().optimizer_step(*args, **kwargs)
        if self.global_step == BAD:
            with torch.no_grad():
                self.net[0].weight[0, 0] = float("nan")


class SkipVote(pl.Callback):
    """Votes to skip the update of the step that starts at BAD (a clean loss, clean gradients)."""

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, optimizer: Any) -> None:
        if trainer.global_step == BAD:
            StepLedger.of(trainer).mark_skip(Outcome.SKIPPED_SPIKE, True, optimizer)


def fit(tmp_path: Path, module: pl.LightningModule, *callbacks: pl.Callback) -> Reasons:
    pl.seed_everything(0)
    reasons = Reasons()
    ckpt = StableCheckpoint(dirpath=tmp_path / "ckpts", every_n_train_steps=1, keep=100)
    trainer = quiet_trainer(
        max_steps=BAD + 3,
        enable_checkpointing=True,
        plugins=[AtomicCheckpointIO()],
        callbacks=[*callbacks, reasons, ckpt],
    )
    trainer.fit(module)
    return reasons


def test_non_finite_weights_with_a_finite_loss_are_refused(tmp_path: Path) -> None:
    reasons = fit(tmp_path, NanWeightAfterStep())
    assert all(reasons.by_step[step] == [] for step in range(1, BAD + 1))
    assert reasons.by_step[BAD + 1] == ["a weight is not finite"]
    assert steps_on_disk(tmp_path / "ckpts") == list(range(1, BAD + 1))


def test_a_skipped_update_alone_is_refused(tmp_path: Path) -> None:
    module = TinyModule()
    before: dict[str, Tensor] = {}

    class Weights(pl.Callback):
        def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, *args: Any) -> None:
            if trainer.global_step == BAD:
                before.update({k: v.detach().clone() for k, v in pl_module.state_dict().items()})

        def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, *args: Any) -> None:
            if trainer.global_step == BAD + 1:  # the vote was enforced: the weights did not move
                assert all(torch.equal(before[k], v) for k, v in pl_module.state_dict().items())

    # GradientNormMonitor opens and closes each step on the ledger (the gradients are finite: it skips nothing)
    reasons = fit(tmp_path, module, GradientNormMonitor(), SkipVote(), Weights())
    assert reasons.by_step[BAD + 1] == ["the last update was skipped: SKIPPED_SPIKE"]
    assert all(reasons.by_step[step] == [] for step in reasons.by_step if step != BAD + 1)
    # not saved at the skipped step; the next healthy one is
    assert steps_on_disk(tmp_path / "ckpts") == [s for s in range(1, BAD + 4) if s != BAD + 1]
