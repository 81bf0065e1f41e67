"""torchrun script: run the Lightning fits described in a JSON spec under StableFSDPStrategy (gloo, CPU).

Usage: ``torchrun ... fsdp_run.py OUT_DIR SPEC_JSON``. ``SPEC_JSON`` is a list of runs, executed in
order in the same processes; each rank writes ``OUT_DIR/rank{R}.json`` with one result per run and rank
0 saves the whole weights of run ``name`` to ``OUT_DIR/{name}.weights.pt``.
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

from lightning_stability.errors import StabilityConfigError
from lightning_stability.grad_norm import GradientNormMonitor
from lightning_stability.ledger.step_ledger import StepLedger
from lightning_stability.strategies.fsdp import StableFSDPStrategy
from tests.distributed import fsdp_common
from tests.distributed.fsdp_common import ListLogger, full_weights
from tests.helpers import StepSyncCounter, SyncCounter, exit_worker

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class CollectiveCounter:
    """Counts reduce-scatters issued through torch.distributed (FSDP2 calls them by module attribute) and
    records the dtypes they reduce in."""

    def __init__(self) -> None:
        self.count = 0
        self.dtypes: set[str] = set()
        self._saved: dict[str, Any] = {}

    def __enter__(self) -> CollectiveCounter:
        for name in ("reduce_scatter_single", "reduce_scatter_tensor"):
            original = getattr(dist, name)
            self._saved[name] = original

            def counting(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
                self.count += 1
                reduced = kwargs.get("input", args[1] if len(args) > 1 else None)
                if isinstance(reduced, torch.Tensor):
                    self.dtypes.add(str(reduced.dtype))
                return _original(*args, **kwargs)

            setattr(dist, name, counting)
        return self

    def __exit__(self, *exc: Any) -> None:
        for name, original in self._saved.items():
            setattr(dist, name, original)


class Recorder(pl.Callback):
    """Records, per optimizer step, the norm of this rank's local gradient shard (before any clipping),
    the loss scale, and the whole weights when training starts (after a checkpoint was restored)."""

    def __init__(self) -> None:
        self.local_norms: list[float] = []
        self.scales: list[float] = []
        self.start_weights: dict[str, torch.Tensor] | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.start_weights = full_weights(pl_module)

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
        self.local_norms.append(float(torch.linalg.vector_norm(torch.stack([g.float().norm() for g in local]))))

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if scaler is not None:
            self.scales.append(float(scaler.get_scale()))


def strategy_from(spec: dict[str, Any]) -> StableFSDPStrategy:
    kwargs = dict(spec)
    if isinstance(kwargs.get("mixed_precision"), str) and kwargs["mixed_precision"] in _DTYPES:
        kwargs["mixed_precision"] = _DTYPES[kwargs["mixed_precision"]]
    if "wrap_classes" in kwargs:  # class names, from torch.nn or the test model
        names = kwargs.pop("wrap_classes")
        kwargs["auto_wrap_policy"] = {getattr(torch.nn, n, None) or getattr(fsdp_common, n) for n in names}
    if "device_mesh" in kwargs:
        kwargs["device_mesh"] = tuple(kwargs["device_mesh"])
    return StableFSDPStrategy(**kwargs)


def run(spec: dict[str, Any], out_dir: Path) -> dict[str, Any]:
    pl.seed_everything(spec.get("seed", 0), verbose=False)
    model_kwargs = {"batch_size": 8 // int(os.environ["WORLD_SIZE"]), **spec.get("model", {})}  # global batch 8
    module = getattr(fsdp_common, spec.get("model_class", "TinyLM"))(**model_kwargs)
    if spec.get("inject_inf_at"):
        module.inject_inf_at = tuple(spec["inject_inf_at"])
    recorder = Recorder()
    logger = ListLogger()
    callbacks: list[pl.Callback] = [recorder]
    if spec.get("monitor") is not None:
        callbacks.append(GradientNormMonitor(log_every_n_steps=1, **spec["monitor"]))
    trainer_kwargs: dict[str, Any] = dict(
        accelerator="cpu",
        devices=int(os.environ["LOCAL_WORLD_SIZE"]),
        num_nodes=int(os.environ["WORLD_SIZE"]) // int(os.environ["LOCAL_WORLD_SIZE"]),
        logger=logger,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        use_distributed_sampler=False,
        log_every_n_steps=1,
    )
    trainer_kwargs.update(spec.get("trainer", {}))
    trainer = pl.Trainer(strategy=strategy_from(spec.get("strategy", {})), callbacks=callbacks, **trainer_kwargs)
    compute_dtypes: set[str] = set()  # what the first block's first MLP layer computes in
    module.model.blocks[0].mlp[0].register_forward_hook(lambda m, i, o: compute_dtypes.add(str(o.dtype)))
    counter, sync_counter = CollectiveCounter(), SyncCounter()
    boundaries = StepSyncCounter(sync_counter)
    if spec.get("count_syncs"):
        trainer.callbacks.insert(0, boundaries)
    with counter:
        if spec.get("count_syncs"):
            with sync_counter:
                trainer.fit(module, ckpt_path=spec.get("resume"))
        else:
            trainer.fit(module, ckpt_path=spec.get("resume"))
    if spec.get("save"):
        trainer.save_checkpoint(spec["save"])
    local = torch.stack(module.losses) if module.losses else torch.zeros(0)
    dist.all_reduce(local, op=dist.ReduceOp.SUM)
    weights = full_weights(module)
    rank = dist.get_rank()
    if rank == 0:
        torch.save({"final": weights, "start": recorder.start_weights}, out_dir / f"{spec['name']}.weights.pt")
    ledger = StepLedger.of(trainer)
    return {
        "losses": (local / dist.get_world_size()).tolist(),
        "metrics": logger.history,
        "local_norms": recorder.local_norms,
        "scales": recorder.scales,
        "reduce_scatters": counter.count,
        "reduce_dtypes": sorted(counter.dtypes),
        "compute_dtypes": sorted(compute_dtypes),
        "syncs_per_step": boundaries.per_step,
        "ledger_steps": ledger.record_of().steps,
        "ledger_counts": ledger.record_of().counts.tolist(),
        "global_step": trainer.global_step,
        "block_calls": module.model.blocks[0].calls,
        "scaler": type(trainer.precision_plugin.scaler).__name__,
        "param_dtypes": sorted({str(p.dtype) for p in module.parameters()}),
        "grad_dtypes": sorted({str(p.grad.dtype) for p in module.parameters() if p.grad is not None}),
        "precision": str(trainer.precision),
        "mesh_shape": list(trainer.strategy.device_mesh.shape),
        "mesh_dims": list(trainer.strategy.device_mesh.mesh_dim_names or ()),
        "placements": str(next(module.parameters()).placements),
    }


def expect_error(spec: dict[str, Any]) -> dict[str, Any]:
    """Run a fit that must fail at setup with a StabilityConfigError; return its message."""
    try:
        run(spec, Path("."))
    except StabilityConfigError as err:
        return {"error": str(err)}
    return {"error": None}


def main() -> None:
    out_dir = Path(sys.argv[1])
    specs = json.loads(Path(sys.argv[2]).read_text())
    results = {spec["name"]: expect_error(spec) if spec.get("expect_error") else run(spec, out_dir) for spec in specs}
    (out_dir / f"rank{dist.get_rank()}.json").write_text(json.dumps(results))
    dist.barrier()


if __name__ == "__main__":
    main()
    exit_worker()
