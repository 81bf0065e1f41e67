"""Restarts by the engine users already run: ``torchrun --max-restarts=1`` restarts the whole group after rank 1 is
SIGKILLed mid-epoch, and the training script's ``trainer.fit(model, ckpt_path="last")`` (the same line for the first
attempt, where nothing is saved yet, and for the restart) is all it takes to end bit-for-bit where an uninterrupted
run ends (resume_run.py, kind ``resume-restart``, with ``StableCheckpoint``). The restart needs torchrun launched
with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (without it, torch 2.13's restarted gloo group fails to connect), which
the first attempt says at setup when it is missing."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_stability import ExactResume, read_incidents
from lightning_stability.incidents import restarts
from tests.checkpoint.test_loader_resume import SCRIPT, differences, load
from tests.helpers import TinyModule, quiet_trainer, torchrun

ELASTIC = {"TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "3", "TORCHELASTIC_USE_AGENT_STORE": "True"}


@pytest.mark.distributed
def test_torchrun_restarts_the_group_and_fit_last_resumes_exactly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")  # for torchrun itself
    # One launch: the first attempt is killed in resume-restart; the restarted group resumes it, then trains the
    # uninterrupted reference (a fresh fit, ckpt_path=None) in the same processes
    torchrun(SCRIPT, 2, tmp_path, "ddp", "shuffle", "resume-restart", "reference", flags=["--max-restarts=1"])
    for rank in range(2):
        resumed = load(tmp_path, "ddp-shuffle", "resume-restart", rank)
        assert resumed["restart_count"] == 1  # written by the restarted group, not the first attempt
        assert min(resumed["seen"]) == 12, rank  # the kill came as step 12 started; step 11's checkpoint resumed
    assert differences(tmp_path, "ddp-shuffle", "restart", ranks=2) == []
    (restart,) = read_incidents(tmp_path / "ddp-shuffle-restart")  # the death, named by the restarted group
    assert restart.kind == "restart" and restart.step == 12 and restart.attempt == "restart 1 of 1 by torchrun"
    assert "ended without finishing" in restart.detail


def test_the_attempt_and_the_shared_store_are_read_from_the_environment() -> None:
    assert restarts.attempt({}) is None
    first = restarts.attempt(ELASTIC)
    assert first == restarts.Attempt("torchrun", 0, 3) and first.describe() == "first run under torchrun"
    again = restarts.attempt({**ELASTIC, "TORCHELASTIC_RESTART_COUNT": "2", "SLURM_JOB_ID": "7"})
    assert again is not None and again.is_restart and again.describe() == "restart 2 of 3 by torchrun"
    slurm = restarts.attempt({"SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "1"})
    assert slurm == restarts.Attempt("slurm", 1, None) and slurm.describe() == "restart 1 by slurm"
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in (restarts.shared_store_problem(ELASTIC) or "")
    assert restarts.shared_store_problem({**ELASTIC, "TORCHELASTIC_USE_AGENT_STORE": "False"}) is None
    assert restarts.shared_store_problem({**ELASTIC, "TORCHELASTIC_MAX_RESTARTS": "0"}) is None


def test_a_restartable_torchrun_job_sharing_the_agents_store_is_told_at_setup(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in ELASTIC.items():
        monkeypatch.setenv(name, value)
    trainer = quiet_trainer(max_steps=1, default_root_dir=tmp_path, callbacks=[ExactResume()])
    with pytest.warns(UserWarning, match=r"ExactResume: torchrun may restart this job 3 time\(s\).*Fix: launch with "
                      r"TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"):  # fmt: skip
        trainer.fit(TinyModule())
