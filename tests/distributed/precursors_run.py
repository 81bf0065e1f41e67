"""torchrun script (2 CPU processes, gloo): PrecursorMonitor with every early action, under DDP or FSDP2.

Usage: ``torchrun ... precursors_run.py OUT_DIR STRATEGY`` with ``STRATEGY`` ``ddp`` or ``fsdp``
(StableFSDPStrategy). Three fits in the same processes, then :func:`sharded_scaling`; each rank writes
``OUT_DIR/rank{R}.json``:

* ``straight``: ``STEPS`` steps, a checkpoint after ``SAVE_AT``;
* ``resumed``: a fresh module resumed from that checkpoint to ``STEPS``;
* ``fault``: as ``straight``, but rank 1's gradients are multiplied by 100 after the gradient reduction at step
  ``FAULT`` (before any callback sees them), on that rank only.
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
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from lightning_stability import TrainingHealthMonitor
from lightning_stability.precursors import HeadBlocks, LRBackoff, PrecursorMonitor, scale_heads_
from lightning_stability.strategies.fsdp import StableFSDPStrategy
from tests.distributed.fsdp_common import full_weights
from tests.helpers import exit_worker, quiet_trainer
from tests.precursors.tiny_lm import fresh

STEPS, SAVE_AT, FAULT, SPIKE = 12, 6, 9, 10
BATCHES = 6  # per epoch: the checkpoint is at an epoch's end
WORLD = 2


def monitor() -> PrecursorMonitor:
    """Every action, each set to act in these 12 steps (the test checks that each did)."""
    return PrecursorMonitor(
        qk_clip=0.3,
        update_clip=1.0,
        lr_backoff=LRBackoff("update_ratio", threshold=0.005, efficiency=0.9),  # acts once the share falls under 0.9
        reset_moments=True,
        log_every_n_steps=2,
    )


def module(batch_size: int) -> Any:
    model = fresh(lr=3e-2, batches=BATCHES, batch_size=batch_size, bias=False)
    model.spikes = {SPIKE: 1e4}  # a loss spike the health monitor lets through (response="warn"): a moment reset
    return model


class Record(pl.Callback):
    """The logged stability metrics after every batch (host reads: tests only)."""

    def __init__(self) -> None:
        self.metrics: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.metrics.append({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("stability/")})


class CorruptRank1(pl.Callback):
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if trainer.global_step == FAULT and trainer.global_rank == 1:
            with torch.no_grad():
                for p in pl_module.parameters():
                    if p.grad is not None:
                        p.grad.mul_(100.0)


def fit(name: str, out: Path, extra: list[pl.Callback], ckpt_path: Path | None = None) -> dict[str, Any]:
    strategy: Any = "ddp" if sys.argv[2] == "ddp" else StableFSDPStrategy()
    watched, record = monitor(), Record()
    health = TrainingHealthMonitor(response="warn", warmup_steps=5, report=False)
    trainer = quiet_trainer(
        max_steps=STEPS,
        devices=WORLD,
        strategy=strategy,
        callbacks=[*extra, health, watched, record],
        enable_checkpointing=any(isinstance(cb, ModelCheckpoint) for cb in extra),
    )
    model = module(batch_size=4 // WORLD)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, ckpt_path=ckpt_path)
    weights = full_weights(model)
    return {
        "name": name,
        "state": watched.state_dict(),
        "metrics": record.metrics,
        "weights": {k: v.flatten().tolist() for k, v in weights.items()},
        "spikes": [e["step"] for e in health.events if e["kind"] == "spike"],
    }


def sharded_scaling() -> dict[str, bool]:
    """QK-clip's head scaling on FSDP2-style shards (``Shard(0)``, uneven) against the same on the whole tensor:
    blocks across the shard boundary, along the sharded dim and along the other one (GPT-2's Conv1D)."""
    mesh = init_device_mesh("cpu", (WORLD,))
    factors = torch.tensor([0.5, 0.25])
    cases = {"rows across shards": ((7, 4), 0, 2, 2), "columns": ((5, 6), 1, 1, 2), "bias": ((3,), 0, 1, 1)}
    equal = {}
    for case, (shape, axis, start, head_dim) in cases.items():
        whole = torch.randn(shape, generator=torch.Generator().manual_seed(0))
        expected = whole.clone()
        scale_heads_(HeadBlocks(expected, axis, start), factors, head_dim)
        sharded = distribute_tensor(whole.clone(), mesh, [Shard(0)])
        scale_heads_(HeadBlocks(sharded, axis, start), factors, head_dim)
        equal[case] = torch.equal(sharded.full_tensor(), expected)
    return equal


def main() -> None:
    out = Path(sys.argv[1])
    warnings.simplefilter("ignore")
    ckpt = ModelCheckpoint(dirpath=out / "ckpt", every_n_train_steps=SAVE_AT, save_top_k=-1)
    results = [fit("straight", out, [ckpt])]
    saved = next((out / "ckpt").glob(f"*step={SAVE_AT}*"))
    results.append(fit("resumed", out, [], ckpt_path=saved))
    results.append(fit("fault", out, [CorruptRank1()]))
    rank = int(os.environ["RANK"])
    (out / f"rank{rank}.json").write_text(json.dumps({"runs": results, "sharded_scaling": sharded_scaling()}))
    exit_worker()


if __name__ == "__main__":
    main()
