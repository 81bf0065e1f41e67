"""A run with a poisoned sample that kills itself with SIGKILL a few steps after StepReplay quarantined it
(``first``), or resumes the killed run with ``ckpt_path="last"`` and trains to the end (``resume``).

Usage: ``python quarantine_kill_run.py OUT_DIR first|resume``, or under ``torchrun --nproc_per_node 2`` with a third
argument ``ddp`` or ``fsdp`` (2 CPU processes, ``StableFSDPStrategy`` for ``fsdp``, sharded checkpoints; the kill
hits rank 1 only, torchrun then stops rank 0). Writes
``OUT_DIR/<mode>.<rank>.json`` (``resume`` only: the killed run writes nothing after its kill): every sample index
this rank loaded, in order, the quarantine and the steps.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_stability import StableCheckpoint, StableFSDPStrategy, TrainingHealthMonitor
from lightning_stability.replay import PoisonedSamples, StepReplay
from tests.helpers import quiet_trainer
from tests.replay.test_replay import IndexedData, Model

out, mode = Path(sys.argv[1]), sys.argv[2]
strategy = sys.argv[3] if len(sys.argv) > 3 else None
ddp = strategy is not None  # two processes
RANK = int(os.environ.get("RANK", "0"))
POISONED, KILL_AFTER = 17, 3  # the kill comes this many steps after the quarantine


class KillAfterQuarantine(pl.Callback):
    def __init__(self, replay: StepReplay) -> None:
        self.replay = replay
        self.at: int | None = None

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if self.at is None and self.replay.quarantine.indices:
            self.at = trainer.global_step + KILL_AFTER
            (out / f"quarantined.{RANK}.json").write_text(json.dumps(sorted(self.replay.quarantine.indices)))
        if self.at is not None and trainer.global_step >= self.at and (1 if ddp else 0) == RANK:
            os.kill(os.getpid(), signal.SIGKILL)


torch.manual_seed(0)
inner = IndexedData()
model = Model(PoisonedSamples(inner, [POISONED]))
replay = StepReplay(quarantine_file=None)
callbacks: list[pl.Callback] = [
    TrainingHealthMonitor(response="skip", warmup_steps=5, report=False),
    replay,
    StableCheckpoint(dirpath=out / "ckpts", every_n_train_steps=1, keep=3),
]
if mode == "first":
    callbacks.append(KillAfterQuarantine(replay))
parallel: dict[str, Any] = {}
if strategy is not None:
    parallel = {"devices": 2, "strategy": StableFSDPStrategy() if strategy == "fsdp" else "ddp"}
trainer = quiet_trainer(callbacks=callbacks, max_epochs=3, enable_checkpointing=True, default_root_dir=out, **parallel)
trainer.fit(model, ckpt_path="last" if mode == "resume" else None)
result = {"loaded": inner.loaded, "quarantined": sorted(replay.quarantine.indices), "steps": trainer.global_step}
(out / f"{mode}.{RANK}.json").write_text(json.dumps(result))
