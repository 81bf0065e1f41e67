"""A run for tests/checkpoint/test_verify_resume.py: ``verify_run.py DIR LAYOUT MAX_STEPS CKPT_PATH KILL``.

Trains with ``StableCheckpoint(dirpath=DIR, every_n_train_steps=2)``, one process: ``LAYOUT`` ``plain`` (a small
MLP, ``AtomicCheckpointIO``: one file per checkpoint) or ``sharded`` (a tiny GPT on ``StableFSDPStrategy``: a
``torch.distributed.checkpoint`` directory per checkpoint), and ``trainer.fit(ckpt_path=CKPT_PATH)`` (``none``: a
fresh fit). ``KILL`` ``load``: the process SIGKILLs itself once the strategy has verified and loaded the checkpoint
it resumes from, before the first step. Writes ``DIR/../<LAYOUT>.start.json`` (the step the fit started at and the
checkpoint Lightning resolved) and ``DIR/../<LAYOUT>.final.pt`` (every weight at the end).
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

from lightning_stability import AtomicCheckpointIO, StableCheckpoint
from lightning_stability.strategies import StableFSDPStrategy
from tests.distributed.fsdp_common import TinyLM
from tests.helpers import TinyModule, quiet_trainer


class Record(pl.Callback):
    def __init__(self, out: Path, layout: str, kill: str) -> None:
        self.out, self.layout, self.kill = out, layout, kill

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        start = {"global_step": trainer.global_step, "ckpt_path": trainer.ckpt_path}
        (self.out / f"{self.layout}.start.json").write_text(json.dumps(start))
        if self.kill == "load":  # the checkpoint is loaded, the fit not yet under way
            os.kill(os.getpid(), signal.SIGKILL)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        weights = {
            k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in pl_module.state_dict().items()
        }
        torch.save(weights, self.out / f"{self.layout}.final.pt")


def main() -> None:
    directory, layout, max_steps, ckpt_path, kill = sys.argv[1:]
    out = Path(directory).parent
    pl.seed_everything(0, verbose=False)
    module: pl.LightningModule
    kwargs: dict[str, Any]
    if layout == "plain":
        module, kwargs = TinyModule(n=40), {"plugins": [AtomicCheckpointIO()]}  # 5 batches an epoch: resumes mid-epoch
    else:
        module, kwargs = TinyLM(d=16, n=40), {"strategy": StableFSDPStrategy()}
    trainer = quiet_trainer(
        max_steps=int(max_steps),
        enable_checkpointing=True,
        callbacks=[Record(out, layout, kill), StableCheckpoint(dirpath=directory, every_n_train_steps=2, keep=5)],
        **kwargs,
    )
    trainer.fit(module, ckpt_path=None if ckpt_path == "none" else ckpt_path)


if __name__ == "__main__":
    main()
