"""A resume on another number of processes with the same global batch (world_run.py: 8 samples per global batch,
64 samples, stopped at step 11, the fourth batch of the second epoch): DDP 2 -> 1, 1 -> 2, 2 -> 1 saved again
mid-epoch -> 1, and StableFSDPStrategy 2 -> 4.

Over the resumed epoch every sample is trained on exactly once, and at its end (step 16) the weights and AdamW's
state match the same-size resume within ``BOUND`` (only the sum over each global batch is reduced in another order:
about 3e-8 measured), the LR and the ledger's applied-step count are equal. The controls: Lightning alone (no
``StableCheckpoint``) restarts the epoch, training samples twice and skipping others, and ends about 5e-4 away; a
global batch that changes is said once and the epoch restarts.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers import REPO, torchrun

pytestmark = pytest.mark.distributed  # every test runs training in subprocesses

SCRIPT = Path(__file__).with_name("world_run.py")
N, EPOCH, END = 64, range(8, 16), 16  # the second epoch's steps
BOUND = 1e-5  # absolute, on every parameter and AdamW moment: a sample trained twice or skipped moves them ~5e-4


def single(out: Path, *runs: str) -> None:
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(out), *runs], env=env, cwd=out, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-6000:]


def load(out: Path, run: str, world: int) -> list[dict[str, Any]]:
    return [torch.load(out / f"{run}.{world}.{rank}.pt", weights_only=False) for rank in range(world)]


def epoch_counts(*parts: list[dict[str, Any]]) -> Counter[int]:
    """How often each sample was trained on in the second epoch, over the runs that trained its steps."""
    counts: Counter[int] = Counter()
    for ranks in parts:
        for saved in ranks:
            for step, indices in saved["seen"].items():
                if step in EPOCH:
                    counts.update(indices)
    return counts


def gaps(resumed: dict[str, Any], same_size: dict[str, Any]) -> dict[str, float]:
    """The largest absolute difference of the parameters and of AdamW's state at the epoch's end."""
    assert resumed["global_step"] == same_size["global_step"] == END
    return {
        group: max((resumed[group][k] - same_size[group][k]).abs().max().item() for k in same_size[group])
        for group in ("params", "optimizer")
    }


def assert_exact(counts: Counter[int], resumed: list[dict[str, Any]], same_size: dict[str, Any]) -> None:
    """Every sample of the epoch once; on every rank the weights within BOUND, the same LR and ledger, nothing said."""
    assert sorted(counts) == list(range(N)) and set(counts.values()) == {1}, counts
    for saved in resumed:
        assert all(gap <= BOUND for gap in gaps(saved, same_size).values()), gaps(saved, same_size)
        assert saved["lr"] == same_size["lr"] and saved["applied"] == same_size["applied"] == END
        assert saved["warnings"] == []


def assert_not_exact(counts: Counter[int], resumed: dict[str, Any], same_size: dict[str, Any]) -> None:
    assert any(n > 1 for n in counts.values()) and len(counts) < N, counts
    assert all(gap > 10 * BOUND for gap in gaps(resumed, same_size).values()), gaps(resumed, same_size)


@pytest.fixture(scope="module")
def ddp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three launches for the DDP tests: 2 processes stop and resume; 1 process resumes their checkpoint (and the
    controls), saves mid-epoch at step 13 and resumes that on 1, stops and resumes its own; 2 resume the latter."""
    out = tmp_path_factory.mktemp("world")
    torchrun(SCRIPT, 2, out, "stop", "resume-2")
    single(out, "resume-2", "control-2", "batch-2", "again-2-1", "stop", "resume-1")
    torchrun(SCRIPT, 2, out, "resume-1", "control-1")
    return out


def test_ddp_two_to_one_resumes_exactly(ddp: Path) -> None:
    stop, same_size = load(ddp, "stop", 2), load(ddp, "resume-2", 2)
    assert epoch_counts(stop, same_size) == Counter(range(N))
    one = load(ddp, "resume-2", 1)
    assert_exact(epoch_counts(stop, one), one, same_size[0])
    assert one[0]["draws"] == same_size[0]["draws"]  # rank 0 goes on drawing from its saved states


def test_an_epoch_dealt_on_another_world_size_resumes_exactly_again(ddp: Path) -> None:
    """2 -> 1, saved at step 13 in the epoch the resume dealt, -> 1 again: the checkpoint holds the dealt order."""
    stop, same_size = load(ddp, "stop", 2), load(ddp, "resume-2", 2)
    one = load(ddp, "resume-2", 1)[0]
    hop = {**one, "seen": {step: indices for step, indices in one["seen"].items() if step < 13}}
    again = load(ddp, "again-2-1", 1)
    assert min(again[0]["seen"]) == 13
    assert_exact(epoch_counts(stop, [hop], again), again, same_size[0])


def test_ddp_one_to_two_resumes_exactly(ddp: Path) -> None:
    stop, same_size = load(ddp, "stop", 1), load(ddp, "resume-1", 1)[0]
    resumed = load(ddp, "resume-1", 2)
    assert_exact(epoch_counts(stop, resumed), resumed, same_size)
    # rank 0 goes on drawing from the saved states; rank 1, which the checkpoint has none of, from its own
    assert resumed[0]["draws"] == same_size["draws"]
    assert not set(resumed[1]["draws"].values()) & set(resumed[0]["draws"].values())


def test_lightning_alone_restarts_the_epoch_on_another_world_size(ddp: Path) -> None:
    """The control: without StableCheckpoint the plain loader's epoch starts again: samples twice, others never."""
    control = load(ddp, "control-2", 1)[0]
    assert_not_exact(epoch_counts(load(ddp, "stop", 2), [control]), control, load(ddp, "resume-2", 2)[0])
    control2 = load(ddp, "control-1", 2)
    assert_not_exact(epoch_counts(load(ddp, "stop", 1), control2), control2[0], load(ddp, "resume-1", 1)[0])


def test_a_changed_global_batch_is_said_once_and_restarts_the_epoch(ddp: Path) -> None:
    changed = load(ddp, "batch-2", 1)[0]  # 1 x 4 samples where the checkpoint had 2 x 4
    assert len(changed["warnings"]) == 1, changed["warnings"]
    assert "global batch was 8 samples (2 x 4) and this run's is 4 (1 x 4)" in changed["warnings"][0]
    assert "a batch size of 8 per process keeps it" in changed["warnings"][0]
    assert_not_exact(epoch_counts(load(ddp, "stop", 2), [changed]), changed, load(ddp, "resume-2", 2)[0])


def test_stable_fsdp_two_to_four_resumes_exactly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Sharded checkpoints of 2 processes, resharded over 4 by DCP, each with 2 samples per batch."""
    monkeypatch.setenv("WORLD_STRATEGY", "fsdp")
    torchrun(SCRIPT, 2, tmp_path, "stop", "resume-2")
    torchrun(SCRIPT, 4, tmp_path, "resume-2")
    stop, same_size, resumed = load(tmp_path, "stop", 2), load(tmp_path, "resume-2", 2), load(tmp_path, "resume-2", 4)
    assert_exact(epoch_counts(stop, resumed), resumed, same_size[0])
