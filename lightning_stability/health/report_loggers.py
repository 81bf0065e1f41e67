"""The stability report sent to the Trainer's loggers that take images or files, beside the files on disk.

=====================  ==============================================================================
Logger                 What it gets
=====================  ==============================================================================
``TensorBoardLogger``  the PNG as the image ``stability/report`` (``add_image``) and the JSON's summary as
                       the text ``stability/report`` (``add_text``), at the run's last step
``WandbLogger``        the PNG as the image ``stability/report`` (``log_image``) and the JSON as a run file
                       (``wandb.save``)
``MLFlowLogger``       both files as artifacts of the run under ``stability_report/`` (``log_artifact``)
=====================  ==============================================================================

Other loggers (``CSVLogger``, ...) get nothing: the files are in their ``log_dir`` already when no
``report_dir`` was given. A logger that fails to take the report gets a warning; training is not affected.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

log = logging.getLogger("lightning_stability")

TAG = "stability/report"
ARTIFACT_DIR = "stability_report"


def send_report(loggers: Iterable[Any], json_path: Path, png_path: Path | None, step: int) -> list[str]:
    """Send the report's files to each logger that takes them; returns the names of the loggers that got them."""
    from lightning.pytorch.loggers import MLFlowLogger, TensorBoardLogger, WandbLogger

    senders = ((TensorBoardLogger, _tensorboard), (WandbLogger, _wandb), (MLFlowLogger, _mlflow))
    sent = []
    for logger in loggers:
        send = next((fn for kind, fn in senders if isinstance(logger, kind)), None)
        if send is None:
            continue
        try:
            send(logger, json_path, png_path, step)
        except Exception as err:  # a logger's failure must not hide the run's own outcome
            log.warning("stability report: %s did not take it (%s: %s)", type(logger).__name__, type(err).__name__, err)
            continue
        sent.append(type(logger).__name__)
    return sent


def _summary_text(json_path: Path) -> str:
    report = json.loads(json_path.read_text())
    body = json.dumps({"meta": report.get("meta", {}), "summary": report.get("summary", {})}, indent=1)
    return "    " + body.replace("\n", "\n    ")  # markdown code block: TensorBoard renders text as markdown


def _tensorboard(logger: Any, json_path: Path, png_path: Path | None, step: int) -> None:
    writer = logger.experiment
    if png_path is not None:
        from matplotlib.image import imread

        image = imread(png_path)[..., :3]  # RGBA floats in [0, 1] -> RGB
        writer.add_image(TAG, image, global_step=step, dataformats="HWC")
    writer.add_text(TAG, _summary_text(json_path), global_step=step)
    writer.flush()


def _wandb(logger: Any, json_path: Path, png_path: Path | None, step: int) -> None:
    if png_path is not None:
        logger.log_image(key=TAG, images=[str(png_path)])
    logger.experiment.save(str(json_path), base_path=str(json_path.parent), policy="now")


def _mlflow(logger: Any, json_path: Path, png_path: Path | None, step: int) -> None:
    for path in (json_path, png_path):
        if path is not None:
            logger.experiment.log_artifact(logger.run_id, str(path), ARTIFACT_DIR)
