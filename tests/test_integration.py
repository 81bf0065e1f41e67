"""All the callbacks in one fp16 Trainer: they agree on what a step was, and a resumed run is exact."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.plugins import MixedPrecision

from lightning_stability import (
    GradientAccumulation,
    GradientNormMonitor,
    LossScaleTuner,
    Outcome,
    StepLedger,
    WarmupConstantCosineLR,
)
from tests.helpers import TinyModule, quiet_trainer

OVERFLOW_STEPS = [2, 7]  # the loss is multiplied by inf at these optimizer steps


class Trace(pl.Callback):
    """Per optimizer step: the LR the update used, the loss scale after it, and the step's outcome."""

    def __init__(self) -> None:
        self.lrs: list[float] = []
        self.scales: list[float] = []
        self.outcomes: list[int] = []

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self.lrs.append(float(optimizer.param_groups[0]["lr"]))

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        ledger = StepLedger.of(trainer)
        if ledger.is_open:
            ledger.close_step()
        if len(self.outcomes) < len(self.lrs):  # a micro-batch that ended an optimizer step
            self.outcomes.append(int(ledger.outcome))
            self.scales.append(trainer.precision_plugin.scaler.get_scale())


class Interrupt(pl.Callback):
    """Stops the run at the end of the first epoch, as a pre-empted job would be stopped."""

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        trainer.should_stop = True


def _trainer(trace: Trace, *extra: pl.Callback) -> pl.Trainer:
    return quiet_trainer(
        max_epochs=2,
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))],
        callbacks=[
            GradientNormMonitor(max_norm=1.0),
            WarmupConstantCosineLR(warmup=0.3, decay=0.5),
            GradientAccumulation(steps={0: 1, 4: 2}, lr_scaling="none"),
            LossScaleTuner(init_scale=2.0**8, hysteresis=2, growth_interval=3),
            trace,
            *extra,
        ],
    )


def _module() -> TinyModule:
    return TinyModule(n=64, batch_size=8, inf_at_step=OVERFLOW_STEPS)  # 8 micro-batches per epoch


def test_all_callbacks_agree_and_resume_is_exact(tmp_path: Path) -> None:
    pl.seed_everything(0)
    straight_trace = Trace()
    straight = _trainer(straight_trace)
    straight.fit(_module())

    # Epoch 1 (8 micro-batches): one micro-batch per update until 4 updates were APPLIED (5 attempts, one
    # skipped), then two: 1 full window and the epoch's short last one; epoch 2: 4 windows of 2. 11 in all.
    assert len(straight_trace.lrs) == 11
    skipped = [i for i, o in enumerate(straight_trace.outcomes) if o != Outcome.APPLIED]
    assert skipped == OVERFLOW_STEPS
    assert all(straight_trace.outcomes[i] == Outcome.SKIPPED_SCALER for i in skipped)
    # the LR holds still across a skipped update: the schedule counts applied updates only
    for i in skipped:
        assert straight_trace.lrs[i + 1] == straight_trace.lrs[i]
    ledger = StepLedger.of(straight)
    assert ledger.record_of().counts.tolist() == [9, 2, 0, 0, 0, 0]
    # hysteresis=2: neither lone overflow halved the scale; it grew after every 3 clean steps
    assert straight_trace.scales[-1] > straight_trace.scales[0]

    pl.seed_everything(0)
    first_trace = Trace()
    first = _trainer(first_trace, Interrupt())
    first.fit(_module())
    first.save_checkpoint(tmp_path / "epoch1.ckpt")
    resumed_trace = Trace()
    resumed = _trainer(resumed_trace)
    resumed.fit(_module(), ckpt_path=tmp_path / "epoch1.ckpt")

    assert first_trace.lrs + resumed_trace.lrs == straight_trace.lrs
    assert first_trace.scales + resumed_trace.scales == straight_trace.scales
    assert first_trace.outcomes + resumed_trace.outcomes == straight_trace.outcomes
    assert StepLedger.of(resumed).record_of().counts.tolist() == ledger.record_of().counts.tolist()
    for p, q in zip(resumed.lightning_module.parameters(), straight.lightning_module.parameters(), strict=True):
        assert torch.equal(p, q)


@pytest.mark.parametrize("precision", ["bf16-mixed", "32-true"])
def test_the_same_stack_runs_without_fp16(precision: str) -> None:
    trainer = quiet_trainer(
        max_steps=4,
        precision=precision,
        callbacks=[
            GradientNormMonitor(max_norm=1.0),
            WarmupConstantCosineLR(),
            GradientAccumulation(steps=2),
            LossScaleTuner(),
        ],
    )
    trainer.fit(TinyModule())
    assert StepLedger.of(trainer).record_of().counts.tolist() == [4, 0, 0, 0, 0, 0]
