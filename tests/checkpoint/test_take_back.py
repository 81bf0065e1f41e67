"""A checkpoint published just before a kill, and so missing from the healthy list, is resumed from: the run that
published it is the one restarting. Another run's newer checkpoint in the same directory never is.

Each run is a real process killed with SIGKILL between the publish of a checkpoint and the rewrite of
``stable_checkpoints.json`` (takeback_run.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from lightning_stability.checkpoint import AtomicCheckpointIO, recover
from lightning_stability.checkpoint.ring import HealthyCheckpoints
from tests.helpers import REPO

pytestmark = pytest.mark.distributed  # training in subprocesses

SCRIPT = Path(__file__).with_name("takeback_run.py")


def launch(
    directory: Path, max_steps: int, ckpt_path: str = "last", kill_at: int = 0
) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1")
    cmd = [sys.executable, str(SCRIPT), str(directory), str(max_steps), ckpt_path, str(kill_at)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=directory.parent)
    assert proc.returncode == (-9 if kill_at else 0), proc.stderr[-6000:]
    return proc


def started_at(directory: Path) -> int:
    return int(json.loads((directory.parent / "start.json").read_text())["global_step"])


def listed_steps(directory: Path) -> list[int]:
    return sorted(e.step for e in HealthyCheckpoints(directory).load().entries)


def test_a_checkpoint_published_before_a_kill_is_taken_back(tmp_path: Path) -> None:
    directory = tmp_path / "ckpts"
    launch(directory, 10, "none", kill_at=6)
    assert (directory / "epoch=0-step=6.ckpt").is_file() and listed_steps(directory) == [1, 2, 3, 4, 5]
    proc = launch(directory, 10)
    assert started_at(directory) == 6
    assert "epoch=0-step=6.ckpt" in proc.stderr and "back on the list" in proc.stderr
    assert listed_steps(directory) == list(range(1, 11))


def test_another_runs_newer_checkpoints_are_never_taken_back(tmp_path: Path) -> None:
    directory = tmp_path / "ckpts"
    launch(directory, 8, "none")  # run A: steps 1..8, listed
    launch(directory, 8, "none", kill_at=4)  # run B, fresh in the same directory: A's are off its list; killed at 4
    assert listed_steps(directory) == [1, 2, 3]
    for step in (5, 6, 7, 8):  # A's, newer than anything listed; touched as a copy or a second writer would
        os.utime(directory / f"epoch=0-step={step}.ckpt")
    launch(directory, 8)
    assert started_at(directory) == 4  # B's, taken back; not A's step 8


# ---------------------------------------------------------------------- which unlisted checkpoints qualify
def _listed(directory: Path, run: str, steps: list[int]) -> HealthyCheckpoints:
    listed = HealthyCheckpoints(directory)
    for step in steps:
        listed.add(f"step={step}.ckpt", step, "ring", write=False)
    listed.claim(run, write=True)
    return listed


def _file(directory: Path, name: str, run: str, step: int, stored_name: str | None = None) -> None:
    torch.save({recover.RUN_KEY: recover.record(run, stored_name or name, step, "ring")}, directory / name)


def test_only_whole_newer_checkpoints_of_the_listing_run_under_their_own_name_qualify(tmp_path: Path) -> None:
    listed = _listed(tmp_path, "fitA", [1, 2])
    _file(tmp_path, "step=3.ckpt", "fitA", 3)  # qualifies
    _file(tmp_path, "step=9.ckpt", "fitB", 9)  # another fit's
    _file(tmp_path, "step=1b.ckpt", "fitA", 1)  # not newer than the list
    _file(tmp_path, "copy.ckpt", "fitA", 4, stored_name="step=4.ckpt")  # a copy under another name
    _file(tmp_path, "cut.ckpt", "fitA", 5)
    (tmp_path / "cut.ckpt").write_bytes((tmp_path / "cut.ckpt").read_bytes()[:-30])  # truncated
    sharded = tmp_path / "step=6.ckpt"  # a DCP directory: its record is in meta.pt
    dcp.save({"state_dict": {"w": torch.ones(10)}}, checkpoint_id=sharded)
    torch.save({recover.RUN_KEY: recover.record("fitA", "step=6.ckpt", 6, "last")}, sharded / "meta.pt")
    found, refused = recover.unlisted_newer(listed)
    assert [(e.name, e.step, e.kind) for e in found] == [("step=3.ckpt", 3, "ring"), ("step=6.ckpt", 6, "last")]
    assert len(refused) == 1 and "cut.ckpt is incomplete" in refused[0]  # truncated: its record cannot be read
    listed.run = None  # a list no fit claimed: nothing is taken back
    assert recover.unlisted_newer(listed) == ([], [])


def test_a_newer_checkpoint_whose_bytes_changed_is_never_taken_back(tmp_path: Path) -> None:
    """Whole (its zip parses, its record reads) but damaged: a byte of its weights flipped after the publish."""
    listed = _listed(tmp_path, "fitA", [1, 2])
    for step in (3, 4):
        AtomicCheckpointIO().save_checkpoint(
            {"w": torch.randn(4096), recover.RUN_KEY: recover.record("fitA", f"step={step}.ckpt", step, "ring")},
            tmp_path / f"step={step}.ckpt",
        )
    path = tmp_path / "step=4.ckpt"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10  # inside the weights
    path.write_bytes(bytes(data))
    assert recover._read_record(path) is not None  # readable: only its checksum tells
    found, refused = recover.unlisted_newer(listed)
    assert [(e.name, e.step) for e in found] == [("step=3.ckpt", 3)]
    assert len(refused) == 1 and f"The checkpoint {path} is damaged" in refused[0]  # named, not skipped in silence
