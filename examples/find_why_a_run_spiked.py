"""Find why a run spiked: the stability report's events, and the steps around them.

Three poisoned batches (targets x1000) hit the run; TrainingHealthMonitor skips their updates and writes
stability_report.json (and .png with matplotlib). Run: python examples/find_why_a_run_spiked.py
(EXAMPLE_STEPS=60 runs it at a tiny size, as CI does)
"""

import os
import tempfile
from pathlib import Path

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_stability import GradientNormMonitor, TrainingHealthMonitor
from lightning_stability.health import load_report

STEPS = int(os.environ.get("EXAMPLE_STEPS", 200))
POISONED = {STEPS // 2, STEPS // 2 + 7, STEPS // 2 + 11}


class Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.global_step in POISONED:
            x, y = x * 1000, y * 1000
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3, fused=True)

    def train_dataloader(self):
        x = torch.randn(2048, 16, generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=32, shuffle=True)


if __name__ == "__main__":
    out = Path(tempfile.mkdtemp(prefix="report-"))
    monitor = TrainingHealthMonitor(response="skip", warmup_steps=10, report_dir=out)
    trainer = L.Trainer(
        max_steps=STEPS,
        log_every_n_steps=10,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        callbacks=[GradientNormMonitor(max_norm=1.0), monitor],
    )
    trainer.fit(Regression())

    report = load_report(out / "stability_report.json")
    print("summary:", report["summary"])
    for event in report["events"]:
        print(f"step {event['step']}: {event['kind']}: {event['detail']}")
    history = report["history"]
    for i, step in enumerate(history["step"]):
        if any(abs(step - p) <= 1 for p in POISONED):
            print(
                f"  step {step}: loss {history['loss'][i]:.3g} grad_norm {history['grad_norm'][i]:.3g} "
                f"outcome {history['outcome'][i]}"
            )
    assert report["summary"]["skipped_steps"]["spike"] == len(POISONED), report["summary"]
