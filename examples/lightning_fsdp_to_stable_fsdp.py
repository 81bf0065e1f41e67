"""From Lightning's FSDPStrategy to StableFSDPStrategy: the same model, one word changed, and the callbacks
(clipping by the true global norm across shards, skips on every rank) work.

On GPUs:          python examples/lightning_fsdp_to_stable_fsdp.py --accelerator gpu --devices 8
On a CPU (as CI): EXAMPLE_STEPS=20 python examples/lightning_fsdp_to_stable_fsdp.py   (FSDP2 over gloo)
"""

import argparse
import os

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_stability import GradientNormMonitor, StableFSDPStrategy, WarmupConstantCosineLR

STEPS = int(os.environ.get("EXAMPLE_STEPS", 200))


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.ff = nn.Sequential(
            nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, x):
        return x + self.ff(x)


class Model(L.LightningModule):
    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[Block(width) for _ in range(4)])
        self.head = nn.Linear(width, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.head(self.blocks(x)), y)

    def configure_optimizers(self):  # after the strategy sharded the model: self.parameters() are the shards
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        x = torch.randn(2048, 64, generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=16, shuffle=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=1)
    args = parser.parse_args()
    # before: strategy=FSDPStrategy(...) with the same keywords (Lightning's meaning: see the mapping table)
    strategy = StableFSDPStrategy(
        sharding_strategy="SHARD_GRAD_OP",
        auto_wrap_policy={Block},
        activation_checkpointing_policy={Block},
        state_dict_type="sharded",
    )
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy=strategy,
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        callbacks=[GradientNormMonitor(max_norm=1.0), WarmupConstantCosineLR()],
    )
    trainer.fit(Model())
    if trainer.is_global_zero:
        print(f"steps: {trainer.global_step}, grad norm: {float(trainer.callback_metrics['stability/grad_norm']):.3f}")
