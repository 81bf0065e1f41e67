"""The progress bar shows the stability metrics beside the loss, and StableTrainer attaches it."""

from __future__ import annotations

from pathlib import Path

import pytest
from lightning.pytorch.callbacks import TQDMProgressBar

from lightning_stability import GradientNormMonitor, StabilityProgressBar, StableTrainer, StepLedger
from lightning_stability.progress import stability_progress_bar
from tests.helpers import TinyModule, count_syncs_per_step, quiet_trainer
from tests.ledger.test_several_optimizers import TwoOptimizerGAN

QUIET = dict(accelerator="cpu", logger=False, enable_model_summary=False, enable_checkpointing=False)


def test_stable_trainer_shows_the_metrics_of_the_last_logging_step(tmp_path: Path) -> None:
    trainer = StableTrainer.from_preset("tiny", max_steps=7, log_every_n_steps=3, default_root_dir=tmp_path, **QUIET)
    bar = trainer.progress_bar_callback
    assert type(bar) is type(stability_progress_bar())  # Rich when installed, as Lightning picks
    model = TinyModule()
    trainer.fit(model)
    items = bar.get_metrics(trainer, model)
    published = StepLedger.of(trainer).published
    assert items["grad_norm"] == f"{published['stability/grad_norm']:.3g}"
    assert items["lr"] == f"{published['stability/lr']:.3g}" and float(items["lr"]) > 0  # not rounded to 0.000
    assert items["skipped"] == "0"
    assert "loss_scale" not in items  # fp32: no loss scaler, nothing to show


@pytest.mark.parametrize("given", ["off", "users"])
def test_no_bar_when_it_is_off_and_the_users_own_when_given(given: str) -> None:
    if given == "off":
        trainer = StableTrainer.from_preset("tiny", max_steps=1, enable_progress_bar=False, **QUIET)
        assert trainer.progress_bar_callback is None
    else:
        mine = TQDMProgressBar()
        trainer = StableTrainer.from_preset("tiny", max_steps=1, callbacks=[mine], **QUIET)
        assert trainer.progress_bar_callback is mine


def test_several_optimizers_each_have_their_label() -> None:
    trainer = quiet_trainer(
        max_steps=8,
        log_every_n_steps=2,
        enable_progress_bar=True,
        callbacks=[GradientNormMonitor(), bar := StabilityProgressBar()],
    )
    model = TwoOptimizerGAN()
    trainer.fit(model)
    items = bar.get_metrics(trainer, model)
    assert {"grad_norm/SGD", "grad_norm/Adam", "skipped/SGD", "skipped/Adam"} <= set(items)
    assert "grad_norm" not in items


def test_the_bar_adds_no_host_sync() -> None:
    def syncs(bar: bool) -> list[int]:
        callbacks = [GradientNormMonitor(max_norm=1.0)] + ([StabilityProgressBar()] if bar else [])
        trainer = quiet_trainer(max_steps=6, log_every_n_steps=3, enable_progress_bar=bar, callbacks=callbacks)
        return count_syncs_per_step(trainer, TinyModule())

    assert syncs(True) == syncs(False)
