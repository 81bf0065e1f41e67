"""A newest checkpoint damaged after its publish: ``ckpt_path="last"`` falls back to the newest one that verifies,
says so, survives a SIGKILL during that resume, and ends bit for bit where an uninterrupted run from the same
checkpoint ends; ``lightning-stability verify DIR`` reports the damage with exit status 1, and 0 once the resumed
run has replaced it.

Real processes (verify_run.py), one per run: a single-file checkpoint (``AtomicCheckpointIO``) and a sharded
``torch.distributed.checkpoint`` directory (``StableFSDPStrategy`` in one process; the refusal of each kind of
damage to a sharded checkpoint, with two ranks' shards too, is in test_checksums.py).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_stability.checkpoint.survey import FAILED, VERIFIED, survey
from tests.helpers import REPO

pytestmark = pytest.mark.distributed  # training in subprocesses

SCRIPT = Path(__file__).with_name("verify_run.py")
ENV = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1")


def launch(directory: Path, layout: str, max_steps: int, ckpt_path: str, kill: str = "none") -> str:
    cmd = [sys.executable, str(SCRIPT), str(directory), layout, str(max_steps), ckpt_path, kill]
    proc = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300, cwd=directory.parent)
    assert proc.returncode == (-9 if kill != "none" else 0), proc.stderr[-6000:]
    return proc.stderr


def verify_command(directory: Path) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "lightning_stability.cli", "verify", str(directory)]
    return subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=120, cwd=REPO)


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("layout", ["plain", "sharded"])
def test_a_damaged_newest_checkpoint_falls_back_and_ends_as_an_uninterrupted_run(tmp_path: Path, layout: str) -> None:
    run, reference = tmp_path / "run", tmp_path / "reference"
    run.mkdir(), reference.mkdir()
    directory = run / "ckpts"
    launch(directory, layout, 6, "none")
    (good,) = directory.glob("*step=4.ckpt")
    (newest,) = directory.glob("*step=6.ckpt")
    copy = reference / good.name  # the fallback's checkpoint as it was written
    (shutil.copytree if good.is_dir() else shutil.copyfile)(good, copy)
    flip_byte(newest / "__0_0.distcp" if newest.is_dir() else newest)  # the disk lies

    if layout == "plain":  # the command itself, once (the same survey in process for the sharded layout)
        listing = verify_command(directory)
        assert listing.returncode == 1, listing.stdout + listing.stderr
        assert f"FAILED    {newest.name}" in listing.stdout and f"The checkpoint {newest} is damaged" in listing.stdout
    else:
        (damaged,) = [f for f in survey(directory) if f.status == FAILED]
        assert damaged.name == newest.name and f"The checkpoint {newest} is damaged" in damaged.detail

    stderr = launch(directory, layout, 8, "last", kill="load")  # killed during the resume itself
    start = json.loads((run / f"{layout}.start.json").read_text())
    assert start == {"global_step": 4, "ckpt_path": str(good)}
    assert f"failed verification: The checkpoint {newest} is damaged" in stderr, stderr[-3000:]

    stderr = launch(directory, layout, 8, "last")  # resumed again: the same fallback, to the end
    assert json.loads((run / f"{layout}.start.json").read_text()) == start
    assert f"The checkpoint {newest} is damaged" in stderr
    launch(reference / "ckpts", layout, 8, str(copy))  # uninterrupted from the same checkpoint
    resumed = torch.load(run / f"{layout}.final.pt")
    uninterrupted = torch.load(reference / f"{layout}.final.pt")
    assert resumed.keys() == uninterrupted.keys()
    for key in resumed:
        assert torch.equal(resumed[key], uninterrupted[key]), key

    rows = {(f.name, f.step, f.listed, f.status) for f in survey(directory)}  # what `verify` lists now
    assert (newest.name, None, False, FAILED) in rows  # the damaged one stays, off the list
    assert {(step, status) for _, step, listed, status in rows if listed} == {(s, VERIFIED) for s in (2, 4, 6, 8)}
