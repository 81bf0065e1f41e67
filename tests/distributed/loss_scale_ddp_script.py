"""Two gloo processes, fp16 on the CPU; at one step only rank 1's gradient gets an inf.

Usage: ``loss_scale_ddp_script.py OUT_DIR {ddp,fsdp2}``; writes ``{OUT_DIR}/rank{R}.json``.

* ``ddp``: the inf is written in ``on_after_backward``, after DDP's all-reduce, so the ranks' gradients
  really differ. Three runs: torch's GradScaler (the control: the ranks diverge), and LossScaleTuner
  with a plain and a fused AdamW.
* ``fsdp2``: Lightning's ModelParallelStrategy with ``fully_shard`` (DTensor gradients, some local
  shards empty); the inf goes into rank 1's local shard. LossScaleTuner with a fixed and an "auto"
  initial scale.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins import MixedPrecision
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.fsdp import fully_shard

from lightning_stability.amp.callback import LossScaleTuner
from lightning_stability.ledger.step_ledger import StepLedger
from tests.helpers import TinyModule, exit_worker

INF_STEP = 3
STEPS = 8


class ShardedTinyModule(TinyModule):
    def configure_model(self) -> None:
        for layer in self.net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(self.net)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


class InfOnRankOne(pl.Callback):
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_rank == 1 and trainer.global_step == INF_STEP:
            grad = next(pl_module.parameters()).grad
            assert grad is not None
            local = grad.to_local() if hasattr(grad, "to_local") else grad
            local[0, 0] = math.inf


class Record(pl.Callback):
    def __init__(self) -> None:
        self.moved: list[bool] = []
        self.scales: list[float] = []
        self._before: list[torch.Tensor] = []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self._before = [p.detach().clone() for p in pl_module.parameters()]  # DTensors compare shard-wise

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        StepLedger.of(trainer).open_step(optimizer)  # so the control run keeps a ledger too

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        StepLedger.of(trainer).close_step()
        after = pl_module.parameters()
        self.moved.append(any(not torch.equal(a, b) for a, b in zip(self._before, after, strict=True)))
        self.scales.append(trainer.precision_plugin.scaler.get_scale())  # type: ignore[attr-defined]


def run(tuned: bool, optimizer: str, sharded: bool = False, init_scale: float | str = 256) -> dict[str, Any]:
    torch.manual_seed(0)
    module = ShardedTinyModule() if sharded else TinyModule(optimizer=optimizer)
    record = Record()
    callbacks: list[pl.Callback] = [InfOnRankOne(), record]
    if tuned:
        callbacks.insert(0, LossScaleTuner(init_scale=init_scale, hysteresis=1, fit_start_checks=False))  # type: ignore[arg-type]
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=256.0))
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=ModelParallelStrategy() if sharded else "ddp", max_steps=STEPS,
        callbacks=callbacks, plugins=[plugin], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module)
    params = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in module.parameters()]
    return {
        "moved": record.moved,
        "scales": record.scales,
        "applied": int(StepLedger.of(trainer).record_of().applied_steps),
        "params": [p.detach().double().sum().item() for p in params],
    }


def main() -> None:
    out_dir, mode = Path(sys.argv[1]), sys.argv[2]
    if mode == "ddp":
        results = {
            "stock": run(False, "adamw"),
            "tuned": run(True, "adamw"),
            "tuned_fused": run(True, "adamw_fused"),
        }
    else:
        results = {
            "tuned": run(True, "adamw", sharded=True),
            "tuned_auto": run(True, "adamw", sharded=True, init_scale="auto"),
        }
    (out_dir / f"rank{os.environ['RANK']}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
    exit_worker()
