"""The ``stability/`` keys as loggers see them: no key lies below another (a file store could not hold both), and
one ``CSVLogger`` row per logging step holds them with the module's own ``self.log`` metrics."""

from __future__ import annotations

import csv
from collections.abc import Callable
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger

from lightning_stability import GradientNormMonitor
from tests.helpers import quiet_trainer
from tests.metric_runs import (
    GPT_PART_PREFIXES,
    TWO_OPTIMIZER_PART_PREFIXES,
    TwoGroupLM,
    fit_gpt_preset,
    fit_two_optimizers,
    keys_below_others,
    stability_keys,
)

FITS: dict[str, tuple[Callable[..., pl.Trainer], tuple[str, ...]]] = {
    "gpt-preset": (fit_gpt_preset, GPT_PART_PREFIXES),
    "two-optimizers": (fit_two_optimizers, TWO_OPTIMIZER_PART_PREFIXES),
}


def _csv(logger: CSVLogger) -> list[dict[str, str]]:
    with open(Path(logger.log_dir) / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def test_keys_below_others_finds_a_key_under_another() -> None:
    keys = {"stability/lr", "stability/lr/pg1", "stability/lr_by_group/pg1", "stability/grad_norm"}
    assert keys_below_others(keys) == [("stability/lr", "stability/lr/pg1")]


@pytest.mark.parametrize("fit", list(FITS))
def test_no_logged_key_lies_below_another(tmp_path: Path, fit: str) -> None:
    run, parts = FITS[fit]
    logger = CSVLogger(tmp_path, name="", version="")
    trainer = run(logger, tmp_path)
    keys = stability_keys(trainer, set(_csv(logger)[0]))
    for prefix in parts:  # every kind of part is logged, so the check below covers it
        assert any(k.startswith(prefix) for k in keys), (prefix, sorted(keys))
    assert not keys_below_others(keys), keys_below_others(keys)


# ---- one CSV row per logging step


def _rows(logger: CSVLogger) -> list[tuple[int, str, set[str]]]:
    """Each row's step, epoch and the names of the metrics it holds."""
    return [
        (int(r["step"]), r["epoch"], {k for k, v in r.items() if v and k not in ("step", "epoch")})
        for r in _csv(logger)
    ]


def test_the_stability_metrics_share_the_row_of_the_modules_metrics(tmp_path: Path) -> None:
    logger = CSVLogger(tmp_path, name="", version="")
    trainer = fit_gpt_preset(logger, tmp_path, steps=6, every=2)
    rows = _rows(logger)
    assert [step for step, _, _ in rows] == [1, 3, 5]  # one row per logging step
    for _, epoch, names in rows:
        assert epoch == "0"
        assert {"train_loss", "stability/grad_norm", "stability/lr_by_group/pg1"} <= names, names
    assert "stability/grad_norm" in trainer.logged_metrics  # Lightning's own record of what it logged


def test_on_steps_only_one_side_logs_its_row_still_has_the_epoch(tmp_path: Path) -> None:
    # the callbacks log every 2 steps (labels 1, 3, 5), Lightning's self.log every 3 (labels 2, 5)
    logger = CSVLogger(tmp_path, name="", version="")
    trainer = quiet_trainer(
        max_steps=6, log_every_n_steps=3, logger=logger, callbacks=[GradientNormMonitor(log_every_n_steps=2)]
    )
    torch.manual_seed(0)
    trainer.fit(TwoGroupLM())
    rows = _rows(logger)
    assert [step for step, _, _ in rows] == [1, 2, 3, 5]
    assert all(epoch == "0" for _, epoch, _ in rows)
    has = {step: ("train_loss" in names, "stability/grad_norm" in names) for step, _, names in rows}
    assert has == {1: (False, True), 2: (True, False), 3: (False, True), 5: (True, True)}


def test_two_optimizers_log_one_row_per_logging_step(tmp_path: Path) -> None:
    logger = CSVLogger(tmp_path, name="", version="")
    fit_two_optimizers(logger, tmp_path, steps=8, every=2)  # 4 batches, each steps both optimizers
    rows = _rows(logger)
    assert [step for step, _, _ in rows] == [1, 3]
    for _, epoch, names in rows:
        assert epoch == "0" and {"d_loss", "stability/grad_norm/SGD", "stability/lr/Adam"} <= names, names
