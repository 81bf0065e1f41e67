"""A run for tests/checkpoint/test_take_back.py: ``takeback_run.py DIR MAX_STEPS CKPT_PATH KILL_AT``.

Trains ``TinyModule`` with ``StableCheckpoint(every_n_train_steps=1, keep=20)`` into ``DIR`` and
``trainer.fit(ckpt_path=CKPT_PATH)`` (``none``: a fresh fit). With ``KILL_AT`` > 0 the process SIGKILLs itself when
the checkpoint of that step is published and the healthy list is about to be rewritten. Writes
``DIR/../start.json``: the global step the fit started at.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl

from lightning_stability import AtomicCheckpointIO, StableCheckpoint
from lightning_stability.checkpoint.ring import HealthyCheckpoints
from tests.helpers import TinyModule, quiet_trainer


class Start(pl.Callback):
    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self.out.write_text(json.dumps({"global_step": trainer.global_step}))


def main() -> None:
    directory, max_steps, ckpt_path, kill_at = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    real_add = HealthyCheckpoints.add

    def add(self: HealthyCheckpoints, name: str, step: int, kind: str, write: bool) -> None:
        if step == kill_at:  # published (the strategy wrote and renamed it), not yet listed
            os.kill(os.getpid(), signal.SIGKILL)
        real_add(self, name, step, kind, write)

    HealthyCheckpoints.add = add  # type: ignore[method-assign]
    pl.seed_everything(0)
    trainer = quiet_trainer(
        max_steps=max_steps,
        enable_checkpointing=True,
        plugins=[AtomicCheckpointIO()],
        callbacks=[
            Start(directory.parent / "start.json"),
            StableCheckpoint(dirpath=directory, every_n_train_steps=1, keep=20),
        ],
    )
    trainer.fit(TinyModule(), ckpt_path=None if ckpt_path == "none" else ckpt_path)


if __name__ == "__main__":
    main()
