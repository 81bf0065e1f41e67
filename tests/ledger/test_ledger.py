"""The StepLedger's own mechanics with real Trainers: skip votes from anywhere, one enforcement, the template."""

from __future__ import annotations

import logging
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from lightning_stability import GradientNormMonitor, Outcome, StabilityConfigError, StepLedger
from lightning_stability.ledger.callback import LedgerCallback
from tests.helpers import TinyModule, count_syncs_per_step, quiet_trainer

BAD = 2  # the step the votes below ask to skip


class Voter(pl.Callback):
    """Votes to skip step BAD from `on_before_optimizer_step`, as a health callback of a user's would."""

    def __init__(self, reason: Outcome = Outcome.SKIPPED_SPIKE) -> None:
        self.reason = reason

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        bad = torch.full((), trainer.global_step == BAD)  # a device flag, as a spike detector computes it
        # passing the hook's optimizer opens the step when no lightning_stability callback has yet
        StepLedger.of(trainer).mark_skip(self.reason, bad, optimizer)


class Snapshots(pl.Callback):
    def __init__(self) -> None:
        self.before: list[list[torch.Tensor]] = []
        self.after: list[list[torch.Tensor]] = []
        self.outcomes: list[int] = []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.before.append([p.detach().clone() for p in pl_module.parameters()])

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        ledger = StepLedger.of(trainer)
        ledger.close_step()
        self.outcomes.append(int(ledger.outcome))
        self.after.append([p.detach().clone() for p in pl_module.parameters()])


@pytest.mark.parametrize("optimizer", ["adamw", "adamw_fused"])
@pytest.mark.parametrize("voter_first", [True, False])
def test_a_vote_counts_whatever_the_callback_order(optimizer: str, voter_first: bool) -> None:
    snaps = Snapshots()
    ours = GradientNormMonitor(max_norm=1.0)
    order = [Voter(), ours] if voter_first else [ours, Voter()]
    trainer = quiet_trainer(max_steps=5, callbacks=[*order, snaps])
    trainer.fit(TinyModule(optimizer=optimizer))
    assert snaps.outcomes == [0, 0, int(Outcome.SKIPPED_SPIKE), 0, 0]
    assert all(torch.equal(a, b) for a, b in zip(snaps.before[BAD], snaps.after[BAD], strict=True))
    assert not torch.equal(snaps.before[BAD + 1][0], snaps.after[BAD + 1][0])
    assert StepLedger.of(trainer).record_of().counts.tolist() == [4, 0, 0, 1, 0, 0]


class VotingModule(TinyModule):
    """Votes to skip step BAD from the module's own ``on_before_optimizer_step``."""

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        bad = torch.full((), self.trainer.global_step == BAD)
        StepLedger.of(self.trainer).mark_skip(Outcome.SKIPPED_SPIKE, bad, optimizer)


class WeightsAndState(pl.Callback):
    """Parameters and optimizer state (AdamW's moments and step counts) before and after each batch."""

    def __init__(self) -> None:
        self.before: list[list[torch.Tensor]] = []
        self.after: list[list[torch.Tensor]] = []

    @staticmethod
    def _copy(trainer: pl.Trainer, pl_module: pl.LightningModule) -> list[torch.Tensor]:
        state = trainer.optimizers[0].state
        tensors = [p.detach().clone() for p in pl_module.parameters()]
        for p in pl_module.parameters():
            tensors += [v.detach().clone() for _, v in sorted(state.get(p, {}).items())]
        return tensors

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.before.append(self._copy(trainer, pl_module))

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.after.append(self._copy(trainer, pl_module))


@pytest.mark.parametrize("optimizer", ["adamw", "adamw_fused"])
@pytest.mark.parametrize("where", ["callback_before", "callback_after", "module"])
def test_a_vote_from_anywhere_before_the_update_skips_exactly(optimizer: str, where: str) -> None:
    """A plain callback before or after the package's callbacks, or the module's hook: the same exact skip."""
    snaps, state = Snapshots(), WeightsAndState()
    ours = GradientNormMonitor(max_norm=1.0)
    callbacks = {"callback_before": [Voter(), ours], "callback_after": [ours, Voter()], "module": [ours]}[where]
    module = VotingModule(optimizer=optimizer) if where == "module" else TinyModule(optimizer=optimizer)
    trainer = quiet_trainer(max_steps=5, callbacks=[*callbacks, snaps, state])
    trainer.fit(module)
    assert snaps.outcomes == [0, 0, int(Outcome.SKIPPED_SPIKE), 0, 0]
    # weights, AdamW's moments and its step counts exactly as they were; the next step updates again
    assert len(state.before[BAD]) > len(list(module.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(state.before[BAD], state.after[BAD], strict=True))
    assert not torch.equal(state.before[BAD + 1][0], state.after[BAD + 1][0])


@pytest.mark.parametrize("optimizer", ["adamw", "adamw_fused"])
def test_votes_from_before_after_and_the_module_cost_one_host_read_together(optimizer: str) -> None:
    """The monitor alone, then with a vote from a callback before it, one after it and the module's: the same
    host syncs per step (one read of all the votes for AdamW, none for the fused one)."""
    pl.seed_everything(0)
    alone = count_syncs_per_step(
        quiet_trainer(max_steps=4, log_every_n_steps=50, callbacks=[GradientNormMonitor()]),
        TinyModule(optimizer=optimizer),
    )
    pl.seed_everything(0)
    everywhere = count_syncs_per_step(
        quiet_trainer(max_steps=4, log_every_n_steps=50, callbacks=[Voter(), GradientNormMonitor(), Voter()]),
        VotingModule(optimizer=optimizer),
    )
    # (on the skipped step itself AdamW's own per-parameter syncs vanish: it leaves gradient-less params alone)
    assert [n for i, n in enumerate(alone) if i != BAD] == [n for i, n in enumerate(everywhere) if i != BAD]
    if optimizer == "adamw_fused":
        assert alone == everywhere


def test_votes_from_several_callbacks_cost_one_host_read_together() -> None:
    """Two voters and the monitor's non-finite vote on a non-fused optimizer: one read per step, not three."""
    pl.seed_everything(0)
    one = count_syncs_per_step(
        quiet_trainer(max_steps=4, log_every_n_steps=50, callbacks=[GradientNormMonitor()]), TinyModule()
    )
    pl.seed_everything(0)
    three = count_syncs_per_step(
        quiet_trainer(max_steps=4, log_every_n_steps=50, callbacks=[Voter(), Voter(), GradientNormMonitor()]),
        TinyModule(),
    )
    # (on the skipped step itself AdamW's own per-parameter syncs vanish: it leaves gradient-less params alone)
    assert [n for i, n in enumerate(one) if i != BAD] == [n for i, n in enumerate(three) if i != BAD]


@pytest.mark.parametrize("optimizer", ["adamw", "adamw_fused"])
def test_a_host_read_of_the_votes_is_explained_once_with_its_fix(
    optimizer: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO):
        quiet_trainer(max_steps=4, callbacks=[Voter(), GradientNormMonitor()]).fit(TinyModule(optimizer=optimizer))
    told = [r.getMessage() for r in caplog.records if "read on the host once per optimizer step" in r.getMessage()]
    if optimizer == "adamw":
        assert len(told) == 1 and "AdamW(..., fused=True)" in told[0]
    else:  # the fused optimizer takes the votes as `found_inf`: nothing is read, nothing to say
        assert told == []


def test_the_template_gives_one_instance_check_and_cadence() -> None:
    class Counter(LedgerCallback):
        """A new callback: ~10 lines of its own."""

        def __init__(self) -> None:
            super().__init__(log_every_n_steps=2)
            self.logging_steps: list[int] = []

        def on_step(self, trainer: pl.Trainer, ledger: StepLedger, optimizer: Any) -> None:
            self.record_metric("stability/counter", float(ledger.record_of().steps))
            if self.is_logging_step:
                self.logging_steps.append(ledger.record_of().steps)

    counter = Counter()
    trainer = quiet_trainer(max_steps=6, callbacks=[counter])
    trainer.fit(TinyModule())
    assert counter.logging_steps == [2, 4, 6]
    assert trainer.callback_metrics["stability/counter"].item() == 6.0
    with pytest.raises(StabilityConfigError, match=r"2 Counter callbacks are attached"):
        quiet_trainer(max_steps=1, callbacks=[Counter(), Counter()]).fit(TinyModule())


def test_a_missing_private_internal_fails_at_setup_naming_the_supported_range(monkeypatch: pytest.MonkeyPatch) -> None:
    """Another Lightning whose epoch loop lost `_batches_that_stepped`: one clear error at setup, no traceback
    from inside a training step."""
    from lightning.pytorch.loops import _TrainingEpochLoop

    from lightning_stability import _compat

    monkeypatch.delattr(_TrainingEpochLoop, "_accumulated_batches_reached")
    trainer = quiet_trainer(max_steps=2, callbacks=[GradientNormMonitor()])
    with pytest.raises(StabilityConfigError, match=r"lacks the training epoch loop.s `_accumulated_batches") as err:
        trainer.fit(TinyModule())
    assert _compat.SUPPORTED in str(err.value)


class LossProbe(LedgerCallback):
    """A callback that asks for the update's loss and reads it in its step, before the update."""

    def __init__(self) -> None:
        super().__init__()
        self.losses: list[torch.Tensor] = []

    needs_loss = True

    def on_step(self, trainer: pl.Trainer, ledger: StepLedger, optimizer: Any) -> None:
        self.losses.append(ledger.step.loss.clone())


class RecordsLosses(TinyModule):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.losses.append(float(loss.detach()))
        return loss


def test_the_update_loss_is_the_unscaled_mean_over_its_micro_batches() -> None:
    from lightning.pytorch.plugins import MixedPrecision

    from lightning_stability import GradientAccumulation, LossScaleTuner

    probe = LossProbe()
    model = RecordsLosses(n=64, batch_size=4)  # 16 micro-batches, 4 updates of 4
    trainer = quiet_trainer(
        max_epochs=1,
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**10))],
        callbacks=[GradientAccumulation(steps=4, lr_scaling="none"), LossScaleTuner(init_scale=2.0**10), probe],
    )
    trainer.fit(model)
    expected = [sum(model.losses[i : i + 4]) / 4 for i in range(0, 16, 4)]
    assert [t.item() for t in probe.losses] == pytest.approx(expected, rel=1e-5)


def test_the_update_loss_under_manual_optimization_belongs_to_the_optimizer_that_steps() -> None:
    class Manual(TinyModule):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch: Any, batch_idx: int) -> None:
            opt = self.optimizers()
            opt.zero_grad()
            x, y = batch
            halves = [torch.nn.functional.mse_loss(self(x[i::2]), y[i::2]) for i in (0, 1)]
            for loss in halves:  # accumulated by hand: two backward passes, one step
                self.manual_backward(loss)
            self.losses.append(sum(float(h.detach()) for h in halves) / 2)
            opt.step()

    probe = LossProbe()
    model = Manual()
    quiet_trainer(max_steps=4, callbacks=[probe]).fit(model)
    assert [t.item() for t in probe.losses] == pytest.approx(model.losses, rel=1e-6)


class ScaleRecorder(pl.Callback):
    """The loss scale after each batch (a host read: tests only)."""

    def __init__(self) -> None:
        self.scales: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.scales.append(trainer.precision_plugin.scaler.get_scale())  # type: ignore[attr-defined]


@pytest.mark.parametrize("optimizer", ["adamw", "adamw_fused"])
@pytest.mark.parametrize("tuned", [False, True], ids=["torch_scaler", "loss_scale_tuner"])
def test_an_fp16_skip_vote_skips_the_update_but_leaves_the_loss_scale_alone(optimizer: str, tuned: bool) -> None:
    """A spike skip is not an overflow: the scale must not back off, nor the overflow count grow."""
    from lightning.pytorch.plugins import MixedPrecision

    from lightning_stability import LossScaleTuner

    snaps, scales = Snapshots(), ScaleRecorder()
    tuner = [LossScaleTuner(init_scale=256.0, hysteresis=1, growth_interval=1000)] if tuned else []
    trainer = quiet_trainer(
        max_steps=5,
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=256.0))],
        callbacks=[Voter(), *tuner, snaps, scales],
    )
    trainer.fit(TinyModule(optimizer=optimizer))
    assert snaps.outcomes == [0, 0, int(Outcome.SKIPPED_SPIKE), 0, 0]  # a spike, not SKIPPED_SCALER
    assert all(torch.equal(a, b) for a, b in zip(snaps.before[BAD], snaps.after[BAD], strict=True))
    assert not torch.equal(snaps.before[BAD + 1][0], snaps.after[BAD + 1][0])
    assert scales.scales == [256.0] * 5
    if tuned:
        assert int(tuner[0].scaler.overflow_steps) == 0  # type: ignore[union-attr]


def test_an_fp16_overflow_still_backs_off_when_a_vote_also_skips() -> None:
    """The vote and a real overflow on the same step: the overflow wins the outcome and lowers the scale."""
    from lightning.pytorch.plugins import MixedPrecision

    snaps, scales = Snapshots(), ScaleRecorder()
    trainer = quiet_trainer(
        max_steps=4,
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=256.0))],
        callbacks=[Voter(), snaps, scales],
    )
    trainer.fit(TinyModule(inf_at_step=BAD))
    assert snaps.outcomes == [0, 0, int(Outcome.SKIPPED_SCALER), 0]
    assert scales.scales == [256.0, 256.0, 128.0, 128.0]


def test_mark_skip_outside_a_step_says_how_to_call_it() -> None:
    trainer = quiet_trainer(max_steps=1)
    with pytest.raises(RuntimeError, match=r"pass that hook's optimizer"):
        StepLedger.of(trainer).mark_skip(Outcome.SKIPPED_SPIKE, True)


def test_a_vote_from_a_users_callback_alone_is_enforced() -> None:
    """No lightning_stability callback in the Trainer: the ledger enforces the vote itself."""
    snaps = Snapshots()
    trainer = quiet_trainer(max_steps=5, callbacks=[Voter(), snaps])
    trainer.fit(TinyModule())
    assert all(torch.equal(a, b) for a, b in zip(snaps.before[BAD], snaps.after[BAD], strict=True))
    assert snaps.outcomes == [0, 0, int(Outcome.SKIPPED_SPIKE), 0, 0]


class _TwoOptimizers(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 1), torch.nn.Linear(4, 1)
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        for opt, layer in zip(self.optimizers(), (self.a, self.b), strict=True):  # type: ignore[arg-type]
            opt.zero_grad()
            self.manual_backward(layer(batch[0]).pow(2).mean())
            opt.step()

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [torch.optim.SGD(self.a.parameters(), 0.1), torch.optim.Adam(self.b.parameters(), 0.1)]


class _LogsAtTrainStart(LedgerCallback):
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.record_metric("stability/custom", 1.0)


def test_metric_names_follow_the_optimizers_of_the_fit_under_way() -> None:
    """A Trainer fitted with two optimizers, then with one: a metric logged between steps of the second fit has
    no optimizer suffix (the per-step cache of `several optimizers` did not outlive its step)."""
    from torch.utils.data import DataLoader, TensorDataset

    data = DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=4)
    trainer = quiet_trainer(max_epochs=1, callbacks=[GradientNormMonitor(), _LogsAtTrainStart()])
    trainer.fit(_TwoOptimizers(), data)
    assert "stability/grad_norm/SGD" in trainer.callback_metrics
    trainer.fit_loop.max_epochs = 2
    trainer.fit(TinyModule(), TinyModule().train_dataloader())
    assert "stability/custom" in trainer.callback_metrics
    assert not any(k.startswith("stability/custom/") for k in trainer.callback_metrics)


def test_a_pickled_track_keeps_its_counts_consistent() -> None:
    import pickle

    from lightning_stability.ledger.track import OptimizerRecord

    track = OptimizerRecord(0, "SGD")
    track.place(torch.device("cpu"))
    track.count(Outcome.APPLIED)
    track.count(torch.tensor(int(Outcome.SKIPPED_SPIKE)))
    copy = pickle.loads(pickle.dumps(track))
    copy.count(torch.tensor(int(Outcome.SKIPPED_SPIKE)))
    copy.count(Outcome.SKIPPED_NONFINITE)
    assert copy.counts.tolist() == [1, 0, 1, 2, 0, 0]
    assert int(copy.skipped_steps) == 3


@pytest.mark.parametrize("call", ["no_closure", "closure_keyword", "closure_positional"])
def test_a_vote_cast_inside_the_optimizers_closure_is_enforced_when_the_closure_returns(call: str) -> None:
    """Lightning (outside fp16) runs backward and every `on_before_optimizer_step` hook inside the closure it passes
    to `optimizer.step`, after torch ran the step pre-hooks: the pre-hook enforces once that closure returned."""
    layer = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    ledger = StepLedger()
    ledger._watch([optimizer])  # what the template does before the first step
    x = torch.randn(8, 4)

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = layer(x).pow(2).mean()
        loss.backward()
        ledger.open_step(optimizer)  # as the first LedgerCallback's on_before_optimizer_step does
        ledger.mark_skip(Outcome.SKIPPED_SPIKE, torch.ones((), dtype=torch.bool))
        return loss

    before = [p.detach().clone() for p in layer.parameters()]
    if call == "no_closure":
        closure()
        optimizer.step()
    elif call == "closure_keyword":
        optimizer.step(closure=closure)
    else:
        optimizer.step(closure)
    assert all(torch.equal(a, b) for a, b in zip(before, layer.parameters(), strict=True))
    assert ledger.outcome is Outcome.SKIPPED_SPIKE
    assert ledger.record_of(optimizer).counts.tolist() == [0, 0, 0, 1, 0, 0]


@pytest.mark.parametrize("device_flags", [False, True], ids=["host", "device"])
def test_a_later_vote_for_the_same_reason_does_not_undo_an_earlier_one(device_flags: bool) -> None:
    """Two callbacks vote for one reason, the first to skip, the second not: the votes combine (any says skip),
    the later never overwrites the earlier. Weights and state are left as they were."""
    from lightning.pytorch.demos.boring_classes import BoringModel

    class Vote(pl.Callback):
        def __init__(self, flag: bool) -> None:
            self.flag = flag

        def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, optimizer: Any) -> None:
            flag = torch.tensor(self.flag) if device_flags else self.flag
            StepLedger.of(trainer).mark_skip(Outcome.SKIPPED_SPIKE, flag, optimizer)

    class AdamModel(BoringModel):
        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=0.1)

    torch.manual_seed(0)
    model = AdamModel()
    before = [p.detach().clone() for p in model.parameters()]
    trainer = quiet_trainer(max_steps=2, callbacks=[Vote(True), Vote(False)])
    trainer.fit(model)
    assert int(StepLedger.of(trainer).outcome) == Outcome.SKIPPED_SPIKE
    for p, b in zip(model.parameters(), before, strict=True):
        assert torch.equal(p.detach(), b)
    assert not trainer.optimizers[0].state  # AdamW never stepped
