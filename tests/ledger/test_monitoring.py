"""`stability/` metrics are monitorable with the Trainer's defaults (log_every_n_steps=50, max_epochs)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from lightning.pytorch.plugins import MixedPrecision
from torch.utils.data import DataLoader

from lightning_stability import (
    GradientAccumulation,
    GradientNormMonitor,
    LossScaleTuner,
    WarmupConstantCosineLR,
)
from tests.helpers import TinyModule, make_data, quiet_trainer


class WithValidation(TinyModule):
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self(x), y))

    def val_dataloader(self) -> DataLoader:
        return DataLoader(make_data(16, self.dim, seed=1), batch_size=8)


@pytest.mark.parametrize("validation", [False, True])
def test_model_checkpoint_monitors_grad_norm_with_default_logging(tmp_path: Path, validation: bool) -> None:
    # 16 batches per epoch, log_every_n_steps left at 50: no step of the run is a logging step
    checkpoint = ModelCheckpoint(dirpath=tmp_path, monitor="stability/grad_norm", mode="min", save_top_k=1)
    trainer = quiet_trainer(
        max_epochs=2, enable_checkpointing=True, callbacks=[GradientNormMonitor(max_norm=1.0), checkpoint]
    )
    model = WithValidation(n=128) if validation else TinyModule(n=128)
    trainer.fit(model)
    assert trainer.log_every_n_steps == 50 and trainer.global_step == 32
    assert checkpoint.best_model_path and Path(checkpoint.best_model_path).exists()
    assert checkpoint.best_model_score is not None and torch.isfinite(checkpoint.best_model_score)
    saved = torch.load(checkpoint.best_model_path, weights_only=False)
    assert "lightning_stability" in saved


def test_model_checkpoint_on_the_lr_and_early_stopping_on_the_grad_norm_with_default_logging(tmp_path: Path) -> None:
    checkpoint = ModelCheckpoint(dirpath=tmp_path, monitor="stability/lr", mode="min", save_top_k=1)
    stopper = EarlyStopping(monitor="stability/grad_norm", mode="min", patience=1000, check_finite=True)
    trainer = quiet_trainer(
        max_epochs=2,
        enable_checkpointing=True,
        callbacks=[GradientNormMonitor(), WarmupConstantCosineLR(), checkpoint, stopper],
    )
    trainer.fit(TinyModule(n=128))
    assert checkpoint.best_model_path and checkpoint.best_model_score is not None
    # the best (lowest) LR is the last update's: the end of the cosine decay
    assert checkpoint.best_model_score.item() == pytest.approx(trainer.callback_metrics["stability/lr"].item())
    assert torch.isfinite(stopper.best_score) and stopper.best_score.item() > 0


def test_early_stopping_monitors_the_scheduled_lr_with_default_logging() -> None:
    # The LR falls below 80% of its base early in the cosine decay: EarlyStopping must see it without logging.
    stopper = EarlyStopping(monitor="stability/lr", mode="min", stopping_threshold=0.04, patience=100)
    trainer = quiet_trainer(
        max_epochs=8,
        callbacks=[WarmupConstantCosineLR(warmup=0.1, decay=0.5), stopper],
    )
    trainer.fit(TinyModule(n=64, lr=0.05))  # 8 steps per epoch, 64 in all; decay over the last 32
    assert 0 < trainer.current_epoch < 7  # stopped early, by the LR
    assert trainer.callback_metrics["stability/lr"].item() < 0.04


def test_every_scalar_stability_metric_is_in_callback_metrics_after_each_step() -> None:
    seen: list[set[str]] = []

    class Spy(pl.Callback):  # placed last, as Lightning places ModelCheckpoint: what a monitor would see
        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            seen.append({k for k in trainer.callback_metrics if k.startswith("stability/")})

    trainer = quiet_trainer(
        max_epochs=1,
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))],
        callbacks=[
            GradientNormMonitor(max_norm=1.0),
            WarmupConstantCosineLR(),
            GradientAccumulation(steps=2, lr_scaling="sqrt"),
            LossScaleTuner(),
            Spy(),
        ],
    )
    trainer.fit(TinyModule(n=64))  # 8 batches, 4 optimizer steps, no logging step
    per_step = {
        "stability/grad_norm",
        "stability/grad_norm_clipped",
        "stability/clip_coef",
        "stability/skipped_steps",
        "stability/lr",
        "stability/accumulation_steps",
        "stability/lr_scale",
        "stability/loss_scale",
        "stability/overflow_steps",
        "stability/loss_scale_floor_hits",
    }
    stepping = seen[1::2]  # the second micro-batch of each window steps
    assert len(stepping) == 4
    for keys in stepping:
        assert per_step <= keys, per_step - keys
    metrics = trainer.callback_metrics
    assert metrics["stability/accumulation_steps"].item() == 2.0
    assert metrics["stability/lr_scale"].item() == pytest.approx(2**0.5)
