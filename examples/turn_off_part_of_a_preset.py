"""Turn off parts of a preset, and put a callback of your own in the place of one.

Here: the preset's LR schedule is replaced by an inverse-square-root schedule, the health monitor and the LR
back-off are off, and checkpoints and the NCCL watchdog settings are left alone.
Run: python examples/turn_off_part_of_a_preset.py (EXAMPLE_STEPS=20 runs it at a tiny size, as CI does)
"""

import os

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_stability import InverseSqrtSchedule, ScheduledLR, StableTrainer

STEPS = int(os.environ.get("EXAMPLE_STEPS", 200))


class Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3, fused=True)

    def train_dataloader(self):
        x = torch.randn(1024, 16, generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=32, shuffle=True)


if __name__ == "__main__":
    trainer = StableTrainer.from_preset(
        "gpt",
        lr_schedule=False,  # off: the callback below takes its place
        health=None,  # no TrainingHealthMonitor
        lr_backoff=None,  # no PrecursorMonitor (the LR back-off on the update-to-weight ratio)
        checkpoint=False,  # no StableCheckpoint
        watchdog=False,  # the process-group timeout and NCCL variables stay yours
        callbacks=[ScheduledLR(InverseSqrtSchedule(warmup=10))],
        max_steps=STEPS,
        logger=False,
        enable_progress_bar=False,
    )
    print("callbacks:", [type(c).__name__ for c in trainer.callbacks])
    trainer.fit(Regression())
    print(f"steps: {trainer.global_step}, lr: {float(trainer.callback_metrics['stability/lr']):.2e}")
