"""Move a LightningModule from plain Lightning to lightning_stability.

Before: configure_optimizers returns AdamW and a cosine scheduler, and the Trainer gets
gradient_clip_val=1.0 and accumulate_grad_batches=4. After: configure_optimizers returns the optimizer only,
and three callbacks do the rest.

Run: python examples/migrate_from_lightning.py   (EXAMPLE_STEPS=20 runs it at a tiny size, as CI does)
"""

import os

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_stability import GradientAccumulation, GradientNormMonitor, StabilityConfigError, WarmupConstantCosineLR

STEPS = int(os.environ.get("EXAMPLE_STEPS", 200))


class Before(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-3)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=STEPS)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def train_dataloader(self):
        x = torch.randn(1024, 16, generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=32, shuffle=True)


class After(Before):
    def configure_optimizers(self):  # the optimizer only: WarmupConstantCosineLR sets the LR
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def trainer(**kwargs) -> L.Trainer:
    return L.Trainer(max_steps=STEPS, logger=False, enable_checkpointing=False, enable_progress_bar=False, **kwargs)


if __name__ == "__main__":
    # before: L.Trainer(max_steps=STEPS, gradient_clip_val=1.0, accumulate_grad_batches=4).fit(Before())
    callbacks = [
        GradientNormMonitor(max_norm=1.0),  # was gradient_clip_val=1.0
        GradientAccumulation(steps=4),  # was accumulate_grad_batches=4 (the LR stays as set)
        WarmupConstantCosineLR(warmup=0.05, decay=0.95),  # was the scheduler; adds a 5% warmup
    ]
    try:  # a module that still returns its scheduler is told which of the two to remove
        trainer(callbacks=callbacks).fit(Before())
        raise AssertionError("expected a StabilityConfigError")
    except StabilityConfigError as error:
        print(f"kept the scheduler: {str(error)[:160]}...")

    callbacks = [GradientNormMonitor(max_norm=1.0), GradientAccumulation(steps=4), WarmupConstantCosineLR(0.05, 0.95)]
    after = trainer(callbacks=callbacks)
    after.fit(After())
    print(f"optimizer steps: {after.global_step}, final lr: {float(after.callback_metrics['stability/lr']):.2e}")
