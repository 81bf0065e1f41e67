"""ExactResume alone, next to Lightning's own ``ModelCheckpoint``: a run interrupted mid-epoch (stopped, or
SIGKILLed) and resumed from a ``ModelCheckpoint`` file ends bit-for-bit equal to the uninterrupted run, with a plain
shuffled ``DataLoader``, in one process and under 2-process DDP (resume_run.py: dropout and torch's, NumPy's and
Python's generators in every step). The control: the same without ExactResume is not exact. And next to
``StableCheckpoint`` it does nothing (one capture per save, one restore per resume); two of them are refused."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from lightning_stability import ExactResume, StabilityConfigError, StableCheckpoint
from lightning_stability.checkpoint.loader_state import KEY, LoaderResume
from tests.checkpoint.test_loader_resume import SCRIPT, differences, load, single
from tests.helpers import TinyModule, make_data, quiet_trainer, torchrun

NOT_RESUMABLE = "dataloader is not resumable"


class Shuffled(TinyModule):
    def train_dataloader(self) -> DataLoader:
        return DataLoader(make_data(self.n, self.dim), batch_size=self.batch_size, shuffle=True)


@pytest.mark.distributed
def test_a_model_checkpoint_file_saved_mid_epoch_resumes_exactly(tmp_path: Path) -> None:
    single(tmp_path, "shuffle", "reference", "stop", "resume-stop", RESUME_CALLBACK="exact")
    assert differences(tmp_path, "single-shuffle", "stop") == []
    resumed = load(tmp_path, "single-shuffle", "resume-stop", 0)
    assert resumed["warnings"] == []
    assert not any(NOT_RESUMABLE in w for w in resumed["lightning_warnings"])  # it does not hold: hidden


@pytest.mark.distributed
def test_without_it_lightnings_resume_is_not_exact_and_lightning_says_so(tmp_path: Path) -> None:
    """The control: the same ModelCheckpoint, the same plain loader, no ExactResume."""
    single(tmp_path, "shuffle", "reference", "stop", "resume-stop", RESUME_CALLBACK="lightning")
    found = differences(tmp_path, "single-shuffle", "stop")
    assert any("other samples" in f for f in found) and any("params" in f for f in found), found
    resumed = load(tmp_path, "single-shuffle", "resume-stop", 0)
    assert any(NOT_RESUMABLE in w for w in resumed["lightning_warnings"])  # it holds here: shown


@pytest.mark.distributed
def test_sigkilled_mid_epoch_resumes_exactly_from_a_named_file(tmp_path: Path) -> None:
    """ckpt_path=<dir>/epoch=1-step=12.ckpt (ModelCheckpoint's own file), after a SIGKILL in step 13."""
    env = {"RESUME_CALLBACK": "exact", "RESUME_CKPT": "epoch=1-step=12.ckpt"}
    single(tmp_path, "shuffle", "reference", **env)
    assert single(tmp_path, "shuffle", "kill", **env) == -9
    single(tmp_path, "shuffle", "resume-kill", **env)
    assert differences(tmp_path, "single-shuffle", "kill") == []
    assert min(load(tmp_path, "single-shuffle", "resume-kill", 0)["seen"]) == 12


@pytest.mark.distributed
def test_a_stable_checkpoint_file_resumes_exactly_with_it_alone(tmp_path: Path) -> None:
    """The same checkpoint key: a checkpoint StableCheckpoint wrote mid-epoch, resumed beside a plain
    ModelCheckpoint with ExactResume (ckpt_path names the file)."""
    single(tmp_path, "shuffle", "reference", "stop")  # StableCheckpoint saves every step; stopped at step 11
    env = {"RESUME_CALLBACK": "exact", "RESUME_CKPT": "epoch=1-step=11.ckpt"}
    single(tmp_path, "shuffle", "resume-stop", **env)
    assert differences(tmp_path, "single-shuffle", "stop") == []
    assert min(load(tmp_path, "single-shuffle", "resume-stop", 0)["seen"]) == 11


@pytest.mark.distributed
def test_ddp_resumes_exactly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Lightning injects a shuffling DistributedSampler into the plain loader; each rank draws other random numbers
    (resume_run.py seeds them apart), so a rank resumed with another's RNG states fails here."""
    monkeypatch.setenv("RESUME_CALLBACK", "exact")
    torchrun(SCRIPT, 2, tmp_path, "ddp", "shuffle", "reference", "stop", "resume-stop")
    assert differences(tmp_path, "ddp-shuffle", "stop", ranks=2) == []


def _count_units(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Count the captures and the restores of a resumed checkpoint (the real ones still run)."""
    calls = {"capture": 0, "restore": 0}
    capture, start = LoaderResume.capture, LoaderResume.start

    def counted_capture(self: LoaderResume, trainer: Any) -> dict[str, Any]:
        calls["capture"] += 1
        return capture(self, trainer)

    def counted_start(self: LoaderResume, trainer: Any) -> None:
        calls["restore"] += self.pending is not None
        start(self, trainer)

    monkeypatch.setattr(LoaderResume, "capture", counted_capture)
    monkeypatch.setattr(LoaderResume, "start", counted_start)
    return calls


def test_next_to_stable_checkpoint_it_does_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _count_units(monkeypatch)

    def fit(steps: int, ckpt_path: str | None) -> None:
        callbacks = [ExactResume(), StableCheckpoint(dirpath=tmp_path, every_n_train_steps=3)]
        quiet_trainer(callbacks=callbacks, max_steps=steps, enable_checkpointing=True).fit(
            Shuffled(), ckpt_path=ckpt_path
        )

    fit(3, None)  # 8 batches an epoch: step 3 is mid-epoch
    assert calls == {"capture": 1, "restore": 0}
    assert KEY in torch.load(tmp_path / "epoch=0-step=3.ckpt", weights_only=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(6, "last")
    assert calls == {"capture": 2, "restore": 1}
    assert not any(NOT_RESUMABLE in str(w.message) for w in caught)


def test_two_of_them_are_refused_at_setup() -> None:
    trainer = quiet_trainer(callbacks=[ExactResume(), ExactResume()], max_steps=1)
    with pytest.raises(StabilityConfigError, match=r"callbacks=.*two ExactResume.*Fix: keep one ExactResume"):
        trainer.fit(Shuffled())


class EpochOrdered(TinyModule):
    """A ``DistributedSampler`` on one process: each epoch's order is drawn from its epoch (as under DDP)."""

    def train_dataloader(self) -> DataLoader:
        data = make_data(self.n, self.dim)
        sampler: DistributedSampler[Any] = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True)
        return DataLoader(data, batch_size=self.batch_size, sampler=sampler)


class Seen(pl.Callback):
    def __init__(self) -> None:
        self.epochs_started: list[int] = []
        self.batches: dict[int, list[float]] = {}  # global step -> the batch's first input column

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.epochs_started.append(trainer.current_epoch)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.batches[trainer.global_step] = batch[0][:, 0].tolist()


def test_resumed_twice_at_an_epoch_end_each_epoch_starts_and_draws_its_own_order(tmp_path: Path) -> None:
    """Saved at each epoch's last step (8 batches an epoch), resumed at step 8 then at 16 from a checkpoint the first
    resumed fit wrote: epoch 2 is trained in epoch 2's order, and every epoch calls on_train_epoch_start."""

    def fit(directory: Path, steps: int, ckpt_path: str | None) -> Seen:
        seen = Seen()
        checkpoint = StableCheckpoint(dirpath=directory, every_n_train_steps=8)
        trainer = quiet_trainer(callbacks=[seen, checkpoint], max_steps=steps, enable_checkpointing=True)
        trainer.fit(EpochOrdered(), ckpt_path=ckpt_path)
        assert trainer.current_epoch == steps // 8
        return seen

    reference = fit(tmp_path / "reference", 24, None)
    fit(tmp_path / "resumed", 8, None)
    second, third = fit(tmp_path / "resumed", 16, "last"), fit(tmp_path / "resumed", 24, "last")
    assert (second.epochs_started, third.epochs_started) == ([1], [2])
    assert {**second.batches, **third.batches} == {s: b for s, b in reference.batches.items() if s >= 8}
