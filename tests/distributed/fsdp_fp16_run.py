"""torchrun script: LossScaleTuner under StableFSDPStrategy(mixed_precision=True), 2 gloo processes on the CPU.

Usage: ``torchrun --nproc_per_node=2 fsdp_fp16_run.py OUT_DIR``; writes ``OUT_DIR/rank{R}.json`` (one
result per run) and, from rank 0, ``OUT_DIR/{run}.weights.pt`` (the whole weights at the end).

At the chosen steps, rank 1 alone writes an inf into its local shard of one gradient, after backward
(the reduce-scatter is done) and before the scaler unscales. Each run records, per step and rank: whether
this rank's local gradients held a non-finite value, whether its parameter shards and its optimizer state
changed, the loss scale, and a digest of its local parameters and optimizer state.

* ``full_*``: ``sharding="full"`` (mesh of 2, ``Shard(0)``). torch's DTensor dispatch of the
  unscale op already max-reduces ``found_inf`` over the shard dimension, so even torch's plain
  ``GradScaler`` skips on both ranks here (run ``full_torch``, recorded to show it).
* ``hybrid_*``: ``sharding="hybrid", device_mesh=(2, 1)``: two replicas of one shard each, placements
  ``(Replicate(), Shard(0))``. The DTensor dispatch reduces over the size-1 shard dimension only, so the
  cross-rank all-reduce of :class:`~lightning_stability.amp.scaler.TunedGradScaler` is what makes rank 0
  skip; ``hybrid_torch`` (torch's plain ``GradScaler``) is the control whose replicas diverge, and
  ``hybrid_default`` the strategy's default ``ShardedGradScaler`` (which all-reduces its flag too).
* ``syncs_*``: host syncs per step, the tuner against torch's ``GradScaler``.
* ``resume_*``: a sharded checkpoint of the tuner mid-hysteresis and mid-growth, resumed.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_stability.amp.callback import LossScaleTuner
from lightning_stability.ledger.step_ledger import StepLedger
from lightning_stability.strategies.fsdp import StableFSDPStrategy
from tests.distributed.fsdp_common import TinyLM, full_weights
from tests.helpers import StepSyncCounter, SyncCounter, exit_worker

INF_RANK = 1
INF_STEP = 3
STEPS = 6
RESUME_INF_STEPS = (1, 2, 5)
RESUME_STEPS = 8
RESUME_AT = 5  # the checkpoint after 5 steps (5 epochs of one batch)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _local_grads(module: pl.LightningModule) -> list[torch.Tensor]:
    return [_local(p.grad) for p in module.parameters() if p.grad is not None]


class InjectInf(pl.Callback):
    """On rank ``INF_RANK`` at ``steps``: an inf in this rank's local shard of the first gradient that has one.

    Runs in ``on_after_backward``: backward (and with it FSDP's reduce-scatter) is over, the gradients are
    still scaled. Records, on every rank and step, whether this rank's local gradients hold a non-finite
    value afterwards.
    """

    def __init__(self, steps: tuple[int, ...], record: bool = True) -> None:
        self.steps = steps
        self.record = record
        self.local_nonfinite: list[bool] = []

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_rank == INF_RANK and trainer.global_step in self.steps:
            local = next(g for g in _local_grads(pl_module) if g.numel())
            local.view(-1)[0] = math.inf
        if self.record:  # a host sync: off when counting them
            self.local_nonfinite.append(any(not bool(torch.isfinite(g).all()) for g in _local_grads(pl_module)))


class PlainScaler(pl.Callback):
    """Control runs: put torch's plain ``GradScaler`` (no cross-rank reduction of its own) in the plugin."""

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        trainer.precision_plugin.scaler = torch.amp.GradScaler("cpu", init_scale=256.0)  # type: ignore[attr-defined]


def _optimizer_tensors(trainer: pl.Trainer) -> list[torch.Tensor]:
    optimizer = trainer.optimizers[0]
    out = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            for key in sorted(optimizer.state.get(p, {})):
                value = optimizer.state[p][key]
                if isinstance(value, torch.Tensor):
                    out.append(_local(value).detach().clone())
    return out


def _digest(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class StepRecord(pl.Callback):
    """Per step and rank: parameter shards moved, optimizer state changed, scale, digests, AdamW step counts."""

    def __init__(self) -> None:
        self.moved: list[bool] = []
        self.opt_changed: list[bool] = []
        self.scales: list[float] = []
        self.param_digests: list[str] = []
        self.opt_digests: list[str] = []
        self.adam_steps: list[list[float]] = []
        self._params: list[torch.Tensor] = []
        self._opt: list[torch.Tensor] = []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self._params = [_local(p).detach().clone() for p in pl_module.parameters()]
        self._opt = _optimizer_tensors(trainer)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        params = [_local(p).detach() for p in pl_module.parameters()]
        opt = _optimizer_tensors(trainer)
        self.moved.append(any(not torch.equal(a, b) for a, b in zip(self._params, params, strict=True)))
        self.opt_changed.append(
            len(opt) != len(self._opt) or any(not torch.equal(a, b) for a, b in zip(self._opt, opt, strict=True))
        )
        self.scales.append(float(trainer.precision_plugin.scaler.get_scale()))  # type: ignore[attr-defined]
        self.param_digests.append(_digest(params))
        self.opt_digests.append(_digest(opt))
        optimizer = trainer.optimizers[0]
        self.adam_steps.append(sorted({float(s["step"]) for s in optimizer.state.values()}))


def tuner(**kwargs: Any) -> LossScaleTuner:
    defaults: dict[str, Any] = dict(init_scale=256, hysteresis=1, min_scale=None, fit_start_checks=False)
    return LossScaleTuner(**{**defaults, **kwargs})


def run(
    name: str,
    out_dir: Path,
    *,
    strategy: dict[str, Any],
    scaler: pl.Callback,
    inf_steps: tuple[int, ...],
    max_steps: int,
    resume: Path | None = None,
    checkpoint_dir: Path | None = None,
    fused: bool = False,
    count_syncs: bool = False,
) -> dict[str, Any]:
    pl.seed_everything(0, verbose=False)
    # n=8, global batch 8: one batch per epoch, so every step (resumed or not) sees the same data
    module = TinyLM(batch_size=8 // int(os.environ["WORLD_SIZE"]), n=8, fused=fused)
    inject, record = InjectInf(inf_steps, record=not count_syncs), StepRecord()
    callbacks: list[pl.Callback] = [scaler, inject, record]
    sync_counter = SyncCounter()
    boundaries = StepSyncCounter(sync_counter)
    if count_syncs:  # per step, with nothing else that reads values on the host
        callbacks = [boundaries, scaler, inject]
    if checkpoint_dir is not None:
        callbacks.append(
            ModelCheckpoint(dirpath=checkpoint_dir, save_top_k=-1, every_n_epochs=1, save_on_train_epoch_end=True)
        )
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=StableFSDPStrategy(mixed_precision=True, **strategy),
        max_steps=max_steps, max_epochs=-1, callbacks=callbacks, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=checkpoint_dir is not None, use_distributed_sampler=False,
        log_every_n_steps=2,
    )  # fmt: skip
    if count_syncs:
        with sync_counter:
            trainer.fit(module, ckpt_path=resume)
    else:
        trainer.fit(module, ckpt_path=resume)
    weights = full_weights(module)
    if dist.get_rank() == 0:
        torch.save(weights, out_dir / f"{name}.weights.pt")
    plugin_scaler = trainer.precision_plugin.scaler  # type: ignore[attr-defined]
    ledger = StepLedger.of(trainer)
    return {
        "scaler": type(plugin_scaler).__name__,
        "scaler_state": plugin_scaler.state_dict(),
        "precision": str(trainer.precision),
        "placements": str(next(module.parameters()).placements),
        "local_nonfinite": inject.local_nonfinite,
        "moved": record.moved,
        "opt_changed": record.opt_changed,
        "scales": record.scales,
        "param_digests": record.param_digests,
        "opt_digests": record.opt_digests,
        "adam_steps": record.adam_steps,
        "ledger_counts": ledger.record_of().counts.tolist(),
        "global_step": trainer.global_step,
        "syncs_per_step": boundaries.per_step,
    }


def main() -> None:
    out_dir = Path(sys.argv[1])
    full: dict[str, Any] = {}
    hybrid: dict[str, Any] = {"sharding": "hybrid", "device_mesh": (2, 1)}
    one_inf: dict[str, Any] = {"inf_steps": (INF_STEP,), "max_steps": STEPS}
    # resume: growth_interval 4, hysteresis 3; rank 1's infs at steps 1 and 2 leave one unit of hysteresis and a
    # growth count of 2 in the checkpoint after step 4; the inf at step 5 then backs the scale off
    resume_tuner: dict[str, Any] = {"growth_interval": 4, "hysteresis": 3}
    resume: dict[str, Any] = {"strategy": full, "inf_steps": RESUME_INF_STEPS, "max_steps": RESUME_STEPS}
    ckpts = out_dir / "ckpts"
    saved = ckpts / f"epoch={RESUME_AT - 1}-step={RESUME_AT}.ckpt"
    specs: dict[str, tuple[Callable[[], pl.Callback], dict[str, Any]]] = {
        "full_tuned": (tuner, {"strategy": full, **one_inf}),
        "hybrid_tuned": (tuner, {"strategy": hybrid, **one_inf}),
        "hybrid_tuned_fused": (tuner, {"strategy": hybrid, "fused": True, **one_inf}),
        "hybrid_torch": (PlainScaler, {"strategy": hybrid, **one_inf}),
        "hybrid_default": (pl.Callback, {"strategy": hybrid, **one_inf}),  # the strategy's own ShardedGradScaler
        "full_torch": (PlainScaler, {"strategy": full, **one_inf}),
        # host syncs per step: the tuner against torch's GradScaler (on the CPU the strategy's default
        # ShardedGradScaler reads the flag and the growth tracker with .item() in update(): no fair baseline)
        "syncs_torch": (PlainScaler, {"strategy": full, "count_syncs": True, **one_inf}),
        "syncs_tuned": (tuner, {"strategy": full, "count_syncs": True, **one_inf}),
        "resume_uninterrupted": (lambda: tuner(**resume_tuner), {"checkpoint_dir": ckpts, **resume}),
        "resumed": (lambda: tuner(**resume_tuner), {"resume": saved, **resume}),
    }
    results = {name: run(name, out_dir, scaler=make(), **kwargs) for name, (make, kwargs) in specs.items()}
    results["resumed"]["checkpoint"] = str(saved)
    (out_dir / f"rank{dist.get_rank()}.json").write_text(json.dumps(results))
    dist.barrier()


if __name__ == "__main__":
    main()
    exit_worker()
