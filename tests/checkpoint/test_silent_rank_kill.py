"""A real SIGKILL of the rank that writes no files, in the middle of a save (issue 41).

``silent_rank_run.py`` trains two processes with ``StableCheckpoint(every_n_train_steps=1)``. Under DDP with
``AtomicCheckpointIO`` rank 0 writes every checkpoint and rank 1 none: rank 1 is SIGKILLed (``os.kill``) while rank
0 is inside the write of step 11's file (its hidden sibling open, ``torch.save`` running). Under
``StableFSDPStrategy`` every rank writes its own shards, so no rank writes nothing; the file only rank 0 writes is
``meta.pt``, and rank 1 is killed while rank 0 writes it.

Then: the job ends by itself (torchrun's agent sees rank 1 die and stops rank 0: SIGTERM, SIGKILL after its grace
period), well within the bound; every checkpoint the healthy list names verifies, and none is the half-written
one; a fresh two-process run with ``ckpt_path="last"`` resumes from the newest complete checkpoint and ends bit for
bit where the uninterrupted run ends (weights, AdamW's state, the data of every step after the resume).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_stability.checkpoint import CheckpointError, atomic, recover, verify_checkpoint
from lightning_stability.checkpoint.ring import FILE_NAME, Entry
from tests.checkpoint.resume_run import STEPS
from tests.checkpoint.silent_rank_run import KILL_AT, alive
from tests.helpers import REPO, kill_process_tree, torchrun

pytestmark = pytest.mark.distributed

SCRIPT = Path(__file__).with_name("silent_rank_run.py")
ENDS_WITHIN = 150  # seconds: the run to the kill, then torchrun's stop (its grace period is 30 s)


def run_killed(out: Path, strategy: str) -> tuple[int, float]:
    """The ``kill`` run under torchrun; its exit status and how long it took to end. A hang fails the test."""
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    with open(out / "kill.log", "wb") as log:
        start = time.monotonic()
        proc = subprocess.Popen(
            [*cmd, str(SCRIPT), str(out), strategy, "kill"],
            env=env,
            cwd=out,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            code = proc.wait(timeout=ENDS_WITHIN)
        except subprocess.TimeoutExpired:
            kill_process_tree(proc.pid)
            proc.wait()
            pytest.fail(f"the job hung after rank 1 was killed:\n{(out / 'kill.log').read_text()[-6000:]}")
    return code, time.monotonic() - start


def listed(directory: Path) -> list[Entry]:
    entries = json.loads((directory / FILE_NAME).read_text())["checkpoints"]
    return [Entry(e["name"], e["step"], e["kind"]) for e in entries]


def result(out: Path, strategy: str, kind: str, rank: int) -> dict[str, Any]:
    return torch.load(out / f"{strategy}.{kind}.{rank}.pt", weights_only=False)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_killing_the_rank_that_writes_nothing_mid_save_ends_the_job_and_resumes_exactly(
    tmp_path: Path, strategy: str
) -> None:
    code, took = run_killed(tmp_path, strategy)
    log = (tmp_path / "kill.log").read_text()
    assert (tmp_path / "writing").exists(), f"rank 0 never reached the write of step {KILL_AT}:\n{log[-6000:]}"
    assert (tmp_path / "wrote").read_text() == "rank 1 alive: False"  # rank 1 died while rank 0 was writing
    assert code != 0, log[-3000:]  # torchrun reports the failed worker
    assert not alive(int((tmp_path / "pid.0").read_text())), "rank 0 outlived the job"
    print(f"{strategy}: the job ended {took:.1f} s after its start, exit status {code}")
    print("\n".join(line for line in log.splitlines() if "rank0" in line and "Error" in line)[-2000:])

    directory = tmp_path / f"{strategy}-kill"
    entries = listed(directory)
    hidden = [p.name for p in directory.iterdir() if atomic.is_sibling(p.name)]
    print(f"{strategy}: listed steps {[e.step for e in entries]}, hidden siblings left {hidden}")
    assert entries and not any(atomic.is_sibling(e.name) for e in entries)
    for entry in entries:  # every listed checkpoint is complete, as written, and the one its entry names
        recover.check_listed(verify_checkpoint(directory / entry.name), entry)
    complete = []  # every checkpoint published in the directory that verifies, listed or not (a crash may keep
    for path in directory.glob("*step=*.ckpt"):  # a published one off the list: ckpt_path="last" takes it back)
        with contextlib.suppress(CheckpointError):
            verify_checkpoint(path)
            complete.append(int(re.findall(r"step=(\d+)", path.name)[-1]))
    print(f"{strategy}: complete checkpoints of steps {sorted(complete)}")
    assert max(complete) in (KILL_AT - 1, KILL_AT)

    torchrun(SCRIPT, 2, tmp_path, strategy, "reference", "resume")
    for rank in range(2):
        ref, resumed = result(tmp_path, strategy, "reference", rank), result(tmp_path, strategy, "resume", rank)
        assert resumed["global_step"] == STEPS
        first = min(resumed["seen"])
        assert first == max(complete), f"rank {rank} resumed at step {first}"
        assert all(resumed["seen"][s] == ref["seen"][s] for s in range(first, STEPS))
        for group in ("params", "optimizer"):
            theirs, ours = ref[group], resumed[group]
            assert theirs.keys() == ours.keys()
            assert all(torch.equal(theirs[k], ours[k]) for k in theirs), f"rank {rank} {group}"
