"""Run under torchrun (2 CPU processes, gloo): the critical batch under DDP against a by-hand computation in one
process on the same micro-batches, and BatchRamp growing the batch alike on both ranks with an LR schedule.

Writes ``{out_dir}/rank{RANK}.json``.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist

from lightning_stability import BatchRamp, CriticalBatchMonitor, GradientAccumulation, WarmupConstantCosineLR
from lightning_stability.ranks import gather_objects
from tests.critical_batch.helpers import Windows, by_hand
from tests.helpers import QUIET, TinyModule, exit_worker

warnings.filterwarnings("ignore")


def fit(callbacks: list[Any], module: TinyModule, **kwargs: Any) -> pl.Trainer:
    pl.seed_everything(0)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", enable_checkpointing=False, callbacks=callbacks, **QUIET, **kwargs
    )
    trainer.fit(module)
    return trainer


def estimate() -> dict[str, Any]:
    """Every rank's first micro-batch against the all-reduced gradient of 2 ranks x 3 micro-batches."""
    windows = Windows()
    module = TinyModule(n=96, batch_size=4)  # 48 samples per rank: 12 micro-batches, 4 steps of 3
    callbacks = [GradientAccumulation(3), CriticalBatchMonitor(ema_decay=0.8, log_every_n_steps=1), windows]
    trainer = fit(callbacks, module, max_epochs=1)
    every = gather_objects((windows.starts, windows.batches))  # the same weights on both ranks, their own batches
    starts = every[0][0]
    steps = [(starts[i], [rank[1][i] for rank in every]) for i in range(len(starts))]
    value, stderr = by_hand(module.net, steps, micro=4, decay=0.8)
    metrics = trainer.callback_metrics
    return {
        "sizes": windows.sizes,
        "logged": float(metrics["stability/critical_batch"]),
        "logged_stderr": float(metrics["stability/critical_batch_stderr"]),
        "by_hand": value.item(),
        "by_hand_stderr": stderr.item(),
    }


def ramp() -> dict[str, Any]:
    windows = Windows()
    accumulation = GradientAccumulation(steps=2, lr_scaling="sqrt")
    callbacks = [
        WarmupConstantCosineLR(warmup=0.1, decay=0.3),
        accumulation,
        # the rule of the figure above the current batch (fraction=growth, confidence=0): a test of a change
        BatchRamp(max_factor=8, warmup_steps=6, fraction=2.0, confidence=0.0, ema_decay=0.8, log_every_n_steps=2),
        windows,
    ]
    module = TinyModule(n=640, batch_size=4)  # 80 micro-batches per rank
    fit(callbacks, module, max_epochs=1)
    flat = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    return {
        "sizes": windows.sizes,
        "lrs": windows.lrs,
        "beta2s": windows.beta2s,
        "grown": accumulation.state_dict()["grown"],
        "weights_equal": all(torch.equal(gathered[0], g) for g in gathered),
    }


def main() -> None:
    out_dir = Path(sys.argv[1])
    results = {"estimate": estimate(), "ramp": ramp()}
    (out_dir / f"rank{int(os.environ['RANK'])}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
    exit_worker()
