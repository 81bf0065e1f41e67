"""LightningCLI: every callback and the strategy from YAML by class path, and a preset from the command line."""

from __future__ import annotations

from pathlib import Path

import pytest
from lightning.pytorch.cli import LightningCLI

from lightning_stability import (
    GradientAccumulation,
    GradientNormMonitor,
    LossScaleTuner,
    LRBackoff,
    PrecursorMonitor,
    StableFSDPStrategy,
    StableTrainer,
    StepReplay,
    TrainingHealthMonitor,
    WarmupConstantCosineLR,
)
from tests.helpers import TinyModule

QUIET = ["--trainer.accelerator=cpu", "--trainer.logger=false", "--trainer.enable_progress_bar=false"]


@pytest.fixture(autouse=True)
def _in_tmp_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Trainers here save into ``default_root_dir``, the working directory: keep it out of the repository."""
    monkeypatch.chdir(tmp_path)


CONFIG = """
trainer:
  max_steps: 4
  callbacks:
    - class_path: lightning_stability.GradientNormMonitor
      init_args: {max_norm: 0.5, per_layer: 3}
    - class_path: lightning_stability.WarmupConstantCosineLR
      init_args: {warmup: 0.25, decay: 0.5}
    - class_path: lightning_stability.GradientAccumulation
      init_args: {steps: 2}
    - class_path: lightning_stability.LossScaleTuner
      init_args: {init_scale: 1024.0}
    - class_path: lightning_stability.TrainingHealthMonitor
      init_args: {response: skip, report: false}
    - class_path: lightning_stability.StepReplay
      init_args: {max_faults: 2, quarantine_file: null}
"""


def test_every_callback_from_yaml(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(CONFIG)
    cli = LightningCLI(TinyModule, run=False, save_config_callback=None, args=[f"--config={config}", *QUIET])
    kinds = {type(cb): cb for cb in cli.trainer.callbacks}
    assert kinds[GradientNormMonitor].max_norm == 0.5  # type: ignore[attr-defined]
    assert kinds[WarmupConstantCosineLR].schedule.warmup == 0.25  # type: ignore[attr-defined]
    assert kinds[GradientAccumulation].steps == 2  # type: ignore[attr-defined]
    assert kinds[TrainingHealthMonitor].response == "skip"  # type: ignore[attr-defined]
    assert LossScaleTuner in kinds
    assert kinds[StepReplay].max_faults == 2 and kinds[StepReplay].quarantine_file is None  # type: ignore[attr-defined]
    cli.trainer.fit(cli.model)
    assert cli.trainer.global_step == 4


def test_the_precursor_monitor_and_its_backoff_from_yaml(tmp_path: Path) -> None:
    from tests.precursors.tiny_lm import TinyLM

    config = tmp_path / "config.yaml"
    config.write_text(
        """
trainer:
  max_steps: 4
  callbacks:
    - class_path: lightning_stability.PrecursorMonitor
      init_args: {qk_clip: 100.0, lr_backoff: {signal: update_ratio, threshold: 0.05, factor: 0.7}}
"""
    )
    cli = LightningCLI(TinyLM, run=False, save_config_callback=None, args=[f"--config={config}", *QUIET])
    (monitor,) = [cb for cb in cli.trainer.callbacks if isinstance(cb, PrecursorMonitor)]  # type: ignore[attr-defined]
    assert monitor.lr_backoff == LRBackoff("update_ratio", threshold=0.05, factor=0.7)
    assert monitor.qk_clip == 100.0
    cli.trainer.fit(cli.model)
    assert cli.trainer.global_step == 4


@pytest.mark.parametrize(
    "strategy",
    ['{"class_path": "lightning_stability.StableFSDPStrategy", "init_args": {"reduce_dtype": null}}', "stable_fsdp"],
)
def test_the_strategy_by_class_path_or_registered_name(strategy: str) -> None:
    """The registered name works once the package is imported (here, by this test); the class path always."""
    args = [f"--trainer.strategy={strategy}", "--trainer.devices=1", *QUIET]
    cli = LightningCLI(TinyModule, run=False, save_config_callback=None, args=args)
    assert isinstance(cli.trainer.strategy, StableFSDPStrategy)


def test_a_preset_from_the_command_line() -> None:
    overrides = "--trainer.preset_overrides={max_norm: 0.3, health: warn, replay: true}"
    args = ["--trainer.preset=gpt", overrides, "--trainer.max_steps=3"]
    cli = LightningCLI(
        TinyModule, trainer_class=StableTrainer, run=False, save_config_callback=None, args=[*args, *QUIET]
    )
    trainer = cli.trainer
    assert isinstance(trainer, StableTrainer) and trainer.preset is not None and trainer.preset.name == "gpt"
    norm = next(cb for cb in trainer.callbacks if isinstance(cb, GradientNormMonitor))
    health = next(cb for cb in trainer.callbacks if isinstance(cb, TrainingHealthMonitor))
    assert norm.max_norm == 0.3 and health.response == "warn"
    assert any(isinstance(cb, StepReplay) for cb in trainer.callbacks)
    health.report = False
    trainer.fit(cli.model)
    assert trainer.global_step == 3


def test_a_presets_parts_turned_off_from_the_command_line() -> None:
    overrides = (
        "{lr_schedule: false, health: null, lr_backoff: null, max_norm: null, checkpoint: false, watchdog: false}"
    )
    args = ["--trainer.preset=gpt", f"--trainer.preset_overrides={overrides}", "--trainer.max_steps=2"]
    cli = LightningCLI(
        TinyModule, trainer_class=StableTrainer, run=False, save_config_callback=None, args=[*args, *QUIET]
    )
    kinds = {type(cb) for cb in cli.trainer.callbacks}
    assert WarmupConstantCosineLR not in kinds and TrainingHealthMonitor not in kinds
    assert PrecursorMonitor not in kinds
    norm = next(cb for cb in cli.trainer.callbacks if isinstance(cb, GradientNormMonitor))
    assert norm.max_norm is None
    preset = cli.trainer.preset  # type: ignore[attr-defined]
    assert (preset.lr_schedule, preset.health, preset.lr_backoff) == (False, None, None)
    assert (preset.checkpoint, preset.watchdog) == (False, False)
    cli.trainer.fit(cli.model)
    assert cli.trainer.global_step == 2
