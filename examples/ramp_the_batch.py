"""Grow the batch while the measured critical batch is well above it: accumulation 2 -> up to 16 micro-batches.

Run: python examples/ramp_the_batch.py   (EXAMPLE_STEPS=20 runs it at a tiny size, as CI does)
"""

import os

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_stability import BatchRamp, GradientAccumulation, WarmupConstantCosineLR

STEPS = int(os.environ.get("EXAMPLE_STEPS", 400))


class NoisyRegression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(64 * STEPS, 16, generator=gen)
        y = x.sum(1, keepdim=True) + 2.0 * torch.randn(len(x), 1, generator=gen)  # noisy targets: a noisy gradient
        return DataLoader(TensorDataset(x, y), batch_size=4, shuffle=True)


if __name__ == "__main__":
    accumulation = GradientAccumulation(steps=2, lr_scaling="sqrt")  # the LR follows sqrt(batch)
    ramp = BatchRamp(max_factor=16, warmup_steps=10, log_every_n_steps=5)
    trainer = L.Trainer(
        max_epochs=1,  # a run bounded by samples: the LR schedule counts samples once the batch grows
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        callbacks=[accumulation, ramp, WarmupConstantCosineLR()],
    )
    trainer.fit(NoisyRegression())

    print(
        f"critical batch {ramp.critical_batch:.1f} ± {ramp.critical_batch_stderr:.1f} samples; "
        f"accumulation 2 -> {accumulation.factor}; optimizer steps {trainer.global_step}"
    )
    assert 2 <= accumulation.factor <= 16
