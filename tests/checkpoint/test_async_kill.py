"""A real SIGKILL in the middle of an asynchronous save: the previous checkpoint stays the newest, the resume is
exact. One process (``AtomicCheckpointIO``), two-process DDP, and two-process ``StableFSDPStrategy`` (sharded:
``torch.distributed.checkpoint.async_save``; full: one file), with ``StableCheckpoint(async_save=True)``.

``async_kill_run.py`` saves every 2 steps; the background write of the step-4 save is held open after its hidden
sibling is written (a test-only subclass; the test's only control over timing), and every process is then killed
with SIGKILL. After the kill: no checkpoint of step 4 is published or listed, the newest listed is step 2's and
verifies, and ``ckpt_path="last"`` resolves to it. The restart (no hold) resumes at step 2 and trains to step 8;
its weights and AdamW state equal an uninterrupted run's bit for bit on every rank.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from lightning_stability.checkpoint import atomic, verify_checkpoint
from lightning_stability.checkpoint.ring import HealthyCheckpoints
from tests.helpers import REPO

pytestmark = pytest.mark.distributed

SCRIPT = Path(__file__).with_name("async_kill_run.py")
HOLD, STEPS, EVERY = 4, 8, 2


def launch(
    out: Path, layout: str, nproc: int, runs: Sequence[str], hold: bool, fail: bool = False
) -> subprocess.Popen[bytes]:
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1")
    env.pop("LS_TEST_HOLD_WRITE_AT", None)
    env.pop("LS_TEST_FAIL_WRITE_AT", None)
    if hold:
        env["LS_TEST_HOLD_WRITE_AT"] = str(HOLD)
    if fail:
        env["LS_TEST_FAIL_WRITE_AT"] = str(HOLD)
    cmd = [sys.executable, str(SCRIPT), str(out), layout, str(STEPS), *runs]
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *cmd[1:]]
    log = open(out / "log.txt", "ab")  # noqa: SIM115 (the child writes it)
    return subprocess.Popen(cmd, env=env, cwd=out, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def kill_all(proc: subprocess.Popen[bytes], out: Path, nproc: int) -> None:
    """SIGKILL every rank (rank 0, the writer, first), then the launcher."""
    for rank in range(nproc):
        with contextlib.suppress(ProcessLookupError, FileNotFoundError):
            os.kill(int((out / f"pid.{rank}").read_text()), signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def finish(proc: subprocess.Popen[bytes], out: Path, nproc: int, what: str) -> None:
    try:
        code = proc.wait(timeout=300)
    except subprocess.TimeoutExpired:
        kill_all(proc, out, nproc)
        code = None
    assert code == 0, f"{what} failed ({code}):\n{(out / 'log.txt').read_text()[-6000:]}"


@pytest.mark.parametrize(("layout", "nproc"), [("plain", 1), ("ddp", 2), ("sharded", 2), ("full", 2)])
def test_kill_during_background_write(tmp_path: Path, layout: str, nproc: int) -> None:
    proc = launch(tmp_path, layout, nproc, ["soak"], hold=True)
    deadline = time.monotonic() + 240
    writers = range(nproc) if layout == "sharded" else [0]  # every rank writes shards; else rank 0 the file
    while not all((tmp_path / f"held.{rank}").exists() for rank in writers):
        if proc.poll() is not None or time.monotonic() > deadline:
            kill_all(proc, tmp_path, nproc)
            pytest.fail(f"the run never held its write:\n{(tmp_path / 'log.txt').read_text()[-6000:]}")
        time.sleep(0.02)
    kill_all(proc, tmp_path, nproc)

    directory = tmp_path / layout
    entries = HealthyCheckpoints(directory).load().newest_first()
    assert [e.step for e in entries] == [2]  # step 4's save was written but never published, so never listed
    verify_checkpoint(directory / entries[0].name)
    assert not list(directory.glob(f"*step={HOLD}.ckpt"))
    assert any(atomic.is_sibling(p.name) for p in directory.iterdir())  # the hidden sibling the kill left

    for rank in range(nproc):
        (tmp_path / f"pid.{rank}").unlink(missing_ok=True)
    # the restart, then the uninterrupted reference (no checkpoints) in the same launch
    finish(launch(tmp_path, layout, nproc, ["soak", "reference"], hold=False), tmp_path, nproc, "the restart")
    start = json.loads((tmp_path / f"{layout}.start.json").read_text())
    assert start["global_step"] == 2
    assert Path(start["ckpt_path"]).name == entries[0].name
    assert not any(atomic.is_sibling(p.name) for p in directory.iterdir())  # cleaned at the restart's first save
    for rank in range(nproc):
        resumed = torch.load(tmp_path / f"{layout}.soak.{rank}.pt", weights_only=False)
        reference = torch.load(tmp_path / f"{layout}.reference.{rank}.pt", weights_only=False)
        assert resumed["global_step"] == reference["global_step"] == STEPS
        for group in ("params", "optimizer"):
            assert resumed[group].keys() == reference[group].keys()
            for name, value in reference[group].items():
                assert torch.equal(resumed[group][name], value), f"rank {rank} {group} {name}"


@pytest.mark.parametrize("layout", ["ddp", "sharded"])
def test_a_failed_background_write_raises_on_every_rank(tmp_path: Path, layout: str) -> None:
    """Rank 0's background write of the step-4 save fails: every rank raises the same CheckpointError naming the
    path, at the same step, and nothing of step 4 is published or listed."""
    finish(launch(tmp_path, layout, 2, ["soak"], hold=False, fail=True), tmp_path, 2, "the failing run")
    errors = [json.loads((tmp_path / f"error.{rank}.json").read_text()) for rank in range(2)]
    for error in errors:
        assert f"step={HOLD}.ckpt" in error["message"] and "failed on rank(s) [0]" in error["message"], error
    assert errors[0]["global_step"] == errors[1]["global_step"] <= HOLD + EVERY
    assert "No space left on device (test)" in errors[0]["message"]  # the cause, on the rank that had it
    directory = tmp_path / layout
    assert [e.step for e in HealthyCheckpoints(directory).load().entries] == [2]
    assert not list(directory.glob(f"*step={HOLD}.ckpt"))
