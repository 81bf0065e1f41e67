"""Run under torchrun (2 CPU processes, gloo): a lasting spike on rank 1 only, no rollback from memory allowed, so
``TrainingHealthMonitor`` goes back to ``StableCheckpoint``'s newest healthy checkpoint before the damage.

Usage: ``rollback_to_disk_script.py OUT_DIR MODE``, MODE ``ddp`` (``AtomicCheckpointIO`` files; then a reference
run skipping the same updates) or ``fsdp`` (``StableFSDPStrategy``, sharded checkpoints). Each rank writes
``OUT_DIR/rank{R}.json`` (outcomes, counters, events, the listed checkpoints) and ``OUT_DIR/rank{R}.pt`` (the
weights and optimizer state right after the rollback, and at the end; whole tensors under FSDP, on rank 0).
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_stability import AtomicCheckpointIO, StableCheckpoint, StepLedger, TrainingHealthMonitor
from lightning_stability.checkpoint.ring import FILE_NAME
from lightning_stability.strategies import StableFSDPStrategy
from lightning_stability.strategies.fsdp_checkpoint import optimizer_state
from tests.distributed.fsdp_common import TinyLM, full_weights
from tests.health.test_health import SkipLabels
from tests.helpers import TinyModule, exit_worker, quiet_trainer

out_dir, mode = Path(sys.argv[1]), sys.argv[2]
warnings.simplefilter("ignore")
SPIKES, ROLLBACK_AT, STEPS = (11, 12), 13, 24


class SpikeOnRank1:
    """Multiplies rank 1's loss by 100 at SPIKES (the mean over ranks spikes, and so does the reduced norm)."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)  # type: ignore[misc]
        spike = self.global_step in SPIKES and self.global_rank == 1  # type: ignore[attr-defined]
        return loss * 100 if spike else loss


class SpikyMLP(SpikeOnRank1, TinyModule):
    pass


class SpikyLM(SpikeOnRank1, TinyLM):
    pass


def cloned(tree: Any) -> Any:
    """A copy of nested dicts of tensors (a state dict shares the optimizer's own tensors, which later steps change)."""
    if isinstance(tree, dict):
        return {k: cloned(v) for k, v in tree.items()}
    return tree.detach().clone() if isinstance(tree, torch.Tensor) else tree


def state(trainer: pl.Trainer, module: pl.LightningModule) -> dict[str, Any]:
    """The whole weights and optimizer state (every rank calls; under FSDP rank 0 gets them)."""
    optimizer = trainer.optimizers[0]
    if mode == "fsdp":
        return cloned({"weights": full_weights(module), "optim": optimizer_state(module, optimizer, full=True)})
    return cloned({"weights": module.state_dict(), "optim": {"state": optimizer.state_dict()["state"]}})


class AfterRollback(pl.Callback):
    """The state right after the monitor's on_before_optimizer_step at ROLLBACK_AT (it runs after the monitor)."""

    def __init__(self) -> None:
        self.state: dict[str, Any] = {}

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if trainer.global_step == ROLLBACK_AT:
            self.state = state(trainer, pl_module)


def fit(callbacks: list[pl.Callback], **kwargs: Any) -> tuple[pl.Trainer, pl.LightningModule]:
    pl.seed_everything(0)
    if mode == "fsdp":
        module: pl.LightningModule = SpikyLM(n=160)
        kwargs.setdefault("strategy", StableFSDPStrategy())
    else:
        module = SpikyMLP(n=512)
        kwargs.setdefault("strategy", "ddp")
    trainer = quiet_trainer(max_steps=STEPS, devices=2, default_root_dir=out_dir, callbacks=callbacks, **kwargs)
    trainer.fit(module)
    return trainer, module


monitor = TrainingHealthMonitor(
    response="rollback",
    warmup_steps=5,
    snapshot_every=4,
    skip_batches=3,
    max_rollbacks=0,
    log_every_n_steps=2,
    report=False,
)
after = AfterRollback()
ring = StableCheckpoint(dirpath=out_dir / "ckpts", every_n_train_steps=1, keep=100)
plugins = [AtomicCheckpointIO()] if mode == "ddp" else []
trainer, module = fit([monitor, after, ring], enable_checkpointing=True, plugins=plugins)
final = state(trainer, module)
rank = trainer.global_rank
result: dict[str, Any] = {
    "outcomes": [int(o) for o in monitor.history.series["outcome"]],
    "rollbacks": float(trainer.callback_metrics["stability/rollbacks"]),
    "disk": [monitor.rollback.disk_rollbacks, monitor.rollback.disk_steps],
    "events": [{k: e[k] for k in ("step", "to_step", "checkpoint") if k in e} for e in StepLedger.of(trainer).events],
    "counts": StepLedger.of(trainer).record_of().counts.tolist(),
    "listed": sorted(e["step"] for e in json.loads((out_dir / "ckpts" / FILE_NAME).read_text())["checkpoints"]),
}
saved: dict[str, Any] = {"after_rollback": after.state, "final": final}
if mode == "ddp":
    # the same run without StableCheckpoint or the monitor, its updates 10 to 16 skipped
    _, reference = fit([SkipLabels(set(range(10, 17)))])
    saved["reference"] = {k: v.detach().clone() for k, v in reference.state_dict().items()}
torch.save(saved, out_dir / f"rank{rank}.pt")
with open(out_dir / f"rank{rank}.json", "w") as f:
    json.dump(result, f)
exit_worker()
