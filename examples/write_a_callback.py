"""A callback of your own that skips an update whose loss is too high, and logs a metric.

Run: python examples/write_a_callback.py   (EXAMPLE_STEPS=20 runs it at a tiny size, as CI does)
"""

import os

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_stability import GradientNormMonitor, StepLedger
from lightning_stability.ledger import LedgerCallback, Outcome

STEPS = int(os.environ.get("EXAMPLE_STEPS", 200))
BAD_STEP = STEPS // 2  # this step's targets are 1000x too large


class SkipHighLoss(LedgerCallback):
    needs_loss = True  # ledger.step.loss: the update's loss, averaged over its micro-batches

    def __init__(self, max_loss: float) -> None:
        super().__init__()
        self.max_loss = max_loss

    def on_step(self, trainer, ledger, optimizer):
        too_high = ledger.any_rank(ledger.step.loss > self.max_loss)  # a device flag, the same on every rank
        ledger.mark_skip(Outcome.SKIPPED_SPIKE, too_high)
        self.record_metric("stability/loss_too_high", too_high.float())


class Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.global_step == BAD_STEP:
            y = y * 1000
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
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
        callbacks=[GradientNormMonitor(), SkipHighLoss(max_loss=1000.0)],
    )
    trainer.fit(Regression())
    counts = StepLedger.of(trainer).record_of().counts.tolist()
    print({outcome.name: counts[outcome] for outcome in Outcome})
    assert counts[Outcome.SKIPPED_SPIKE] == 1, counts
