"""Runs for tests/checkpoint/test_world_size.py: a run stopped mid-epoch, resumed on the same and on another number of
processes with the same global batch of 8 samples.

Usage: ``world_run.py OUT_DIR RUN...`` in one process or under torchrun (``WORLD_SIZE`` processes), each RUN one of

* ``stop``: train from scratch with ``StableCheckpoint(every_n_train_steps=1)`` into ``OUT_DIR/ckpt-<W>/`` and stop
  at step ``STOP_AT`` (the fourth batch of the second epoch: 8 batches per epoch);
* ``resume-<W0>``: resume the step-``STOP_AT`` checkpoint of ``ckpt-<W0>`` to the end of its epoch (step ``END``),
  saving every step into ``OUT_DIR/resume-<W0>-<W>/``;
* ``again-<W0>-<W1>``: resume the step-``AGAIN_AT`` checkpoint of ``resume-<W0>-<W1>`` (saved in an epoch that
  the resume on ``W1`` processes dealt) to step ``END``;
* ``control-<W0>``: the same with Lightning alone (no ``StableCheckpoint``: a plain ``DataLoader`` restarts its
  epoch);
* ``batch-<W0>``: the same with ``StableCheckpoint`` and 4 samples per process (in one process: the global batch
  changes).

``WORLD_STRATEGY=fsdp`` trains with ``StableFSDPStrategy`` (sharded checkpoints: DCP reshards them) instead of DDP.

The model's loss draws nothing at random (no dropout): the runs on two world sizes can then differ only by the
order of the reductions. Each step records one draw of torch's generator (what a dropout mask would draw from).
It has an LR schedule (``LambdaLR`` per step) and a ``GradientNormMonitor`` (the ledger). Every run writes
``OUT_DIR/<RUN>.<W>.<rank>.pt``: the samples and the draw of each step (``{step: ...}``), the parameters, AdamW's
state, the LR, the ledger's applied-step count and the ``StableCheckpoint`` warnings.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader

from lightning_stability import GradientNormMonitor, StableCheckpoint
from lightning_stability.ledger import StepLedger
from lightning_stability.strategies import StableFSDPStrategy
from tests.checkpoint.resume_run import Indexed, final_state
from tests.distributed.fsdp_common import VOCAB, TinyLM
from tests.helpers import finish_worker

N, GLOBAL_BATCH, STOP_AT, AGAIN_AT, END = 64, 8, 11, 13, 16


class IndexedLM(TinyLM):
    def __init__(self, batch_size: int) -> None:
        super().__init__(d=16, batch_size=batch_size, n=N)
        self.seen: dict[int, list[int]] = {}
        self.draws: dict[int, float] = {}  # one number from torch's generator per step, used for nothing

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, index, _ = batch
        self.seen[self.global_step] = index.tolist()
        self.draws[self.global_step] = float(torch.rand(()))  # what a dropout mask would draw from
        return F.cross_entropy(self(x).reshape(-1, VOCAB), y.reshape(-1))

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.01)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def train_dataloader(self) -> DataLoader:
        return DataLoader(Indexed(), batch_size=self.batch_size, shuffle=True)


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor (a sharded one gathered: every rank calls this together)."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def run(out: Path, kind: str) -> None:
    pl.seed_everything(0, verbose=False)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    what, _, source = kind.partition("-")
    module = IndexedLM(GLOBAL_BATCH // 2 if what == "batch" else GLOBAL_BATCH // world)
    callbacks: list[pl.Callback] = [GradientNormMonitor()]
    if what == "stop":
        callbacks.append(StableCheckpoint(dirpath=out / f"ckpt-{world}", every_n_train_steps=1, keep=20))
    elif what != "control":
        callbacks.append(StableCheckpoint(dirpath=out / f"{kind}-{world}", every_n_train_steps=1, keep=20))
    strategy: Any = "ddp" if world > 1 else "auto"
    if os.environ.get("WORLD_STRATEGY") == "fsdp":
        strategy = StableFSDPStrategy()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        max_steps=STOP_AT if what == "stop" else END,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        enable_checkpointing=what != "control",  # no ModelCheckpoint of Lightning's in the control
    )
    ckpt = None
    if what == "again":
        ckpt = str(next((out / f"resume-{source}").glob(f"*step={AGAIN_AT}.ckpt")))
    elif what != "stop":
        ckpt = str(next((out / f"ckpt-{source}").glob(f"*step={STOP_AT}.ckpt")))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, ckpt_path=ckpt)
    optimizer = trainer.optimizers[0]
    torch.save(
        {
            **final_state(module, trainer, _full),
            "draws": module.draws,
            "lr": optimizer.param_groups[0]["lr"],
            "applied": int(StepLedger.of(trainer).record_of(optimizer).applied_steps),
            "global_step": trainer.global_step,
            "warnings": [str(w.message) for w in caught if str(w.message).startswith("StableCheckpoint:")],
        },
        out / f"{kind}.{world}.{trainer.global_rank}.pt",
    )


def main() -> None:
    out = Path(sys.argv[1])
    for kind in sys.argv[2:]:
        run(out, kind)
    finish_worker(out)


if __name__ == "__main__":
    main()
