"""The stability report of a short run that spikes twice, as the README shows it.

A small MLP regression in fp16 (CPU, an explicit scaler plugin) with the package's stack: clipping, the
warmup-constant-cosine LR, loss-scale tuning and ``TrainingHealthMonitor(response="rollback")``. One batch is
poisoned at step 90 (targets x100): its update is skipped, nothing needs restoring. Three in a row at 170-172: the
spike outlasts its skipped update, so the monitor rolls back and skips the next batches. Run::

    python -m benchmarks.report_example --out docs

It writes ``stability_report.json`` and ``stability_report.png`` into ``--out``.
"""

from __future__ import annotations

import argparse
import warnings
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins import MixedPrecision
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_stability import GradientNormMonitor, LossScaleTuner, TrainingHealthMonitor, WarmupConstantCosineLR


class Regression(pl.LightningModule):
    def __init__(self, poisoned: set[int]) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 1))
        self.poisoned = poisoned

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self.global_step in self.poisoned:
            y = y * 100.0
        return nn.functional.mse_loss(self.net(x).float(), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-3)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(4096, 16, generator=g)
        y = (x[:, :4].sum(1, keepdim=True)).sin() + 0.05 * torch.randn(4096, 1, generator=g)
        return DataLoader(TensorDataset(x, y), batch_size=16)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="docs", help="directory for the report (default: docs)")
    parser.add_argument("--steps", type=int, default=240, help="optimizer steps (default: 240)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    pl.seed_everything(0)
    monitor = TrainingHealthMonitor(
        response="rollback", snapshot_every=20, skip_batches=10, log_every_n_steps=5, report_dir=args.out
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))],
        callbacks=[GradientNormMonitor(max_norm=1.0), WarmupConstantCosineLR(), LossScaleTuner(), monitor],
    )
    trainer.fit(Regression(poisoned={90, 170, 171, 172}))
    for event in monitor.events:
        print(event)


if __name__ == "__main__":
    main()
