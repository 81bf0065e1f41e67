"""The stability report of a fit that crashed, and the report sent to TensorBoard, W&B and MLflow."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from lightning_stability import TrainingHealthMonitor
from lightning_stability.health.report import load_report
from tests.helpers import TinyModule, quiet_trainer


class CrashesAt(TinyModule):
    """Raises in ``training_step`` at one global step, as a bug or a lost device would."""

    def __init__(self, step: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.crash_step = step

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.global_step == self.crash_step:
            raise RuntimeError(f"boom at step {self.global_step}")
        return super().training_step(batch, batch_idx)


def test_a_fit_that_ends_in_an_exception_leaves_its_report(tmp_path: Path) -> None:
    health = TrainingHealthMonitor(response="skip")
    trainer = quiet_trainer(max_steps=20, log_every_n_steps=4, default_root_dir=tmp_path, callbacks=[health])
    with pytest.raises(RuntimeError, match="boom at step 6"):
        trainer.fit(CrashesAt(6, n=256))
    report = load_report(tmp_path / "stability_report.json")
    assert report["meta"]["ended"] == "RuntimeError: boom at step 6"
    # the six steps taken, those after the last logging step (4) included
    assert report["history"]["step"] == [0, 1, 2, 3, 4, 5]
    assert len(report["history"]["loss"]) == 6 and all(v is not None for v in report["history"]["loss"])
    assert report["summary"]["steps"] == 6
    if (tmp_path / "stability_report.png").exists():
        assert (tmp_path / "stability_report.png").stat().st_size > 1000


def test_a_normal_end_says_so(tmp_path: Path) -> None:
    trainer = quiet_trainer(max_steps=3, default_root_dir=tmp_path, callbacks=[TrainingHealthMonitor()])
    trainer.fit(TinyModule())
    assert load_report(tmp_path / "stability_report.json")["meta"]["ended"] == "normally"


def test_no_report_when_fit_fails_before_training(tmp_path: Path) -> None:
    class BadSetup(TinyModule):
        def configure_optimizers(self) -> Any:
            raise ValueError("no optimizer")

    trainer = quiet_trainer(max_steps=3, default_root_dir=tmp_path, callbacks=[TrainingHealthMonitor()])
    with pytest.raises(ValueError, match="no optimizer"):
        trainer.fit(BadSetup())
    assert not (tmp_path / "stability_report.json").exists()  # nothing was recorded


def fit_with(logger: Any, tmp_path: Path, steps: int = 4, **health: Any) -> pl.Trainer:
    trainer = quiet_trainer(
        max_steps=steps,
        log_every_n_steps=2,
        logger=logger,
        default_root_dir=tmp_path,
        callbacks=[TrainingHealthMonitor(**health)],
    )
    trainer.fit(TinyModule())
    return trainer


def test_tensorboard_gets_the_report_as_an_image_and_its_summary_as_text(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    pytest.importorskip("matplotlib")
    from lightning.pytorch.loggers import TensorBoardLogger
    from matplotlib.image import imread
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = TensorBoardLogger(tmp_path, name="tb")
    fit_with(logger, tmp_path)
    png = Path(logger.log_dir) / "stability_report.png"
    height, width = imread(png).shape[:2]
    events = EventAccumulator(logger.log_dir, size_guidance={"images": 0, "tensors": 0})
    events.Reload()
    assert "stability/report" in events.Tags()["images"]
    (image,) = events.Images("stability/report")
    assert (image.step, image.width, image.height) == (4, width, height)
    (text,) = events.Tensors("stability/report/text_summary")
    assert b'"steps": 4' in text.tensor_proto.string_val[0]


def test_wandb_offline_gets_the_image_and_the_json(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("wandb")
    pytest.importorskip("matplotlib")
    from lightning.pytorch.loggers import WandbLogger

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = WandbLogger(save_dir=str(tmp_path), offline=True, project="stability")
    fit_with(logger, tmp_path)
    run_dir = Path(logger.experiment.dir)
    logger.experiment.finish()
    saved = run_dir / "stability_report.json"
    assert saved.is_file() and load_report(saved)["summary"]["steps"] == 4
    images = list(run_dir.glob("media/images/stability/report_*.png"))
    assert len(images) == 1 and images[0].stat().st_size > 1000


def test_mlflow_gets_both_files_as_artifacts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3: a file store, offline
    pytest.importorskip("matplotlib")
    from lightning.pytorch.loggers import MLFlowLogger

    logger = MLFlowLogger(experiment_name="stability", tracking_uri=f"file:{tmp_path / 'mlruns'}")
    fit_with(logger, tmp_path)  # the per-module update ratios too: no key lies below another
    listed = {a.path for a in logger.experiment.list_artifacts(logger.run_id, "stability_report")}
    assert listed == {"stability_report/stability_report.json", "stability_report/stability_report.png"}
    local = logger.experiment.download_artifacts(logger.run_id, "stability_report/stability_report.json", str(tmp_path))
    assert load_report(local)["summary"]["steps"] == 4
