"""Lightning's two resume warnings that do not hold with StableCheckpoint are hidden there, and only there: a
Trainer without it, in the same process afterwards, still gets them."""

from __future__ import annotations

import warnings
from pathlib import Path

from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_stability import StableCheckpoint
from tests.helpers import TinyModule, quiet_trainer

NO_LAST, NOT_RESUMABLE = "no last checkpoint available", "dataloader is not resumable"


def _fit(callback: ModelCheckpoint, steps: int, ckpt_path: str | None) -> None:
    trainer = quiet_trainer(callbacks=[callback], max_steps=steps, enable_checkpointing=True)
    trainer.fit(TinyModule(), ckpt_path=ckpt_path)


def _count(caught: list[warnings.WarningMessage], text: str) -> int:
    return sum(text in str(w.message) for w in caught)


def test_a_fresh_start_with_ckpt_path_last_hides_the_save_last_hint_and_only_there(tmp_path: Path) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _fit(StableCheckpoint(dirpath=tmp_path / "stable", every_n_train_steps=2), 2, "last")
        assert _count(caught, NO_LAST) == 0
        _fit(ModelCheckpoint(dirpath=tmp_path / "plain", save_last=True), 2, "last")
        assert _count(caught, NO_LAST) == 1  # Lightning's own, without StableCheckpoint


def test_a_mid_epoch_resume_hides_the_not_resumable_warning_and_only_there(tmp_path: Path) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _fit(StableCheckpoint(dirpath=tmp_path / "stable", every_n_train_steps=3), 3, None)  # 8 batches an epoch
        _fit(StableCheckpoint(dirpath=tmp_path / "stable", every_n_train_steps=3), 6, "last")
        assert _count(caught, NOT_RESUMABLE) == 0
        _fit(ModelCheckpoint(dirpath=tmp_path / "plain", every_n_train_steps=3, save_last=True), 3, None)
        _fit(ModelCheckpoint(dirpath=tmp_path / "plain", every_n_train_steps=3, save_last=True), 6, "last")
        assert _count(caught, NOT_RESUMABLE) == 1  # Lightning's own, without StableCheckpoint
