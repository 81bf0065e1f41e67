"""Find the bad batch or the bad GPU: StepReplay replays each flagged step and says who caused it.

Two faults hit the run: one sample of the dataset is poisoned (NaN), and at one step a bit flips in a layer's
output (what a faulty chip does, made here by BitFlip). StepReplay quarantines the poisoned sample's batch (never
trained on again, also in the next epochs) and applies the faulty step as replayed. Run:
python examples/find_the_bad_batch_or_gpu.py (EXAMPLE_STEPS=20 runs it at a tiny size, as CI does)
"""

import json
import os
import tempfile
from pathlib import Path

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_stability import BitFlip, PoisonedSamples, StepReplay, TrainingHealthMonitor

STEPS = int(os.environ.get("EXAMPLE_STEPS", 200))
FLIP_AT = STEPS // 2
POISONED = [123]


class Regression(L.LightningModule):
    def __init__(self, data) -> None:
        super().__init__()
        self.data = data
        self.net = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Dropout(0.1), nn.Linear(64, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=16, shuffle=True)


if __name__ == "__main__":
    L.seed_everything(0)
    out = Path(tempfile.mkdtemp(prefix="replay-"))
    x = torch.randn(256, 16, generator=torch.Generator().manual_seed(0))
    data = PoisonedSamples(TensorDataset(x, x.sum(1, keepdim=True)), POISONED)
    model = Regression(data)
    flip = BitFlip(model, "net.3", step=FLIP_AT)  # the last Linear's output, on rank 0
    trainer = L.Trainer(
        max_steps=STEPS,
        default_root_dir=out,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        callbacks=[TrainingHealthMonitor(response="skip", warmup_steps=5, report=False), StepReplay()],
    )
    trainer.fit(model)

    for event in trainer.callbacks[0].events:
        if event["kind"] == "replay":
            print(f"step {event['step']}: {event['cause']}: {event['detail']}")
    manifest = json.loads((out / "quarantine.json").read_text())
    print("quarantined samples:", manifest["indices"])
    causes = [e["cause"] for e in trainer.callbacks[0].events if e["kind"] == "replay"]
    assert sorted(causes) == ["data", "transient"], causes
    assert data.served == POISONED  # loaded once, for the bad step; never again
