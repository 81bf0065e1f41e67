"""Run under torchrun (2 CPU processes, gloo; third argument: the strategy, ``ddp`` or ``fsdp``) with StepReplay.

The next arguments are faults, each one fit in turn in the same process group: ``none``; ``flip`` — an exponent bit
flipped in the last layer's output on rank 1 at step FLIP; ``failing`` — the same on rank 1 at FLIP - 2, FLIP - 1
and FLIP (a failing device); ``after_allreduce`` — rank 1's gradients made non-finite at step FLIP after DDP averaged
them; ``poison`` — sample POISONED of the dataset is NaN; ``poison_in_order`` — the same, the samples in order (no
shuffling), so the quarantined batch comes back empty in later epochs; ``device`` — rank 1's device makes the last
layer's output NaN at step FLIP in every forward it runs there (the original, the replays, and any other rank's
micro-batches); ``device_random`` — the same device adds a spike that differs at each forward. Each rank writes
``OUT_DIR/rank{R}.json``: for each fault, what it trained on and decided; a fault that saves checkpoints saves them
in ``OUT_DIR/<fault>/ckpts``.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, DistributedSampler

from lightning_stability import StableCheckpoint, StableFSDPStrategy, StepLedger, TrainingHealthMonitor
from lightning_stability.replay import BitFlip, FailingDeviceError, PoisonedSamples, StepReplay
from tests.helpers import exit_worker, quiet_trainer
from tests.replay.test_replay import IndexedData, Model, Trained

FLIP, POISONED = 9, 17


class DistributedModel(Model):
    def __init__(self, data: Any, fault: str) -> None:
        super().__init__(data)
        self.fault = fault

    def train_dataloader(self) -> DataLoader:
        if self.fault == "poison_in_order":  # Lightning's own DistributedSampler would shuffle the training samples
            return DataLoader(self.data, batch_size=self.bs, sampler=DistributedSampler(self.data, shuffle=False))
        return DataLoader(self.data, batch_size=self.bs, shuffle=True)  # Lightning adds the DistributedSampler


class CorruptRank1AfterAllReduce(pl.Callback):
    """Rank 1's gradients made non-finite after DDP averaged them (placed before the package's callbacks)."""

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, opt: Any) -> None:
        if trainer.global_step == FLIP and trainer.global_rank == 1:
            for p in pl_module.parameters():
                p.grad.mul_(float("inf"))


class BadDevice:
    """Rank 1's device at step FLIP: every forward of the hooked layer there goes wrong, the same way each time
    (NaN) or differently (a spike that grows with each forward), whatever micro-batch it runs."""

    def __init__(self, model: pl.LightningModule, same: bool) -> None:
        self.model, self.same, self.calls = model, same, 0

    def __call__(self, _module: nn.Module, _inputs: Any, output: Tensor) -> Tensor | None:
        if self.model.global_rank != 1 or self.model.trainer.global_step != FLIP or not torch.is_grad_enabled():
            return None
        self.calls += 1
        return output * float("nan") if self.same else output + 1e3 * self.calls


def run(out_dir: str, strategy_name: str, fault: str) -> dict[str, Any]:
    """One fit with ``fault``; what this rank trained on and decided."""
    pl.seed_everything(0)
    inner = IndexedData(64)
    data: Any = PoisonedSamples(inner, [POISONED]) if fault.startswith("poison") else inner
    model = DistributedModel(data, fault)
    flip = BitFlip(model, "net.5", step=FLIP, rank=1) if fault == "flip" else None
    if fault == "failing":  # the same fault three times on rank 1
        flip = BitFlip(model, "net.5", step=[FLIP - 2, FLIP - 1, FLIP], rank=1)
    strategy: Any = StableFSDPStrategy() if strategy_name == "fsdp" else "ddp"
    replay = StepReplay(quarantine_file=None)
    monitor = TrainingHealthMonitor(response="skip", warmup_steps=4, report=False)
    seen = Trained()
    callbacks: list[pl.Callback] = [monitor, replay, seen]
    if fault.startswith("device"):
        model.net[5].register_forward_hook(BadDevice(model, fault == "device"))
    if fault == "after_allreduce":
        callbacks.insert(0, CorruptRank1AfterAllReduce())
    if fault == "failing" or fault.startswith("device"):
        callbacks.append(StableCheckpoint(dirpath=os.path.join(out_dir, fault, "ckpts"), every_n_train_steps=100))
    trainer = quiet_trainer(
        max_epochs=3,
        devices=2,
        strategy=strategy,
        callbacks=callbacks,
        enable_checkpointing=True,
        use_distributed_sampler=fault != "poison_in_order",
    )
    stopped: dict[str, Any] = {}
    try:
        trainer.fit(model)
    except FailingDeviceError as err:
        stopped = {"rank": err.rank, "host": err.host, "steps": err.steps, "checkpoint": err.checkpoint}
    return {
        "stopped": stopped,
        "events": [e for e in StepLedger.of(trainer).events if e.get("kind") == "replay"],
        "flipped": flip.flipped if flip is not None else [],
        "quarantined": sorted(replay.quarantine.indices),
        "loaded": inner.loaded,
        "counts": StepLedger.of(trainer).record_of().counts.tolist(),
        "rows": seen.rows,
        "weights": [
            p.detach().full_tensor().flatten().tolist() if hasattr(p, "full_tensor") else p.detach().flatten().tolist()
            for p in model.parameters()
        ],
    }


if __name__ == "__main__":
    out_dir, strategy_name, faults = sys.argv[1], sys.argv[2], sys.argv[3:]
    warnings.simplefilter("ignore")
    results = {fault: run(out_dir, strategy_name, fault) for fault in faults}
    with open(os.path.join(out_dir, f"rank{os.environ['RANK']}.json"), "w") as f:
        json.dump(results, f)
    exit_worker()
