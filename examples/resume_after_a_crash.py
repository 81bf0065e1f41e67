"""Save only healthy checkpoints, atomically, and resume after a crash with ckpt_path="last".

The first fit crashes mid-epoch (an exception stands in for a lost node or a kill); the second call, the same
script run again, resumes from the newest healthy checkpoint, saved mid-epoch, and ends with the weights of a run
that never crashed, bit for bit: a plain DataLoader(shuffle=True) and dropout need nothing more.
Run: python examples/resume_after_a_crash.py   (EXAMPLE_STEPS=20 runs it at a tiny size, as CI does)
"""

import os
import tempfile

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_stability import GradientNormMonitor, StableCheckpoint

STEPS = int(os.environ.get("EXAMPLE_STEPS", 200))
CRASH_AT = STEPS // 2 + 8  # the newest checkpoint before it is mid-epoch (10 batches an epoch, a save every 5)


class Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Dropout(0.1), nn.Linear(64, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3, fused=True)

    def train_dataloader(self):  # 10 batches per epoch, a new order each epoch
        x = torch.randn(320, 16, generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=32, shuffle=True)


class Crash(L.Callback):
    def on_train_batch_start(self, trainer, *args):
        if trainer.global_step == CRASH_AT:
            raise RuntimeError(f"simulated crash at step {CRASH_AT}")


def fit(ckpt_dir: str, crash: bool = False) -> L.Trainer:
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(
        max_steps=STEPS,
        logger=False,
        enable_progress_bar=False,
        callbacks=[
            GradientNormMonitor(max_norm=1.0),
            # healthy steps only; atomic, checksummed files
            StableCheckpoint(dirpath=ckpt_dir, every_n_train_steps=5, keep=3),
            *([Crash()] if crash else []),
        ],
    )
    trainer.fit(Regression(), ckpt_path="last")  # the newest healthy checkpoint that verifies; none: a fresh start
    return trainer


if __name__ == "__main__":
    ckpt_dir = tempfile.mkdtemp(prefix="ckpts-")
    try:
        fit(ckpt_dir, crash=True)
    except RuntimeError as error:
        print(f"first run: {error}; checkpoints: {sorted(os.listdir(ckpt_dir))}")
    resumed = fit(ckpt_dir)
    print(f"second run resumed and finished at step {resumed.global_step}")
    uninterrupted = fit(tempfile.mkdtemp(prefix="ckpts-"))
    same = all(
        torch.equal(a, b)
        for a, b in zip(
            resumed.lightning_module.state_dict().values(),
            uninterrupted.lightning_module.state_dict().values(),
            strict=True,
        )
    )
    print(f"weights equal to a run that never crashed, bit for bit: {same}")
    assert resumed.global_step == STEPS and same
