"""Real SIGKILLs in the middle of checkpoint saves: the previous checkpoint always loads, no partial one is read.

``kill_run.py`` trains and saves ``last.ckpt`` plus the top-1 checkpoint at every step, through
``AtomicCheckpointIO`` (one process) or ``StableFSDPStrategy`` (two processes, sharded and full layouts), and
resumes with ``ckpt_path="last"``. Each round kills one process (for FSDP: a random rank) at a random moment
once two steps were saved; the checkpoints on disk must then verify, hold weights of one step (their sum equals
the ``param_sum`` recorded with them: a sharded checkpoint mixing two steps fails this), and be what the next
run resumes from. Saves take most of each step here (~6 MB per checkpoint, two per step), so most kills land
inside one; the rounds that left a never-published sibling behind are counted in the final message.

The last FSDP launch also resumes from copies with a shard, ``.metadata`` or the file's end missing: every rank
raises the same ``CheckpointError`` naming the path (not DCP's ``CheckpointException ranks:dict_keys([0])``).

Against the code before atomic saves, the FSDP rounds fail: a rank killed while rewriting ``last.ckpt`` in
place leaves shard files of two steps or no ``.metadata``.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_stability.checkpoint import atomic, verify_checkpoint
from lightning_stability.strategies import consolidate_checkpoint
from tests.helpers import REPO, kill_process_tree

pytestmark = pytest.mark.distributed

SCRIPT = Path(__file__).with_name("kill_run.py")
FOREVER = 100_000


def launch(out: Path, runs: list[str], nproc: int) -> subprocess.Popen[bytes]:
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1")
    cmd = [sys.executable, str(SCRIPT), str(out), *runs]
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *cmd[1:]]
    log = open(out / "log.txt", "ab")  # noqa: SIM115 (the child writes it; closed with the test's tmp dir)
    return subprocess.Popen(cmd, env=env, cwd=out, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def end(proc: subprocess.Popen[bytes], timeout: float) -> None:
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=timeout)
    kill_process_tree(proc.pid)  # whatever the launcher left (a rank stuck in a collective, in its own session)
    proc.wait()


def saved_steps(out: Path, layout: str) -> list[int]:
    progress = out / f"{layout}.progress"
    return [int(line) for line in progress.read_text().split()] if progress.exists() else []


def kill_round(out: Path, layout: str, nproc: int, rng: random.Random) -> tuple[dict[str, Any], bool]:
    """Start a run resuming from "last", kill one of its processes at a random moment after two saves."""
    for stale in [out / f"{layout}.progress", out / f"{layout}.start.json", *out.glob("pid.*")]:
        stale.unlink(missing_ok=True)
    proc = launch(out, [f"{layout}:{FOREVER}"], nproc)
    deadline = time.monotonic() + 180
    while len(saved_steps(out, layout)) < 2:
        if proc.poll() is not None or time.monotonic() > deadline:
            end(proc, 0)
            pytest.fail(f"the {layout} run ended before two saves:\n{(out / 'log.txt').read_text()[-6000:]}")
        time.sleep(0.02)
    time.sleep(rng.uniform(0.0, 0.5))
    victim = rng.randrange(nproc)
    os.kill(int((out / f"pid.{victim}").read_text()), signal.SIGKILL)
    mid_save = any(p.name.startswith(atomic.PARTIAL_PREFIX) for p in (out / layout).iterdir())
    end(proc, timeout=30)
    return json.loads((out / f"{layout}.start.json").read_text()), mid_save


def check_last(out: Path, layout: str, tmp: Path) -> int:
    """``last.ckpt`` is complete and holds one step's weights; returns that step."""
    last = out / layout / "last.ckpt"
    found = verify_checkpoint(last)
    assert found == last  # published, not recovered from a moved-away one
    if found.is_dir():
        merged = consolidate_checkpoint(found, tmp / "merged.ckpt")
        checkpoint = torch.load(merged, weights_only=False)
    else:
        checkpoint = torch.load(found, weights_only=False)
    total = sum(float(v.double().sum()) for v in checkpoint["state_dict"].values())
    assert total == pytest.approx(checkpoint["param_sum"], rel=1e-9, abs=1e-9), f"{last} mixes two steps"
    return int(checkpoint["global_step"])


def break_copies(out: Path, tmp: Path) -> dict[str, str]:
    """Copies of the last checkpoints with a shard, the DCP metadata or the file's end missing: path -> what."""
    sharded, full = out / "sharded" / "last.ckpt", out / "full" / "last.ckpt"
    no_shard, no_metadata = tmp / "no_shard.ckpt", tmp / "no_metadata.ckpt"
    shutil.copytree(sharded, no_shard)
    (no_shard / "__1_0.distcp").unlink()
    shutil.copytree(sharded, no_metadata)
    (no_metadata / ".metadata").unlink()
    truncated = tmp / "truncated.ckpt"
    truncated.write_bytes(full.read_bytes()[: full.stat().st_size // 2])
    return {
        str(no_shard): "1 of the 2 shard files in .metadata are missing: __1_0.distcp",
        str(no_metadata): ".metadata is missing",
        str(truncated): "the file is truncated",
    }


def kill_and_resume(out: Path, layouts: list[str], nproc: int, tmp: Path) -> None:
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    last_step = dict.fromkeys(layouts, 0)
    mid_saves = 0
    for layout in layouts:
        start, mid_save = kill_round(out, layout, nproc, rng)
        mid_saves += mid_save
        context = f"(seed {seed}, {layout}, log: {out / 'log.txt'})"
        # the run resumed from the last checkpoint of the previous round, found by Lightning as "last"
        assert start["global_step"] == last_step[layout], context
        if last_step[layout]:
            assert start["ckpt_path"] == str(out / layout / "last.ckpt"), context
        last_step[layout] = check_last(out, layout, tmp)
        assert last_step[layout] >= start["global_step"] + 2, context
    # one more run per layout, not killed: resumes, trains two steps, saves, and leaves no hidden sibling
    runs = [f"{layout}:{last_step[layout] + 2}" for layout in dict.fromkeys(layouts)]
    broken = break_copies(out, tmp) if nproc > 1 else {}
    proc = launch(out, runs + [f"broken:{path}" for path in broken], nproc)
    end(proc, timeout=240)
    assert proc.returncode == 0, (out / "log.txt").read_text()[-6000:]
    for rank in range(nproc if broken else 0):
        errors = json.loads((out / f"broken.{rank}.json").read_text())
        for path, what in broken.items():
            assert errors[path] is not None, f"rank {rank} loaded the broken {path}"
            assert errors[path].startswith(f"The checkpoint {path} is incomplete: {what}"), errors[path]
            assert "found on rank(s) [0, 1]" in errors[path]
    for layout in dict.fromkeys(layouts):
        start = json.loads((out / f"{layout}.start.json").read_text())
        assert start["global_step"] == last_step[layout] and start["ckpt_path"] == str(out / layout / "last.ckpt")
        assert check_last(out, layout, tmp) == last_step[layout] + 2
        names = {p.name for p in (out / layout).iterdir()}
        # (a top-1 file of a killed run can remain: ModelCheckpoint's restored state does not know it)
        assert {f"epoch=0-step={last_step[layout] + 2}.ckpt", "last.ckpt"} <= names, names
        assert not any(atomic.is_sibling(name) for name in names), names
    print(f"seed {seed}: {len(layouts)} kills, {mid_saves} of them left a never-published sibling (mid-save)")


def test_killed_plain_run_always_resumes_from_a_whole_checkpoint(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    kill_and_resume(out, ["plain"] * 3, nproc=1, tmp=tmp_path)


def test_killed_fsdp_rank_leaves_a_whole_checkpoint_in_both_layouts(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    kill_and_resume(out, ["sharded", "full", "sharded"], nproc=2, tmp=tmp_path)
