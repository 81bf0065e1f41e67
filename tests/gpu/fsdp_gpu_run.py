"""torchrun script (CUDA): StableFSDPStrategy with backend="fairscale" and with the native backend on GPUs.

Usage: ``torchrun --nproc_per_node=N fsdp_gpu_run.py OUT_DIR [native] [fairscale]`` (default: both); writes
``OUT_DIR/rank{R}.json``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist

from lightning_stability.grad_norm import GradientNormMonitor
from lightning_stability.strategies.fsdp import StableFSDPStrategy
from tests.distributed.fsdp_common import TinyLM
from tests.helpers import QUIET


def whole_state(trainer: pl.Trainer) -> dict[str, torch.Tensor]:
    """The model state as whole fp32 CPU tensors (every rank must call)."""
    state = trainer.strategy.lightning_module_state_dict()
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).float().cpu() for k, v in state.items()}


class StartState(pl.Callback):
    """The whole model state when training starts (after a checkpoint was restored)."""

    def __init__(self) -> None:
        self.state: dict[str, torch.Tensor] = {}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.state = whole_state(trainer)


def fit(strategy: dict[str, Any], max_epochs: int, resume: str | None = None, **trainer_kwargs: Any) -> dict[str, Any]:
    pl.seed_everything(0, verbose=False)
    module = TinyLM(batch_size=8 // int(os.environ["WORLD_SIZE"]))
    start = StartState()
    trainer = pl.Trainer(
        accelerator="gpu",
        devices=int(os.environ["LOCAL_WORLD_SIZE"]),
        strategy=StableFSDPStrategy(**strategy),
        max_epochs=max_epochs,
        enable_checkpointing=False,
        use_distributed_sampler=False,
        callbacks=[start, *trainer_kwargs.pop("callbacks", [])],
        **QUIET,
        **trainer_kwargs,
    )
    trainer.fit(module, ckpt_path=resume)
    losses = torch.stack(module.losses).float()
    dist.all_reduce(losses)
    final = whole_state(trainer)
    return {
        "trainer": trainer,
        "losses": (losses / dist.get_world_size()).tolist(),
        "start": start.state,
        "final": final,
    }


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def main() -> None:
    out = Path(sys.argv[1])
    backends = sys.argv[2:] or ["native", "fairscale"]
    results: dict[str, Any] = {}
    if "native" in backends:
        native(out, results)
    if "fairscale" in backends:
        fairscale(out, results)
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(results))
    dist.barrier()


def fairscale(out: Path, results: dict[str, Any]) -> None:
    """FairScale's FSDP with its own keywords; Trainer clipping goes through FairScale's clip_grad_norm_."""
    # FairScale's FSDP with its own keywords; Trainer clipping goes through FairScale's clip_grad_norm_
    seed_keywords = {"backend": "fairscale", "mixed_precision": True, "flatten_parameters": True, "cpu_offload": True}
    first = fit(seed_keywords, max_epochs=1, gradient_clip_val=0.5)
    first["trainer"].save_checkpoint(out / "fairscale.ckpt")
    resumed = fit(seed_keywords, max_epochs=2, resume=str(out / "fairscale.ckpt"), gradient_clip_val=0.5)
    results["fairscale"] = {
        "losses": first["losses"] + resumed["losses"],
        "resumed_exactly": same(resumed["start"], first["final"]),
        "scaler": type(first["trainer"].precision_plugin.scaler).__name__,
    }


def native(out: Path, results: dict[str, Any]) -> None:
    """The native backend on GPUs (NCCL): bf16 compute, fp32 reduction, global-norm clipping, sharded checkpoint."""
    keywords = {"mixed_precision": "bf16-mixed"}
    first = fit(keywords, max_epochs=1, callbacks=[GradientNormMonitor(max_norm=0.5)])
    first["trainer"].save_checkpoint(out / "native.ckpt")
    resumed = fit(
        keywords, max_epochs=2, resume=str(out / "native.ckpt"), callbacks=[GradientNormMonitor(max_norm=0.5)]
    )
    results["native"] = {
        "losses": first["losses"] + resumed["losses"],
        "resumed_exactly": same(resumed["start"], first["final"]),
        "sharded": (out / "native.ckpt").is_dir(),
    }


if __name__ == "__main__":
    main()
