"""Clip the global gradient norm and skip the steps whose gradient is NaN/inf.

Run: python examples/clip_and_skip.py   (EXAMPLE_STEPS=20 runs it at a tiny size, as CI does)
"""

import math
import os

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_stability import GradientNormMonitor

STEPS = int(os.environ.get("EXAMPLE_STEPS", 200))
BAD_STEP = STEPS // 2  # this step's loss is made NaN, as a corrupted batch would


class Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        if self.global_step == BAD_STEP:
            loss = loss * math.nan
        return loss

    def configure_optimizers(self):
        # fused=True lets the skip be decided on the device, with no host sync per step
        return torch.optim.AdamW(self.parameters(), lr=1e-3, fused=True)

    def train_dataloader(self):
        x = torch.randn(1024, 16, generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=32, shuffle=True)


if __name__ == "__main__":
    trainer = L.Trainer(
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        callbacks=[GradientNormMonitor(max_norm=1.0)],  # clip to 1.0; skip_nonfinite=True by default
    )
    model = Regression()
    trainer.fit(model)

    skipped = int(trainer.callback_metrics["stability/skipped_steps"])
    print(f"skipped steps: {skipped}, last grad norm: {float(trainer.callback_metrics['stability/grad_norm']):.3f}")
    assert skipped == 1, skipped
    assert all(torch.isfinite(p).all() for p in model.parameters()), "the NaN step reached the weights"
