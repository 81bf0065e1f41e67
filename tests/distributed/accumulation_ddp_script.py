"""Run under torchrun (2 CPU processes, gloo): count DDP gradient all-reduces per optimizer step.

Writes ``{out_dir}/rank{RANK}.json`` with, per configuration, the number of bucket all-reduces (counted
by a DDP communication hook), optimizer steps, micro-batches and whether the weights agree across ranks.
"""

# no `from __future__ import annotations`: DDP checks the comm hook's `bucket` annotation at runtime
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from lightning_stability.accumulation.callback import GradientAccumulation
from lightning_stability.errors import StabilityConfigError
from tests.helpers import QUIET, TinyModule, exit_worker

warnings.filterwarnings("ignore")


class Counts(Callback):
    def __init__(self, hook: Any) -> None:
        self.hook = hook
        self.steps = 0
        self.micro = 0
        self.sizes: list[int] = []
        self._current = 0

    def on_train_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        # Lightning registers `DDPStrategy(ddp_comm_hook=)` on CUDA only; on CPU register it on the DDP
        # wrapper directly (before the first backward, as DDP requires).
        trainer.strategy.model.register_comm_hook(state=None, hook=self.hook)  # type: ignore[union-attr]

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.micro += 1
        self._current += 1

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, optimizer: Any) -> None:
        self.steps += 1
        self.sizes.append(self._current)
        self._current = 0


def run(steps: Any, n: int) -> dict[str, Any]:
    rounds = [0]

    def counting_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        rounds[0] += 1
        return allreduce_hook(state, bucket)

    pl.seed_everything(0)
    counts = Counts(counting_hook)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_epochs=1,
        enable_checkpointing=False,
        callbacks=[GradientAccumulation(steps=steps, lr_scaling="none"), counts],
        **QUIET,
    )
    module = TinyModule(n=n, batch_size=4)  # each rank sees n / 2 samples: n / 8 micro-batches
    trainer.fit(module)
    flat = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    return {
        "rounds": rounds[0],
        "steps": counts.steps,
        "micro": counts.micro,
        "sizes": counts.sizes,
        "weights_equal": all(torch.equal(gathered[0], g) for g in gathered),
    }


class BatchNormModule(TinyModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 1))


def sync_batchnorm_on_cpu() -> str:
    """DDP on CPU with batchnorm="sync_batchnorm": torch's SyncBatchNorm would raise in its first forward."""
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=1,
        enable_checkpointing=False,
        callbacks=[GradientAccumulation(steps=2, batchnorm="sync_batchnorm")],
        **QUIET,
    )
    try:
        trainer.fit(BatchNormModule())
    except StabilityConfigError as err:
        return str(err)
    return "no error"


def main() -> None:
    out_dir = Path(sys.argv[1])
    results = {
        "every_batch": run(1, 64),  # 8 micro-batches per rank, one all-reduce round each
        "constant_4": run(4, 128),  # 16 micro-batches per rank, 4 optimizer steps
        "schedule": run({0: 2, 2: 3}, 128),  # 2, 2, then 3s: the switch is not aligned with the epoch count
        "sync_batchnorm_on_cpu": sync_batchnorm_on_cpu(),  # last: a failed fit tears the process group down
    }
    rank = int(os.environ["RANK"])
    (out_dir / f"rank{rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
    exit_worker()
