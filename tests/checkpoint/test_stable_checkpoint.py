"""StableCheckpoint with real Trainers, real files and real signals: only healthy states on disk, the ring, resume
from the newest healthy checkpoint, a save and a clean stop on SIGTERM/SIGUSR1 (one process here; two processes
with one rank signalled in test_stable_checkpoint_ddp.py)."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.environments import SLURMEnvironment

from lightning_stability import (
    AtomicCheckpointIO,
    GradientNormMonitor,
    StabilityConfigError,
    StableCheckpoint,
    StableTrainer,
    TrainingHealthMonitor,
)
from lightning_stability.checkpoint import atomic
from lightning_stability.checkpoint.ring import FILE_NAME, HealthyCheckpoints
from lightning_stability.trainer import checkpoint_interval
from tests.helpers import SendSignal, TinyModule, quiet_trainer

BAD = 5  # the module misbehaves in the step that starts at this global_step (it closes as step BAD + 1)


class Faulty(TinyModule):
    """``nan``: the loss (and so every gradient) is inf. ``spike``: the loss's value is 100x, its gradient is the
    clean one (only the health monitor can tell)."""

    def __init__(self, fault: str | None = None, **kwargs: Any) -> None:
        super().__init__(n=8, **kwargs)  # one batch per epoch: the same data at every step, whatever the resume
        self.fault = fault

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        if self.global_step == BAD and self.fault == "nan":
            return loss * float("inf")
        if self.global_step == BAD and self.fault == "spike":
            return loss + 99 * loss.detach()
        return loss


class StartStep(pl.Callback):
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.step = trainer.global_step


def steps_on_disk(directory: Path) -> list[int]:
    """The steps of the ring checkpoints (``epoch=E-step=S.ckpt``) in ``directory``."""
    return sorted(int(re.search(r"step=(\d+)", p.name)[1]) for p in directory.glob("epoch=*-step=*.ckpt"))  # type: ignore[index]


def fit(tmp_path: Path, model: pl.LightningModule, callbacks: list[Any], **kwargs: Any) -> pl.Trainer:
    trainer = quiet_trainer(
        max_steps=kwargs.pop("max_steps", 10),
        enable_checkpointing=True,
        default_root_dir=tmp_path,
        plugins=[AtomicCheckpointIO()],
        callbacks=callbacks,
    )
    trainer.fit(model, ckpt_path=kwargs.pop("ckpt_path", None))
    return trainer


# ---------------------------------------------------------------------- only healthy states
@pytest.mark.parametrize(
    ("fault", "monitors"),
    [
        ("nan", [GradientNormMonitor()]),  # skipped: a non-finite gradient
        ("spike", [TrainingHealthMonitor(response="skip", warmup_steps=3, report=False)]),  # skipped: a spike
        ("spike", [TrainingHealthMonitor(response="warn", warmup_steps=3, report=False)]),  # applied, but flagged
    ],
)
def test_an_unhealthy_step_is_never_saved_and_the_save_waits_for_the_next_healthy_one(
    tmp_path: Path, fault: str, monitors: list[pl.Callback], caplog: pytest.LogCaptureFixture
) -> None:
    pl.seed_everything(0)
    ckpt = StableCheckpoint(dirpath=tmp_path / "ckpts", every_n_train_steps=2, keep=10)
    with caplog.at_level(logging.INFO):
        fit(tmp_path, Faulty(fault), [*monitors, ckpt])
    # due at 2, 4, 6, 8, 10; step 6 (BAD + 1) is not healthy: written at 7 instead
    assert steps_on_disk(tmp_path / "ckpts") == [2, 4, 7, 8, 10]
    said = [r.getMessage() for r in caplog.records if "not healthy" in r.getMessage()]
    assert len(said) == 1 and "step 6" in said[0], said
    listed = json.loads((tmp_path / "ckpts" / FILE_NAME).read_text())["checkpoints"]
    assert [e["step"] for e in listed] == [2, 4, 7, 8, 10]


def test_non_finite_weights_are_never_saved_without_any_monitor(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """No ledger callback: the NaN update is applied, the weights stay NaN, and nothing more is saved (said once)."""
    pl.seed_everything(0)
    ckpt = StableCheckpoint(dirpath=tmp_path / "ckpts", every_n_train_steps=2, keep=10, save_last=True)
    with caplog.at_level(logging.INFO):
        fit(tmp_path, Faulty("nan"), [ckpt])
    assert steps_on_disk(tmp_path / "ckpts") == [2, 4]
    last = torch.load(tmp_path / "ckpts" / "last.ckpt", weights_only=False)
    # Lightning 2.6 writes last.ckpt with the due saves (step 4); 2.5 also at each epoch end (step 5): both healthy
    assert last["global_step"] in (4, 5)
    assert all(torch.isfinite(v).all() for v in last["state_dict"].values())
    said = [r.getMessage() for r in caplog.records if "not healthy" in r.getMessage()]
    assert len(said) == 1 and "not finite" in said[0], said


# ---------------------------------------------------------------------- the writer
def test_alone_on_a_trainer_it_writes_atomic_checksummed_files_and_last_skips_a_damaged_one(tmp_path: Path) -> None:
    """No ``plugins=``: as Lightning users add a callback. The files carry checksums (``AtomicCheckpointIO`` was
    installed), a flipped byte fails ``verify_checkpoint`` and ``ckpt_path="last"`` resumes from the older one."""
    directory = tmp_path / "ckpts"
    ckpt = StableCheckpoint(dirpath=directory, every_n_train_steps=2, keep=3)
    trainer = quiet_trainer(max_steps=4, enable_checkpointing=True, default_root_dir=tmp_path, callbacks=[ckpt])
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # nothing to warn about: the writer is the right one
        warnings.filterwarnings("ignore", message=".*(does not have many workers|Checkpoint directory)")
        trainer.fit(Faulty())
    assert isinstance(trainer.strategy.checkpoint_io, AtomicCheckpointIO)
    newest, older = directory / "epoch=3-step=4.ckpt", directory / "epoch=1-step=2.ckpt"
    assert atomic.verify(newest) == (newest, True) and atomic.verify(older) == (older, True)  # checksummed
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0x10
    newest.write_bytes(bytes(data))
    with pytest.raises(atomic.CheckpointError, match="is damaged"):
        atomic.verify_checkpoint(newest)
    start = StartStep()
    resumed = StableCheckpoint(dirpath=directory, every_n_train_steps=2, keep=3)
    again = quiet_trainer(max_steps=5, enable_checkpointing=True, default_root_dir=tmp_path, callbacks=[resumed, start])
    with pytest.warns(UserWarning, match=f"failed verification: The checkpoint .*{newest.name} is damaged"):
        again.fit(Faulty(), ckpt_path="last")
    assert start.step == 2


def test_a_damaged_checkpoint_published_but_not_listed_is_named_and_not_taken_back(tmp_path: Path) -> None:
    """Killed right after publishing step 4 (before the list named it), and the file damaged while the job was down:
    the resume starts from step 3 and says why step 4 was not taken back."""
    directory = tmp_path / "ckpts"
    pl.seed_everything(0)
    fit(tmp_path, Faulty(), [StableCheckpoint(dirpath=directory, every_n_train_steps=1, keep=5)], max_steps=4)
    listing = json.loads((directory / FILE_NAME).read_text())
    listing["checkpoints"] = [e for e in listing["checkpoints"] if e["step"] < 4]  # as the list was before the kill
    (directory / FILE_NAME).write_text(json.dumps(listing))
    newest = directory / "epoch=3-step=4.ckpt"
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0x10
    newest.write_bytes(bytes(data))  # written after the list: a candidate to take back
    start = StartStep()
    with pytest.warns(
        UserWarning, match=rf"written after the healthy list .* not taken back: .*{newest.name} is damaged"
    ):
        fit(tmp_path, Faulty(), [StableCheckpoint(dirpath=directory, every_n_train_steps=1, keep=5), start],
            max_steps=5, ckpt_path="last")  # fmt: skip
    assert start.step == 3


def test_a_writer_without_checksums_is_said_at_setup(tmp_path: Path) -> None:
    from lightning.pytorch.plugins.io import TorchCheckpointIO

    ckpt = StableCheckpoint(dirpath=tmp_path / "ckpts", every_n_train_steps=2)
    trainer = quiet_trainer(max_steps=1, enable_checkpointing=True, plugins=[TorchCheckpointIO()], callbacks=[ckpt])
    with pytest.warns(UserWarning, match=r"SingleDeviceStrategy and TorchCheckpointIO, which write no checksums.*"
                      r"Leave out the CheckpointIO plugin"):  # fmt: skip
        trainer.fit(Faulty())


# ---------------------------------------------------------------------- the ring and resume
def test_the_ring_keeps_keep_and_last_resumes_from_the_newest_complete_one(tmp_path: Path) -> None:
    directory = tmp_path / "ckpts"
    pl.seed_everything(0)
    fit(tmp_path, Faulty(), [StableCheckpoint(dirpath=directory, every_n_train_steps=1, keep=3)], max_steps=7)
    assert steps_on_disk(directory) == [5, 6, 7]

    # the newest is cut short; a foreign, newer file and a sibling a crashed save left are there too
    newest = directory / "epoch=6-step=7.ckpt"
    os.truncate(newest, newest.stat().st_size // 2)
    torch.save({"not": "ours"}, directory / "last.ckpt")
    (directory / f"{atomic.PARTIAL_PREFIX}0123").write_bytes(b"half")
    start = StartStep()
    pl.seed_everything(0)
    fit(tmp_path, Faulty(), [StableCheckpoint(dirpath=directory, every_n_train_steps=1, keep=3), start],
        max_steps=9, ckpt_path="last")  # fmt: skip
    assert start.step == 6  # step 7 failed verify_checkpoint, last.ckpt is not listed
    assert not list(directory.glob(f"{atomic.PARTIAL_PREFIX}*"))  # cleaned where "last" was resolved
    # the ring goes on from 6; the broken 7, newer than where this fit started, went off the list at its start
    assert [(e.name, e.step) for e in HealthyCheckpoints(directory).load().entries] == [
        ("epoch=6-step=7-v1.ckpt", 7), ("epoch=7-step=8.ckpt", 8), ("epoch=8-step=9.ckpt", 9)
    ]  # fmt: skip


def test_a_fresh_fit_or_an_older_resume_takes_the_newer_listed_checkpoints_off_the_list(tmp_path: Path) -> None:
    """A fresh fit in a directory an earlier run used, then a crash: ckpt_path="last" must resume this run, not the
    earlier run's newer step. The same after resuming from an older checkpoint than the newest."""
    directory = tmp_path / "ckpts"

    def run(max_steps: int, ckpt_path: str | None = None) -> int:
        start = StartStep()
        pl.seed_everything(0)
        callbacks = [StableCheckpoint(dirpath=directory, every_n_train_steps=1, keep=3), start]
        fit(tmp_path, Faulty(), callbacks, max_steps=max_steps, ckpt_path=ckpt_path)
        return start.step

    run(6)  # an earlier run: 4, 5, 6 listed
    with pytest.warns(UserWarning, match=r"3 checkpoint\(s\) .* saved after step 0, where this fit starts"):
        assert run(2) == 0  # a fresh one in the same directory, stopped at 2 (as by a crash)
    assert [e.step for e in HealthyCheckpoints(directory).load().entries] == [1, 2]
    assert run(3, ckpt_path="last") == 2  # this run's step 2, not the earlier run's 6
    with pytest.warns(UserWarning, match=r"2 checkpoint\(s\) .* saved after step 1"):
        assert run(2, ckpt_path=str(directory / "epoch=0-step=1.ckpt")) == 1  # back to 1: 2 and 3 abandoned
    assert [e.step for e in HealthyCheckpoints(directory).load().entries] == [1, 2]
    assert run(4, ckpt_path="last") == 2


# ---------------------------------------------------------------------- signals
def test_sigterm_saves_at_the_next_step_boundary_stops_and_resumes_exactly(tmp_path: Path) -> None:
    calls: list[int] = []

    def users_own(signum: int, frame: Any) -> None:
        calls.append(signum)

    signal.signal(signal.SIGTERM, users_own)  # installed before fit: still called
    directory = tmp_path / "ckpts"

    pl.seed_everything(0)
    stopped = fit(
        tmp_path,
        Faulty(),
        [StableCheckpoint(dirpath=directory, every_n_train_steps=100), SendSignal(signal.SIGTERM, 3)],
    )
    assert stopped.global_step == 4 and stopped.should_stop  # the step under way finished, then it stopped
    assert steps_on_disk(directory) == [4]
    assert calls == [signal.SIGTERM]
    assert signal.getsignal(signal.SIGTERM) is users_own  # put back after fit

    pl.seed_everything(0)
    resumed = fit(tmp_path, Faulty(), [StableCheckpoint(dirpath=directory)], ckpt_path="last")
    pl.seed_everything(0)
    straight = fit(tmp_path / "straight", Faulty(), [])
    assert resumed.global_step == straight.global_step == 10
    for a, b in zip(resumed.lightning_module.parameters(), straight.lightning_module.parameters(), strict=True):
        assert torch.equal(a, b)


def test_sigusr1_under_slurm_auto_requeue_saves_stops_and_runs_lightnings_requeue(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key, value in {"SLURM_NTASKS": "1", "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "train", "SLURM_PROCID": "0",
                       "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "PATH": str(tmp_path)}.items():  # fmt: skip
        monkeypatch.setenv(key, value)  # PATH: no scontrol (Lightning logs that the requeue failed)
    trainer = quiet_trainer(
        max_steps=10,
        enable_checkpointing=True,
        default_root_dir=tmp_path,
        plugins=[AtomicCheckpointIO(), SLURMEnvironment(auto_requeue=True)],
        callbacks=[
            StableCheckpoint(dirpath=tmp_path / "ckpts", every_n_train_steps=100),
            SendSignal(signal.SIGUSR1, 3),
        ],
    )
    pl.seed_everything(0)
    trainer.fit(Faulty())
    assert trainer.global_step == 4 and trainer.should_stop
    assert steps_on_disk(tmp_path / "ckpts") == [4]
    hpc = tmp_path / "hpc_ckpt_1.ckpt"  # Lightning's requeue handler ran, after ours, at the same boundary
    assert torch.load(hpc, weights_only=False)["global_step"] == 4


# ---------------------------------------------------------------------- presets and arguments
def test_from_preset_attaches_it_unless_checkpointing_is_the_users(tmp_path: Path) -> None:
    common: dict[str, Any] = dict(accelerator="cpu", logger=False, enable_progress_bar=False, max_steps=2)
    trainer = StableTrainer.from_preset("tiny", default_root_dir=tmp_path, **common)
    ours = [cb for cb in trainer.callbacks if isinstance(cb, ModelCheckpoint)]  # type: ignore[attr-defined]
    assert len(ours) == 1 and isinstance(ours[0], StableCheckpoint)
    assert Path(str(ours[0].dirpath)) == tmp_path / "checkpoints"
    trainer.fit(TinyModule())
    assert steps_on_disk(tmp_path / "checkpoints") == [1, 2]  # a run of 2 steps: every 10% of it, at least 1

    plain = ModelCheckpoint(dirpath=tmp_path / "mine")
    trainer = StableTrainer.from_preset("tiny", callbacks=[plain], **common)
    assert [cb for cb in trainer.callbacks if isinstance(cb, ModelCheckpoint)] == [plain]  # type: ignore[attr-defined]
    trainer = StableTrainer.from_preset("tiny", enable_checkpointing=False, **common)
    assert not [cb for cb in trainer.callbacks if isinstance(cb, ModelCheckpoint)]  # type: ignore[attr-defined]


def test_a_preset_run_saves_every_tenth_of_its_steps_and_its_last_state(tmp_path: Path) -> None:
    """max_steps=23: every 2 steps (10%), and the state at step 23, which 2 does not divide; the ring keeps 3. With
    max_epochs only (the length unknown at construction), Lightning's epoch ends."""
    common: dict[str, Any] = dict(accelerator="cpu", logger=False, enable_progress_bar=False)
    trainer = StableTrainer.from_preset("tiny", default_root_dir=tmp_path / "steps", max_steps=23, **common)
    trainer.fit(TinyModule())
    assert trainer.global_step == 23
    assert steps_on_disk(tmp_path / "steps" / "checkpoints") == [20, 22, 23]
    assert [checkpoint_interval(n) for n in (2, 23, 4_000, 10**6, -1, None)] == [1, 2, 400, 500, None, None]

    trainer = StableTrainer.from_preset("tiny", default_root_dir=tmp_path / "epochs", max_epochs=2, **common)
    trainer.fit(TinyModule())
    per_epoch = trainer.global_step // 2
    assert steps_on_disk(tmp_path / "epochs" / "checkpoints") == [per_epoch, 2 * per_epoch]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"keep": 0}, r"`keep=0` must be an int >= 1"),
        ({"signals": [signal.SIGKILL]}, r"`signals=<Signals.SIGKILL: 9>` is not a signal this process can catch"),
        ({"save_weights_only": True}, r"`save_weights_only=True` would make checkpoints a run cannot resume from"),
        ({"dirpath": "memory://ckpts"}, r"`dirpath='memory://ckpts'` is not a local or mounted path"),
        ({"save_at_end": "yes"}, r"`save_at_end='yes'` must be a bool"),
    ],
)
def test_bad_arguments_name_the_argument_and_the_fix(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(StabilityConfigError, match=match):
        StableCheckpoint(**kwargs)
