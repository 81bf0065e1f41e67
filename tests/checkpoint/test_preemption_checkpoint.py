"""PreemptionCheckpoint alone, next to Lightning's own ``ModelCheckpoint(save_last=True)``: a real signal sent to
the process (to one rank of two under DDP) saves every rank's state at one agreed step boundary as ``last.ckpt``,
the Trainer stops, and ``trainer.fit(model, ckpt_path="last")`` resumes from that save; with ``ExactResume`` the
resumed run ends bit-for-bit equal to an uninterrupted one (resume_run.py, ``RESUME_CALLBACK=preempt``: the
ModelCheckpoint itself saves only every 5 steps, so the save at the signal is PreemptionCheckpoint's)."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_stability import PreemptionCheckpoint, StabilityConfigError, StableCheckpoint, read_incidents
from tests.checkpoint.test_loader_resume import SCRIPT, STEPS, differences, load, single
from tests.helpers import SendSignal, TinyModule, quiet_trainer, torchrun


def saved_at_the_stop(out: Path, name: str, how: str, ranks: int) -> None:
    """The interrupted run stopped early, and the resume started at the step after its last one: its state at
    the stop was saved (the ModelCheckpoint's own newest save is older)."""
    for rank in range(ranks):
        interrupted = load(out, name, how, rank)
        resumed = load(out, name, f"resume-{how}", rank)
        last = max(interrupted["seen"])
        assert interrupted["global_step"] == last + 1 < STEPS
        assert (last + 1) % 5 != 0  # not a step ModelCheckpoint saves itself
        assert min(resumed["seen"]) == last + 1, (rank, min(resumed["seen"]), last)


@pytest.mark.distributed
@pytest.mark.parametrize("how", ["sigterm", "sigusr1"])
def test_a_signal_saves_stops_and_resumes_exactly(tmp_path: Path, how: str) -> None:
    single(tmp_path, "shuffle", "reference", how, f"resume-{how}", RESUME_CALLBACK="preempt")
    saved_at_the_stop(tmp_path, "single-shuffle", how, ranks=1)
    assert differences(tmp_path, "single-shuffle", how) == []


@pytest.mark.distributed
@pytest.mark.parametrize("stop_at", [11, 2], ids=["after-first-save", "before-first-save"])
def test_ddp_one_rank_signalled_every_rank_saves_the_same_step_and_stops(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stop_at: int
) -> None:
    """Only rank 1 gets SIGTERM; both ranks agree at one boundary, save, stop; the resume is exact. Signalled at
    step 2, before the ModelCheckpoint's first save of the fit: its save of ``last`` at the end of fit (which it
    makes when it has saved nothing in this fit, after the epoch loop advanced) must not replace the save at the
    signal, or the restart trains the next epoch's sample order."""
    monkeypatch.setenv("RESUME_CALLBACK", "preempt")
    monkeypatch.setenv("RESUME_STOP_AT", str(stop_at))
    torchrun(SCRIPT, 2, tmp_path, "ddp", "shuffle", "reference", "sigterm", "resume-sigterm")
    saved_at_the_stop(tmp_path, "ddp-shuffle", "sigterm", ranks=2)
    assert differences(tmp_path, "ddp-shuffle", "sigterm", ranks=2) == []


def test_a_signal_before_the_model_checkpoints_first_save(tmp_path: Path) -> None:
    """Signalled at step 2 of 10, ModelCheckpoint(every_n_train_steps=5) has saved nothing: last.ckpt holds step 3
    (the ModelCheckpoint takes it for its own save and does not write last again at the end of fit) and the resume
    starts there. A handler the user
    installed before fit still runs, and is put back after."""
    calls: list[int] = []

    def users_own(signum: int, frame: Any) -> None:
        calls.append(signum)

    signal.signal(signal.SIGTERM, users_own)
    saver = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=5, save_last=True)
    callbacks = [saver, PreemptionCheckpoint(), SendSignal(signal.SIGTERM, 2)]
    trainer = quiet_trainer(callbacks=callbacks, max_steps=10, enable_checkpointing=True)
    trainer.fit(TinyModule())
    assert trainer.global_step == 3 and calls == [signal.SIGTERM]
    assert signal.getsignal(signal.SIGTERM) is users_own
    assert sorted(p.name for p in tmp_path.iterdir()) == ["incidents", "last.ckpt"]
    (preemption,) = read_incidents(tmp_path)
    assert (
        preemption.kind == "preemption" and preemption.step == 3 and "SIGTERM (on 1 rank) received" in preemption.action
    )
    assert torch.load(tmp_path / "last.ckpt", weights_only=False)["global_step"] == 3
    resumed = quiet_trainer(
        callbacks=[ModelCheckpoint(dirpath=tmp_path, save_last=True)], max_steps=4, enable_checkpointing=True
    )
    resumed.fit(TinyModule(), ckpt_path="last")
    assert resumed.global_step == 4


@pytest.mark.parametrize(
    ("callbacks", "checkpointing", "match"),
    [
        ([], False, r"`callbacks=.*has no ModelCheckpoint.*Fix: add ModelCheckpoint\(dirpath=\.\.\., save_last=True\)"),
        ([ModelCheckpoint()], True, r"`save_last=None` leaves.*Fix: ModelCheckpoint\(\.\.\., save_last=True\)"),
        ([ModelCheckpoint(save_last="link")], True, r"`save_last='link'` makes .* link last.ckpt back"),
        ([StableCheckpoint()], True, r"two callbacks that save and stop.*Fix: remove PreemptionCheckpoint"),
        ([PreemptionCheckpoint()], True, r"two PreemptionCheckpoint callbacks.*Fix: keep one"),
    ],
)
def test_a_trainer_it_cannot_serve_is_refused_at_setup(
    tmp_path: Path, callbacks: list[pl.Callback], checkpointing: bool, match: str
) -> None:
    trainer = quiet_trainer(
        callbacks=[*callbacks, PreemptionCheckpoint()],
        enable_checkpointing=checkpointing,
        default_root_dir=tmp_path,
        max_steps=1,
    )
    with pytest.raises(StabilityConfigError, match=match):
        trainer.fit(TinyModule())


def test_both_units_pickle_and_copy_whole() -> None:
    """A copy saves with its own save and names itself (the handlers and the process group stay behind)."""
    import copy
    import pickle

    from lightning_stability import ExactResume

    for unit in (PreemptionCheckpoint(signals=[signal.SIGUSR1]), ExactResume()):
        for again in (pickle.loads(pickle.dumps(unit)), copy.deepcopy(unit)):
            assert type(again) is type(unit) and again._owner == type(unit).__name__
            if isinstance(again, PreemptionCheckpoint):
                assert again.signals == (signal.SIGUSR1,) and again._save.__self__ is again  # type: ignore[attr-defined]
