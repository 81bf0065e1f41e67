"""A rollback to disk onto a checkpoint damaged on disk goes to the next older healthy one, with a warning naming
the damaged one and what differs: real Trainers, real checkpoints written by StableCheckpoint, the damage done to
the file on disk during the run (a byte flipped; the file replaced whole by another step's)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from lightning_stability import AtomicCheckpointIO, StableCheckpoint, TrainingHealthMonitor
from tests.health.test_health import SkipLabels, Spiky, monitor
from tests.helpers import quiet_trainer


def checkpoint_of(directory: Path, step: int) -> Path:
    (path,) = directory.glob(f"epoch=*-step={step}.ckpt")
    return path


class DamageOnDisk(pl.Callback):
    """Before the batch of global step ``at``: the checkpoint saved at global step ``step`` gets a byte flipped
    in its middle, or (``like``) is replaced whole by the one saved at global step ``like``."""

    def __init__(self, directory: Path, at: int, step: int, like: int | None = None) -> None:
        self.directory, self.at, self.step, self.like = directory, at, step, like

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, i: int) -> None:
        if trainer.global_step != self.at:
            return
        path = checkpoint_of(self.directory, self.step)
        if self.like is not None:
            shutil.copyfile(checkpoint_of(self.directory, self.like), path)
            return
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x10
        path.write_bytes(bytes(data))


def run(tmp_path: Path, damage: pl.Callback | None) -> tuple[pl.Trainer, TrainingHealthMonitor]:
    """Spikes at 11 and 12, decided at 13, no rollback from memory: back to the newest checkpoint on disk saved
    before the damage (global step 10 when it is whole)."""
    pl.seed_everything(0)
    mon = monitor("rollback", max_rollbacks=0)
    ring = StableCheckpoint(dirpath=tmp_path / "ckpts", every_n_train_steps=1, keep=100)
    callbacks = [mon, ring] + ([damage] if damage is not None else [])
    trainer = quiet_trainer(
        max_steps=24, enable_checkpointing=True, plugins=[AtomicCheckpointIO()], callbacks=callbacks
    )
    trainer.fit(Spiky(spike_at=(11, 12)))
    return trainer, mon


def reference(skipped: range) -> pl.Trainer:
    """The run that never applied the steps in ``skipped``: where a rollback to the checkpoint saved at global
    step ``skipped.start`` (the state after step ``skipped.start - 1``) ends."""
    pl.seed_everything(0)
    trainer = quiet_trainer(max_steps=24, callbacks=[SkipLabels(set(skipped))])
    trainer.fit(Spiky(spike_at=(11, 12)))
    return trainer


def same_weights(a: pl.Trainer, b: pl.Trainer) -> bool:
    ours, theirs = a.lightning_module.parameters(), b.lightning_module.parameters()
    return all(torch.equal(x, y) for x, y in zip(ours, theirs, strict=True))


def test_a_byte_flipped_in_the_newest_checkpoint_rolls_back_to_the_older_one(tmp_path: Path) -> None:
    directory = tmp_path / "ckpts"
    with pytest.warns(UserWarning) as caught:
        trainer, mon = run(tmp_path, DamageOnDisk(directory, at=12, step=10))
    messages = [str(w.message) for w in caught]
    damaged = checkpoint_of(directory, 10)
    (skipped,) = [m for m in messages if "skipping a damaged checkpoint" in m]
    assert f"The checkpoint {damaged} is damaged: checksum crc32:" in skipped and "recorded when written" in skipped
    assert any(
        re.search(r"rollback from disk 1/1: restored .*epoch=\d+-step=9\.ckpt \(the state after step 8\)", m)
        for m in messages
    ), messages
    assert mon.rollback.disk_steps == [9]
    assert same_weights(trainer, reference(range(9, 17)))  # as a run rolled back to the older one ends


def test_a_checkpoint_replaced_by_another_steps_is_skipped_too(tmp_path: Path) -> None:
    """Whole and self-consistent (its checksum matches), but not the one the healthy list names."""
    directory = tmp_path / "ckpts"
    with pytest.warns(UserWarning) as caught:
        trainer, mon = run(tmp_path, DamageOnDisk(directory, at=12, step=10, like=4))
    messages = [str(w.message) for w in caught]
    (skipped,) = [m for m in messages if "skipping a damaged checkpoint" in m]
    assert "is not the one listed" in skipped and "of step 10, it holds" in skipped and "of step 4" in skipped
    assert mon.rollback.disk_steps == [9]
    assert same_weights(trainer, reference(range(9, 17)))
