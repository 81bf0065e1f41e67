"""The ``stability/`` keys as loggers see them: no key lies below another (a file store could not hold both)."""

from __future__ import annotations

import csv
import warnings
from collections.abc import Callable
from pathlib import Path

import lightning.pytorch as pl
import pytest
from lightning.pytorch.loggers import CSVLogger

from tests.metric_runs import (
    GPT_PART_PREFIXES,
    TWO_OPTIMIZER_PART_PREFIXES,
    fit_gpt_preset,
    fit_two_optimizers,
    keys_below_others,
    stability_keys,
)

warnings.filterwarnings("ignore", ".*does not have many workers.*")

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
