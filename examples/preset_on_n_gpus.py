"""Train with a preset on N devices: StableTrainer.from_preset adapts the recipe to the machine and says how.

On a GPU node:        python examples/preset_on_n_gpus.py --accelerator gpu --devices 8
On several nodes:     torchrun --nnodes 2 --nproc_per_node 8 ... examples/preset_on_n_gpus.py --devices 8 --num-nodes 2
On a CPU (as CI):     EXAMPLE_STEPS=20 python examples/preset_on_n_gpus.py
"""

import argparse
import os

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_stability import StableTrainer

STEPS = int(os.environ.get("EXAMPLE_STEPS", 200))


class Block(nn.Module):  # a repeated block: StableFSDPStrategy makes each one an FSDP unit
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

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3, fused=True)

    def train_dataloader(self):
        x = torch.randn(2048, 64, generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=16, shuffle=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="gpt")
    parser.add_argument("--accelerator", default="auto")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--num-nodes", type=int, default=1)
    args = parser.parse_args()
    trainer = StableTrainer.from_preset(
        args.preset,  # e.g. "over-10b" also shards with StableFSDPStrategy
        accelerator=args.accelerator,
        devices=args.devices,
        num_nodes=args.num_nodes,
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    trainer.fit(Model())
    if trainer.is_global_zero:
        print(f"steps: {trainer.global_step}, grad norm: {float(trainer.callback_metrics['stability/grad_norm']):.3f}")
