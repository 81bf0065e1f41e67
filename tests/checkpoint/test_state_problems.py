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
import pytest
import torch
from torch import Tensor

from lightning_stability import AtomicCheckpointIO, GradientNormMonitor, StableCheckpoint, TrainingHealthMonitor
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


class LossSettlesHigher(TinyModule):
    """The loss is 30 times higher from global step ``at`` on, for good: a new level, not a spike."""

    def __init__(self, at: int) -> None:
        super().__init__(lr=0.01)
        self.at = at

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = super().training_step(batch, batch_idx)
        return loss * 30 if self.global_step >= self.at else loss


class Verdicts(pl.Callback):
    """By the step each optimizer step closed as: the monitor's verdict (spike, new level), the z-scores it logged
    and whether the update was applied (host reads: tests only)."""

    def __init__(self) -> None:
        self.spike: dict[int, bool] = {}
        self.new_level: dict[int, bool] = {}
        self.z: dict[int, float] = {}
        self.applied: dict[int, bool] = {}

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        ledger, step = StepLedger.of(trainer), trainer.global_step
        assert ledger.health is not None
        self.spike[step], self.new_level[step] = bool(ledger.health.spike), bool(ledger.health.new_level)
        metrics = trainer.callback_metrics
        self.z[step] = max(float(metrics["stability/loss_z"]), float(metrics["stability/grad_norm_z"]))
        self.applied[step] = int(ledger.outcome) == Outcome.APPLIED


def test_a_new_level_is_saved_as_soon_as_the_monitor_stops_calling_it_a_spike(tmp_path: Path) -> None:
    """The loss settles 30x higher at step 40. The monitor calls the first steps above its threshold spikes (skipped,
    not saved), then a new level: it trains on, and StableCheckpoint saves those steps too. Deciding "spike" again
    from the logged z-scores (``z > spike_z``, as StableCheckpoint did before it read the verdict) would have
    deferred every step of the new level although the monitor applied its updates."""
    pl.seed_everything(0)
    verdicts = Verdicts()
    monitor = TrainingHealthMonitor(response="skip", warmup_steps=10, report=False)
    ckpt = StableCheckpoint(dirpath=tmp_path / "ckpts", every_n_train_steps=1, keep=1000)
    trainer = quiet_trainer(
        max_steps=90, enable_checkpointing=True, plugins=[AtomicCheckpointIO()], callbacks=[monitor, verdicts, ckpt]
    )
    with pytest.warns(UserWarning, match="new level"):
        trainer.fit(LossSettlesHigher(at=40))
    saved = set(steps_on_disk(tmp_path / "ckpts"))
    spikes = {s for s, spike in verdicts.spike.items() if spike}
    level = {s for s, new in verdicts.new_level.items() if new and not verdicts.spike[s]}
    over = {s for s, z in verdicts.z.items() if z > monitor.spike_z}  # the z-score rule
    assert spikes and all(s > 40 for s in spikes), spikes
    assert not spikes & saved  # a real spike is never saved
    assert saved == {s for s in verdicts.applied if verdicts.applied[s] and s not in spikes}
    # the new level's steps: above spike_z, applied by the monitor, and saved
    assert level and level <= over, (level, over)
    assert all(verdicts.applied[s] for s in level)
    assert level <= saved, sorted(level - saved)
    assert max(saved) == 90  # the run ends saving
