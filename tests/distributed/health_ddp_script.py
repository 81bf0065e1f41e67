"""Run under torchrun (2 CPU processes, gloo): only rank 1 sees a spike at step SPIKE.

Faults (third argument): ``loss`` — rank 1's loss is multiplied by 100 (its gradient too, before DDP averages
it); ``lasting_loss`` — the same at SPIKE and SPIKE + 1 (a spike that outlasts its skipped update);
``after_allreduce`` — rank 1's gradients are multiplied by 100 inside ``on_before_optimizer_step``, after the
all-reduce, so only rank 1's gradient norm spikes.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_stability import StepLedger, TrainingHealthMonitor
from tests.helpers import TinyModule, exit_worker, quiet_trainer

out_dir, response, fault = sys.argv[1], sys.argv[2], sys.argv[3]
warnings.simplefilter("ignore")
SPIKE = 11


class Rank1Spikes(TinyModule):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        steps = {"loss": (SPIKE,), "lasting_loss": (SPIKE, SPIKE + 1)}.get(fault, ())
        if self.global_step in steps and self.global_rank == 1:
            return loss * 100
        return loss


class CorruptRank1(pl.Callback):
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, opt: Any) -> None:
        if fault == "after_allreduce" and trainer.global_step == SPIKE and trainer.global_rank == 1:
            for p in pl_module.parameters():
                p.grad.mul_(100.0)


monitor = TrainingHealthMonitor(
    response=response,  # type: ignore[arg-type]
    warmup_steps=5,
    snapshot_every=4,
    skip_batches=3,
    log_every_n_steps=2,
    report=False,
)
trainer = quiet_trainer(max_steps=20, accelerator="cpu", devices=2, strategy="ddp", callbacks=[CorruptRank1(), monitor])
pl.seed_everything(0)
trainer.fit(Rank1Spikes(lr=0.01))
result = {
    "outcomes": [int(o) for o in monitor.history.series["outcome"]],
    "counts": StepLedger.of(trainer).record_of().counts.tolist(),
    "rollbacks": monitor.rollback.rollbacks,
    "final_weights": [p.detach().flatten().tolist() for p in trainer.lightning_module.parameters()],
}
with open(os.path.join(out_dir, f"rank{trainer.global_rank}.json"), "w") as f:
    json.dump(result, f)
exit_worker()
