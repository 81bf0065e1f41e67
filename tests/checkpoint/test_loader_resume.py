"""Exact mid-epoch resume with a plain ``DataLoader`` (``StableCheckpoint``): a run interrupted mid-epoch (stopped,
SIGKILLed, SIGTERM/SIGUSR1) and resumed with ``ckpt_path="last"`` trains on exactly the batches of the
uninterrupted run and ends with bit-for-bit equal weights and AdamW state, in one process, under 2-process DDP
(Lightning's injected ``DistributedSampler``) and under 2-process ``StableFSDPStrategy``.

The model has dropout and draws from torch's, NumPy's and Python's generators every step (resume_run.py), so a
resume that does not restore every rank's RNG states fails too. The control: Lightning's own ``ModelCheckpoint``
with the same plain loader restarts the epoch at its first batch and ends elsewhere.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers import REPO, torchrun

pytestmark = pytest.mark.distributed  # every test runs training in subprocesses

SCRIPT = Path(__file__).with_name("resume_run.py")
STEPS = 20


def single(out: Path, loader: str, *runs: str, strategy: str = "single", **env: str) -> int:
    """resume_run.py in one process; returns its exit status (-9: SIGKILLed)."""
    path = f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    full = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1", **env)
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(out), strategy, loader, *runs],
        env=full,
        cwd=out,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if proc.returncode not in (0, -9):
        raise AssertionError(proc.stderr[-6000:])
    return proc.returncode


def load(out: Path, name: str, kind: str, rank: int) -> dict[str, Any]:
    return torch.load(out / f"{name}.{kind}.{rank}.pt", weights_only=False)


def differences(out: Path, name: str, how: str, ranks: int = 1) -> list[str]:
    """What the resumed run (and the interrupted one before it) did differently from the uninterrupted one."""
    found = []
    for rank in range(ranks):
        ref = load(out, name, "reference", rank)
        resumed = load(out, name, f"resume-{how}", rank)
        seen = dict(resumed["seen"])
        if how not in ("kill", "restart"):  # a SIGKILLed run writes nothing; its steps are the reference's
            seen = {**load(out, name, how, rank)["seen"], **seen}
        assert resumed["global_step"] == STEPS
        first = min(resumed["seen"])
        assert 0 < first < STEPS, f"rank {rank} resumed at step {first}: not a resume"
        since = first if how in ("kill", "restart") else 0
        wrong = [step for step in range(since, STEPS) if seen.get(step) != ref["seen"][step]]
        if wrong:
            found.append(f"rank {rank} trained on other samples at steps {wrong}")
        for group in ("params", "optimizer"):
            assert ref[group].keys() == resumed[group].keys()
            found += [
                f"rank {rank} {group} {k}" for k in ref[group] if not torch.equal(ref[group][k], resumed[group][k])
            ]
    return found


def warnings_of(out: Path, name: str, kind: str) -> list[str]:
    return load(out, name, kind, 0)["warnings"]


def test_lightning_alone_restarts_the_epoch_of_a_plain_loader(tmp_path: Path) -> None:
    """The bug: with Lightning's ModelCheckpoint the resumed epoch starts again at its first batch."""
    single(tmp_path, "shuffle", "reference", "stop", "resume-stop", RESUME_CALLBACK="lightning")
    found = differences(tmp_path, "single-shuffle", "stop")
    assert any("other samples" in f for f in found), found
    assert any("params" in f for f in found), found


@pytest.mark.parametrize("loader", ["shuffle", "shuffle_generator", "sequential", "batch_sampler", "workers"])
def test_stopped_mid_epoch_resumes_exactly(tmp_path: Path, loader: str) -> None:
    single(tmp_path, loader, "reference", "stop", "resume-stop")
    assert differences(tmp_path, f"single-{loader}", "stop") == []
    said = warnings_of(tmp_path, f"single-{loader}", "reference")
    if loader == "workers":  # the batches are exact; draws inside the workers would not be: said once
        assert len(said) == 1 and "num_workers=2" in said[0] and "not replayed" in said[0], said
    else:
        assert said == []


@pytest.mark.parametrize("stop_at", ["1", "7", "8", "16"])
def test_resume_at_and_near_epoch_ends(tmp_path: Path, stop_at: str) -> None:
    """8 batches per epoch: after the first batch, before and at an epoch's last one, at the start of the third."""
    single(tmp_path, "shuffle", "reference", "stop", "resume-stop", RESUME_STOP_AT=stop_at)
    assert differences(tmp_path, "single-shuffle", "stop") == []


def test_a_loader_built_anew_each_epoch_resumes_exactly(tmp_path: Path) -> None:
    """reload_dataloaders_every_n_epochs=1: the third epoch's new loader, stopped in its last batch."""
    single(tmp_path, "shuffle", "reference", "stop", "resume-stop", RESUME_RELOAD="1", RESUME_STOP_AT="19")
    assert differences(tmp_path, "single-shuffle", "stop") == []


def test_gradient_accumulation_resumes_exactly(tmp_path: Path) -> None:
    """Two batches per step: the checkpoint of step 11 is 22 batches in (the third epoch's sixth)."""
    single(tmp_path, "shuffle", "reference", "stop", "resume-stop", RESUME_ACCUMULATE="2")
    assert differences(tmp_path, "single-shuffle", "stop") == []


def test_a_preset_trainer_resumes_exactly(tmp_path: Path) -> None:
    """StableTrainer.from_preset attaches StableCheckpoint itself (every 2 steps here, and at the stop)."""
    single(tmp_path, "shuffle", "reference", "stop", "resume-stop", strategy="preset")
    assert differences(tmp_path, "preset-shuffle", "stop") == []


def test_sigkilled_mid_epoch_resumes_exactly(tmp_path: Path) -> None:
    single(tmp_path, "shuffle", "reference")
    assert single(tmp_path, "shuffle", "kill") == -9
    single(tmp_path, "shuffle", "resume-kill")
    assert differences(tmp_path, "single-shuffle", "kill") == []


@pytest.mark.parametrize("how", ["sigterm", "sigusr1"])
def test_preemption_signal_mid_epoch_resumes_exactly(tmp_path: Path, how: str) -> None:
    single(tmp_path, "shuffle_generator", "reference", how, f"resume-{how}")
    assert differences(tmp_path, "single-shuffle_generator", how) == []


def test_random_draws_in_loader_workers_are_said_once_and_not_replayed(tmp_path: Path) -> None:
    """num_workers > 0 with a random draw in Dataset.__getitem__: the batches are exact, the draws are not (each
    worker's generator lives in its process and has not drawn for the skipped samples); said once at fit start."""
    single(tmp_path, "workers_augment", "reference", "stop", "resume-stop")
    said = warnings_of(tmp_path, "single-workers_augment", "resume-stop")
    assert len(said) == 1 and "num_workers=2" in said[0] and "not replayed" in said[0], said
    found = differences(tmp_path, "single-workers_augment", "stop")
    assert found and not any("other samples" in f for f in found), found


def test_a_resume_with_another_batch_size_is_said_and_restarts_the_epoch(tmp_path: Path) -> None:
    single(tmp_path, "shuffle", "stop")
    single(tmp_path, "shuffle", "resume-stop", RESUME_BATCH="4")
    said = warnings_of(tmp_path, "single-shuffle", "resume-stop")
    assert len(said) == 1 and "has [16] batches per epoch, the checkpoint's had [8]" in said[0], said
    assert min(load(tmp_path, "single-shuffle", "resume-stop", 0)["seen"]) == 11


def test_iterable_dataset_is_said_once_and_restarts_its_epoch(tmp_path: Path) -> None:
    """No index sampler to fast-forward: warned once at fit start with the fix; Lightning's behaviour stays."""
    single(tmp_path, "iterable", "reference", "stop", "resume-stop")
    for kind in ("reference", "resume-stop"):
        said = warnings_of(tmp_path, "single-iterable", kind)
        assert len(said) == 1 and "cannot be fast-forwarded" in said[0] and "StatefulDataLoader" in said[0], said
    found = differences(tmp_path, "single-iterable", "stop")
    assert any("other samples" in f for f in found), found


def test_ddp_resumes_exactly(tmp_path: Path) -> None:
    """Lightning injects a shuffling DistributedSampler into the plain loader; rank 1 alone gets the SIGTERM."""
    torchrun(SCRIPT, 2, tmp_path, "ddp", "shuffle", "reference", "stop", "resume-stop", "sigterm", "resume-sigterm")
    assert differences(tmp_path, "ddp-shuffle", "stop", ranks=2) == []
    assert differences(tmp_path, "ddp-shuffle", "sigterm", ranks=2) == []


def test_stable_fsdp_resumes_exactly(tmp_path: Path) -> None:
    torchrun(SCRIPT, 2, tmp_path, "fsdp", "shuffle", "reference", "stop", "resume-stop", "sigusr1", "resume-sigusr1")
    assert differences(tmp_path, "fsdp-shuffle", "stop", ranks=2) == []
    assert differences(tmp_path, "fsdp-shuffle", "sigusr1", ranks=2) == []
