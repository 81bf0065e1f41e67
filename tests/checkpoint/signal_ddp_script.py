"""Run under torchrun (2 CPU processes, gloo): only rank 1 sends itself SIGTERM, at the start of step SIGNAL_AT.

Writes ``OUT_DIR/rank{RANK}.json``: the step each rank stopped at, whether it was told to stop, and the ring's
checkpoint files as that rank sees them.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl

from lightning_stability import AtomicCheckpointIO, StableCheckpoint
from tests.helpers import TinyModule, exit_worker, quiet_trainer

out_dir = Path(sys.argv[1])
warnings.simplefilter("ignore")
SIGNAL_AT = 3


class SignalRank1(pl.Callback):
    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == SIGNAL_AT and trainer.global_rank == 1:
            os.kill(os.getpid(), signal.SIGTERM)


trainer = quiet_trainer(
    max_steps=50,
    devices=2,
    strategy="ddp",
    enable_checkpointing=True,
    default_root_dir=out_dir,
    plugins=[AtomicCheckpointIO()],
    callbacks=[StableCheckpoint(dirpath=out_dir / "ckpts", every_n_train_steps=1000), SignalRank1()],
)
pl.seed_everything(0)
trainer.fit(TinyModule(n=256))
result = {
    "global_step": trainer.global_step,
    "should_stop": trainer.should_stop,
    "files": sorted(p.name for p in (out_dir / "ckpts").glob("*.ckpt")),
}
with open(out_dir / f"rank{trainer.global_rank}.json", "w") as f:
    json.dump(result, f)
exit_worker()
