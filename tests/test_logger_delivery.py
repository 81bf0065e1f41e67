"""Every ``stability/`` key, read back from each logger's own store: MLflow (a file store and a sqlite store),
TensorBoard (the event file), W&B (the offline run file) and CSV.

Run by CI after the logger packages are installed (``.ci/run``); each case skips when its package is missing.
Two fits each: the "gpt" preset with every per-part figure on, and two optimizers with per-module norms and
per-group LRs (``tests/metric_runs.py``). In every store: the keys are the ones the ledger published, their last
values match, no key lies below another, and one logging step is one row (``epoch`` and the module's ``self.log``
metrics on it).
"""

from __future__ import annotations

import csv
import glob
import json
import math
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest

from lightning_stability.health.report_loggers import TAG as REPORT_TAG
from lightning_stability.ledger import StepLedger
from tests.metric_runs import (
    GPT_PART_PREFIXES,
    TWO_OPTIMIZER_PART_PREFIXES,
    fit_gpt_preset,
    fit_two_optimizers,
    keys_below_others,
)

#: a fit, its part prefixes, its logging steps (Lightning's labels) and a metric of the module's own
FITS: dict[str, tuple[Callable[..., pl.Trainer], tuple[str, ...], list[int], str]] = {
    "gpt-preset": (fit_gpt_preset, GPT_PART_PREFIXES, [1, 3], "train_loss"),
    "two-optimizers": (fit_two_optimizers, TWO_OPTIMIZER_PART_PREFIXES, [1, 3], "d_loss"),
}
STEPS = {"gpt-preset": 4, "two-optimizers": 8}  # two optimizers: each batch is two optimizer steps

Series = dict[str, dict[int, float]]  # key -> {step: value}
Rows = list[dict[str, Any]]  # one dict per row a row-based store wrote


# ---- the loggers, and how to read each one's store back


def _csv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Callable[[], tuple[Series, Rows]]]:
    from lightning.pytorch.loggers import CSVLogger

    logger = CSVLogger(tmp_path, name="", version="")

    def read() -> tuple[Series, Rows]:
        with open(Path(logger.log_dir) / "metrics.csv", newline="") as f:
            rows: Rows = [{k: v for k, v in r.items() if v != ""} for r in csv.DictReader(f)]
        series: Series = {}
        for row in rows:
            for key, value in row.items():
                series.setdefault(key, {})[int(row["step"])] = float(value)
        return series, rows

    return logger, read


def _tensorboard(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Callable[[], tuple[Series, Rows]]]:
    pytest.importorskip("tensorboard")
    from lightning.pytorch.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = TensorBoardLogger(tmp_path, name="tb")

    def read() -> tuple[Series, Rows]:
        events = EventAccumulator(logger.log_dir, size_guidance={"scalars": 0})
        events.Reload()
        return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}, []

    return logger, read


def _mlflow(uri: Callable[[Path], str]) -> Callable[..., tuple[Any, Callable[[], tuple[Series, Rows]]]]:
    def make(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Callable[[], tuple[Series, Rows]]]:
        pytest.importorskip("mlflow")
        monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3: a file store, offline
        from lightning.pytorch.loggers import MLFlowLogger

        # the artifacts (the stability report) in tmp_path too: a database store puts them under ./mlruns
        artifacts = (tmp_path / "artifacts").as_uri()
        logger = MLFlowLogger(experiment_name="stability", tracking_uri=uri(tmp_path), artifact_location=artifacts)

        def read() -> tuple[Series, Rows]:
            client, run = logger.experiment, logger.run_id
            keys = client.get_run(run).data.metrics
            return {k: {m.step: m.value for m in client.get_metric_history(run, k)} for k in keys}, []

        return logger, read

    return make


def _sqlite_uri(tmp_path: Path) -> str:
    # MLflow's database stores need SQLAlchemy and Alembic, which mlflow-skinny leaves out (full mlflow has them)
    pytest.importorskip("sqlalchemy")
    pytest.importorskip("alembic")
    return f"sqlite:///{tmp_path / 'mlflow.db'}"


def _wandb(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Callable[[], tuple[Series, Rows]]]:
    pytest.importorskip("wandb")
    from lightning.pytorch.loggers import WandbLogger

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = WandbLogger(save_dir=str(tmp_path), offline=True, project="stability")

    def read() -> tuple[Series, Rows]:
        run_dir = Path(logger.experiment.dir).parent
        logger.experiment.finish()
        (path,) = glob.glob(str(run_dir / "run-*.wandb"))
        rows = []
        for row in wandb_history(Path(path)):
            # the stability report's image (W&B stores its fields, count, width, height, below its tag): no metric
            row = {k: v for k, v in row.items() if k != REPORT_TAG and not k.startswith(REPORT_TAG + "/")}
            if "trainer/global_step" in row and set(row) - _WANDB_BOOKKEEPING:
                rows.append(row)
        series: Series = {}
        for row in rows:
            for key, value in row.items():
                if isinstance(value, (int, float)):
                    series.setdefault(key, {})[int(row["trainer/global_step"])] = float(value)
        return series, rows

    return logger, read


_WANDB_BOOKKEEPING = {"trainer/global_step", "_step", "_timestamp", "_runtime"}


def wandb_history(path: Path) -> Rows:
    """The history rows (``run.log`` calls) of an offline W&B run file: a 7-byte header, then LevelDB-log records
    in 32 KiB blocks (each chunk: CRC32 4 bytes, length 2, type 1: full, first, middle, last), each a ``Record``."""
    from wandb.proto import wandb_internal_pb2

    raw, pos, block, pending, rows = path.read_bytes(), 7, 32768, b"", []
    while pos + 7 <= len(raw):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", raw[pos : pos + 7])
        pending += raw[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item})
    return rows


LOGGERS: dict[str, Callable[..., tuple[Any, Callable[[], tuple[Series, Rows]]]]] = {
    "csv": _csv,
    "tensorboard": _tensorboard,
    "mlflow-file": _mlflow(lambda tmp_path: f"file:{tmp_path / 'mlruns'}"),
    "mlflow-sqlite": _mlflow(_sqlite_uri),
    "wandb-offline": _wandb,
}


def test_the_wandb_reader_finds_rows_it_was_given(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = wandb.init(project="reader", dir=str(tmp_path), mode="offline")
    for step in range(3):
        run.log({"a": float(step), "b/c": "x" * 20_000})  # records longer than a block span blocks
    run.finish()
    (path,) = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert [r["a"] for r in wandb_history(Path(path))] == [0, 1, 2]


@pytest.mark.parametrize("fit", list(FITS))
@pytest.mark.parametrize("store", list(LOGGERS))
def test_every_key_reaches_the_store_once_per_logging_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, store: str, fit: str
) -> None:
    run, parts, steps, own = FITS[fit]
    logger, read = LOGGERS[store](tmp_path, monkeypatch)
    trainer = run(logger, tmp_path, steps=STEPS[fit], every=2)  # MLflow's file store crashed here before
    series, rows = read()
    published = StepLedger.of(trainer).published
    stored = {k for k in series if k.startswith("stability/")}
    assert stored == set(published), (sorted(stored ^ set(published)), store)
    for prefix in parts:
        assert any(k.startswith(prefix) for k in stored), (prefix, sorted(stored))
    assert not keys_below_others(stored)
    for key, value in published.items():  # the last value, as the ledger logged it (TensorBoard keeps float32)
        last = series[key][max(series[key])]
        assert math.isclose(last, value, rel_tol=1e-6, abs_tol=1e-12) or last == pytest.approx(value, rel=1e-6), key
    assert sorted(series["stability/grad_norm" + ("/SGD" if fit == "two-optimizers" else "")]) == steps
    assert sorted(series[own]) == steps  # the module's own metric, at the same steps
    if store == "csv" or store == "wandb-offline":  # row-based stores: one row per logging step, holding both
        label = "step" if store == "csv" else "trainer/global_step"
        assert sorted(int(r[label]) for r in rows) == steps
        assert all(own in r and any(k.startswith("stability/") for k in r) for r in rows)
    if store == "csv":
        assert all(r.get("epoch") == "0" for r in rows)
