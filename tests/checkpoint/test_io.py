"""AtomicCheckpointIO in real single-device Trainers: resume with ckpt_path="last", clear load errors, presets."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins import TorchCheckpointIO
from lightning.pytorch.strategies import DDPStrategy

from lightning_stability import AtomicCheckpointIO, CheckpointError, StableCheckpoint, StableTrainer
from lightning_stability.checkpoint import atomic
from lightning_stability.errors import StabilityConfigError
from lightning_stability.strategies import StableFSDPStrategy
from tests.helpers import TinyModule, quiet_trainer


class StartStep(pl.Callback):
    def __init__(self) -> None:
        self.step: int | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.step = trainer.global_step


def fit(dirpath: Path, max_steps: int, ckpt_path: str | None = None, **kwargs: Any) -> tuple[pl.Trainer, StartStep]:
    start = StartStep()
    trainer = quiet_trainer(
        max_steps=max_steps,
        enable_checkpointing=True,
        plugins=[AtomicCheckpointIO()],
        callbacks=[start, ModelCheckpoint(dirpath=dirpath, save_last=True, every_n_train_steps=1)],
        **kwargs,
    )
    trainer.fit(TinyModule(), ckpt_path=ckpt_path)
    return trainer, start


def test_resume_from_last_ignores_and_cleans_the_siblings_a_crash_left(tmp_path: Path) -> None:
    fit(tmp_path, max_steps=3)
    # ModelCheckpoint removed each previous top-1 file through AtomicCheckpointIO.remove_checkpoint
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epoch=0-step=3.ckpt", "last.ckpt"]
    # what crashed saves leave: a never-published copy (an older state, written later), a moved-away old one
    with open(atomic.partial_path(tmp_path / "last.ckpt", "0123456789abcdef"), "wb") as f:
        torch.save({"not": "a checkpoint"}, f)  # loading this would fail the resume
    (tmp_path / f"{atomic.OLD_PREFIX}fedcba9876543210").write_bytes(b"PK\x03\x04")

    trainer, start = fit(tmp_path, max_steps=5, ckpt_path="last")
    assert trainer.ckpt_path == str(tmp_path / "last.ckpt")
    assert start.step == 3 and trainer.global_step == 5
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epoch=0-step=5.ckpt", "last.ckpt"]
    assert torch.load(tmp_path / "last.ckpt", weights_only=False)["global_step"] == 5


def test_a_truncated_last_checkpoint_fails_with_an_error_naming_it(tmp_path: Path) -> None:
    fit(tmp_path, max_steps=2)
    last = tmp_path / "last.ckpt"
    with open(last, "r+b") as f:
        f.truncate(last.stat().st_size // 3)
    with pytest.raises(CheckpointError, match=rf"The checkpoint {last} is incomplete: the file is truncated"):
        fit(tmp_path, max_steps=4, ckpt_path=str(last))


def test_without_it_the_same_file_fails_from_inside_torch(tmp_path: Path) -> None:
    """What the error replaces: Lightning's default CheckpointIO lets torch's deserializer fail, naming nothing."""
    fit(tmp_path, max_steps=2)
    last = tmp_path / "last.ckpt"
    with open(last, "r+b") as f:
        f.truncate(last.stat().st_size // 3)
    with pytest.raises(Exception) as info:
        TorchCheckpointIO().load_checkpoint(last)
    assert not isinstance(info.value, CheckpointError) and str(last) not in str(info.value)


def test_storage_options_are_refused_with_the_fix(tmp_path: Path) -> None:
    with pytest.raises(StabilityConfigError, match=r"`storage_options=\{'a': 1\}` is not used .* Fix: drop"):
        AtomicCheckpointIO().save_checkpoint({}, tmp_path / "x.ckpt", storage_options={"a": 1})


# ---------------------------------------------------------------------- StableCheckpoint installs it
def _io(**kwargs: Any) -> Any:
    """The writer of a preset's Trainer (it attaches StableCheckpoint) after StableCheckpoint's setup."""
    trainer = StableTrainer.from_preset("gpt", accelerator="cpu", logger=False, enable_progress_bar=False, **kwargs)
    checkpoint = trainer.checkpoint_callback
    assert isinstance(checkpoint, StableCheckpoint)
    checkpoint.setup(trainer, TinyModule(), "validate")  # "fit" would open the signal exchange's process group
    return trainer.strategy.checkpoint_io


@pytest.mark.parametrize(
    "kwargs",
    [{"devices": 1}, {"devices": 2}, {"devices": 2, "strategy": "ddp"}, {"devices": 2, "strategy": DDPStrategy()}],
    ids=["single", "auto-ddp", "ddp", "ddp-instance"],
)
def test_stable_checkpoint_installs_atomic_checkpoint_io_on_plain_strategies(kwargs: dict[str, Any]) -> None:
    assert isinstance(_io(**kwargs), AtomicCheckpointIO)


def test_it_keeps_the_users_checkpoint_io_and_leaves_fsdp_alone() -> None:
    mine = TorchCheckpointIO()
    with pytest.warns(UserWarning, match="TorchCheckpointIO, which write no checksums"):
        assert _io(devices=1, plugins=[mine]) is mine
    with pytest.warns(UserWarning, match="TorchCheckpointIO, which write no checksums"):
        assert _io(devices=2, strategy=DDPStrategy(checkpoint_io=mine)) is mine
    strategy = StableTrainer.from_preset("175b", accelerator="cpu", devices=2, logger=False).strategy
    assert isinstance(strategy, StableFSDPStrategy)
    assert not isinstance(strategy.checkpoint_io, AtomicCheckpointIO)  # it saves atomically itself
