"""torchrun script: StableTrainer.from_preset("175b", accelerator="cpu", devices=2, precision="16-mixed") trains a
tiny model."""

from __future__ import annotations

import json
import os
import sys
import warnings

import lightning.pytorch as pl
import torch

from lightning_stability import LossScaleTuner, PrecursorMonitor, StableTrainer
from tests.helpers import TinyModule, exit_worker

warnings.simplefilter("ignore")
out_dir = sys.argv[1]
pl.seed_everything(0)
trainer = StableTrainer.from_preset(
    "175b",
    accelerator="cpu",
    devices=2,
    precision="16-mixed",  # the recipe's fp16, asked for: a CPU without AMX-FP16 would run fp32
    max_steps=2,
    logger=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    enable_checkpointing=False,
)
trainer.fit(TinyModule(n=1024))
module = trainer.lightning_module
weights = [
    p.full_tensor().detach().flatten().tolist() if hasattr(p, "full_tensor") else p.detach().flatten().tolist()
    for p in module.parameters()
]
scaler = next(cb for cb in trainer.callbacks if isinstance(cb, LossScaleTuner)).scaler
precursors = next(cb for cb in trainer.callbacks if isinstance(cb, PrecursorMonitor))
result = {
    "strategy": type(trainer.strategy).__name__,
    "global_step": trainer.global_step,
    "weights": weights,
    "loss_scale": float(scaler.get_scale()) if scaler is not None else None,
    "precursors": {"backoff": float(precursors.backoff), "backoff_on": precursors._backoff_on},
    "torch": torch.__version__,
}
with open(os.path.join(out_dir, f"rank{trainer.global_rank}.json"), "w") as f:
    json.dump(result, f)
exit_worker()
