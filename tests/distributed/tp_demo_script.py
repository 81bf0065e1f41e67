"""torchrun script: the demo's CharGPT with ``gpt_block_plan`` under ``StableFSDPStrategy(tensor_parallel=2)``.

Usage: ``torchrun --nproc_per_node=4 tp_demo_script.py OUT_DIR`` (data parallel 2 x tensor parallel 2), or
``python tp_demo_script.py OUT_DIR`` for the one-process reference; writes ``OUT_DIR/rank{R}.json`` (the global gradient
norm of every step, the final weights' sums).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_stability import GradientNormMonitor, StableFSDPStrategy, parallelize_blocks
from lightning_stability.demo.model import CharGPT
from tests.helpers import exit_worker

VOCAB, CONTEXT, GLOBAL_BATCH, STEPS = 24, 8, 8, 5


class TPCharGPT(CharGPT):
    """The demo's model, unchanged but for the plan its blocks get under tensor parallelism."""

    def configure_model(self) -> None:
        if self.device_mesh is not None:
            parallelize_blocks(self.blocks, self.device_mesh["tensor_parallel"])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (tokens,) = batch
        return super().training_step(tokens, batch_idx)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.norms.append(float(self.trainer.callback_metrics["stability/grad_norm"]))  # global; a test's host read

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(1)
        data = TensorDataset(torch.randint(VOCAB, (STEPS * GLOBAL_BATCH, CONTEXT + 1), generator=g))
        if self.device_mesh is None:
            return DataLoader(data, batch_size=GLOBAL_BATCH)
        dp = self.device_mesh["data_parallel"]
        sampler = DistributedSampler(data, num_replicas=dp.size(), rank=dp.get_local_rank(), shuffle=False)
        return DataLoader(data, batch_size=GLOBAL_BATCH // dp.size(), sampler=sampler)


def main() -> None:
    out = Path(sys.argv[1])
    world = int(os.environ.get("WORLD_SIZE", 1))
    torch.manual_seed(0)
    module = TPCharGPT(VOCAB, d_model=16, layers=2, heads=2, context=CONTEXT, lr=1e-2, post_ln=False)
    module.norms = []
    strategy: Any = StableFSDPStrategy(tensor_parallel=2) if world > 1 else "auto"
    trainer = pl.Trainer(
        accelerator="cpu", devices=world, strategy=strategy, max_steps=STEPS, logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        use_distributed_sampler=False, callbacks=[GradientNormMonitor(max_norm=0.5)],
    )  # fmt: skip
    trainer.fit(module)
    weights = {n: float((p.full_tensor() if hasattr(p, "full_tensor") else p).double().sum()) for n, p in
               module.named_parameters()}  # fmt: skip
    split = [n for n, p in module.named_parameters() if "tensor_parallel" in str(getattr(p, "device_mesh", ""))]
    rank = int(os.environ.get("RANK", 0))
    (out / f"rank{rank}.json").write_text(json.dumps({"norms": module.norms, "weights": weights, "split": split}))


if __name__ == "__main__":
    main()
    exit_worker()  # results written: skip the teardown where gloo's threads can abort the process
