"""The meeting point of health and checkpoints: StableCheckpoint is a CheckpointRing, and the checkpoint package
loads without the health monitor (neither imports the other's callback)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_stability import StableCheckpoint
from lightning_stability.ledger import CheckpointRing

REPO = Path(__file__).resolve().parents[2]


def test_stable_checkpoint_is_the_ring_a_rollback_finds(tmp_path: Path) -> None:
    assert isinstance(StableCheckpoint(dirpath=tmp_path), CheckpointRing)
    assert not isinstance(ModelCheckpoint(dirpath=tmp_path), CheckpointRing)


def test_checkpoints_load_without_the_health_monitor_and_health_without_grad_norm() -> None:
    code = (
        "import sys\n"
        "import lightning_stability.checkpoint.callback\n"
        "print('lightning_stability.health.callback' in sys.modules)\n"
        "import lightning_stability.health.callback\n"
        "print('lightning_stability.grad_norm' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "False"]
