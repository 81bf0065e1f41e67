"""torchrun script: a GPT-style model under Lightning's own ``ModelParallelStrategy`` with our callbacks.

Usage: ``torchrun --nproc_per_node=DP*TP tensor_parallel_script.py OUT_DIR DP TP [lightning|stable]``; writes
``OUT_DIR/rank{R}.json``
(per-step norms and logged metrics) and, on rank 0, ``OUT_DIR/final.pt`` (the whole weights after training).
``lightning`` (default) runs Lightning's ``ModelParallelStrategy`` (``configure_model`` applies TP and FSDP2),
``stable`` our ``StableFSDPStrategy(tensor_parallel=TP)`` (``configure_model`` applies TP only; the strategy
shards). ``python tensor_parallel_script.py OUT_DIR 1 1`` is the one-process reference on the same global batches.

The model carries every hazard of gradient norms under tensor parallelism: a tied embedding / LM head (one
tensor, counted once), a LayerNorm left replicated across the tensor-parallel ranks, a ``SequenceParallel``
final norm (its gradients ``Partial`` until the optimizer reduces them), a column/row-parallel MLP (which FSDP2
shards on the same dim: ``_StridedShard``) and, under TP alone, plain parameters next to DTensors.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_stability import GradientNormMonitor, StepLedger, TrainingHealthMonitor
from lightning_stability.ledger.callback import LedgerCallback
from lightning_stability.norms import local_tensor
from tests.helpers import exit_worker

VOCAB, DIM, SEQ, GLOBAL_BATCH = 32, 16, 8, 8
STEPS = int(os.environ.get("TP_STEPS", 6))  # benchmarks/tensor_parallel.py runs longer
MAX_NORM = 0.5  # below the norms of this model: every step clips


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)  # tied with the LM head below
        self.ln = nn.LayerNorm(DIM)  # left replicated by the TP plan
        self.fc1 = nn.Linear(DIM, 4 * DIM)  # ColwiseParallel
        self.fc2 = nn.Linear(4 * DIM, DIM)  # RowwiseParallel, output sharded on the sequence
        self.final = nn.Sequential(nn.LayerNorm(DIM))  # SequenceParallel inside, gathered at its output
        self.gate = nn.Parameter(torch.full((1,), 0.5))  # plain, multiplies the MLP's output

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        h = self.final(self.fc2(nn.functional.gelu(self.fc1(self.ln(x)))))
        return nn.functional.linear(x + self.gate * h, self.emb.weight)


def tp_plan() -> dict[str, Any]:
    """The tensor-parallel plan of :class:`Net` (what a user writes for their own model)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
    )

    return {
        "fc1": ColwiseParallel(),
        "fc2": RowwiseParallel(output_layouts=Shard(1)),
        "final.0": SequenceParallel(),
        "final": PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts=Replicate()),
    }


class TPModule(pl.LightningModule):
    def __init__(self, fsdp: bool) -> None:
        super().__init__()
        torch.manual_seed(0)  # the same whole weights on every rank and in the reference
        self.model = Net()
        self.fsdp = fsdp

    def configure_model(self) -> None:
        if self.device_mesh is None or "tensor_parallel" not in (self.device_mesh.mesh_dim_names or ()):
            return  # one process, or StableFSDPStrategy without tensor parallelism (it shards by itself)
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import parallelize_module

        if MODE != "noplan":
            parallelize_module(self.model, self.device_mesh["tensor_parallel"], tp_plan())
        if self.fsdp and not STABLE:
            fully_shard(self.model, mesh=self.device_mesh["data_parallel"])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (tokens,) = batch
        logits = self.model(tokens[:, :-1])
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))

    def train_dataloader(self) -> DataLoader:
        """Each data-parallel rank takes every dp-th sample, in order: together one global batch per step, the
        reference's. (Lightning's own distributed sampler would shuffle, the one-process reference would not.)"""
        if self.trainer.world_size == 1:
            return DataLoader(data(), batch_size=GLOBAL_BATCH)
        ranks = self.trainer.strategy.distributed_sampler_kwargs  # the data-parallel ranks, any strategy
        sampler = DistributedSampler(data(), **ranks, shuffle=False)
        return DataLoader(data(), batch_size=GLOBAL_BATCH // ranks["num_replicas"], sampler=sampler)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class Probe(LedgerCallback):
    """Before the monitor (first in the list): the ledger's 2- and inf-norms of each step, read on the host."""

    def __init__(self) -> None:
        super().__init__(log_every_n_steps=1)
        self.norms: list[dict[str, float]] = []

    def on_step(self, trainer: pl.Trainer, ledger: StepLedger, optimizer: Any) -> None:
        self.norms.append({"2": float(ledger.gradients(2.0).total), "inf": float(ledger.gradients(math.inf).total)})


class Metrics(pl.Callback):
    """Every ``stability/`` metric after each step (a host read per step: this is a test)."""

    def __init__(self) -> None:
        self.rows: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        metrics = trainer.callback_metrics
        self.rows.append({k: float(v) for k, v in metrics.items() if k.startswith("stability/")})


def whole(value: torch.Tensor) -> torch.Tensor:
    # a copy: on one rank full_tensor() and .cpu() may return the parameter itself, which training then changes
    return (value.full_tensor() if hasattr(value, "full_tensor") else value).detach().float().cpu().clone()


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randint(VOCAB, (STEPS * GLOBAL_BATCH, SEQ + 1), generator=g))


MODE = sys.argv[4] if len(sys.argv) > 4 else "lightning"
#: noplan: our strategy and a configure_model that forgets the TP plan; faults: our strategy, an inf in one
#: rank's gradient shard at step FAULT_STEP, and a checkpoint at the end; resume: that checkpoint, loaded at
#: another mesh (argv[5]), trained one more step
STABLE = MODE in ("stable", "noplan", "faults", "resume", "fp16")  # fp16: faults with fp16 and the loss scaler
#: for benchmarks/tensor_parallel.py: Lightning's ModelParallelStrategy without our callbacks (bare), and with its
#: own gradient_clip_val instead (clip)
BARE = MODE in ("bare", "clip")
FAULT_STEP = 2


class Inject(pl.Callback):
    """At FAULT_STEP, after every collective, an inf in one element of the local ``fc1.weight`` gradient shard of
    the last rank only (every rank in the one-process reference, which then skips the same step)."""

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if trainer.global_step == FAULT_STEP and trainer.global_rank == trainer.world_size - 1:
            grad = pl_module.model.fc1.weight.grad
            (grad.to_local() if hasattr(grad, "to_local") else grad).view(-1)[0] = float("inf")


class Timer(pl.Callback):
    """``perf_counter`` at every batch start: the step times (host wall clock; CPU processes here)."""

    def __init__(self) -> None:
        self.marks: list[float] = []

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self.marks.append(time.perf_counter())

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.marks.append(time.perf_counter())


class Restored(pl.Callback):
    """The whole weights when training starts (after a checkpoint loaded), every rank."""

    def __init__(self) -> None:
        self.weights: dict[str, torch.Tensor] = {}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.weights = {name: whole(p) for name, p in pl_module.model.named_parameters()}


def main() -> None:
    out, dp, tp = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    probe, metrics, timer = Probe(), Metrics(), Timer()
    callbacks: list[pl.Callback] = [
        timer,
        probe,
        GradientNormMonitor(max_norm=MAX_NORM, per_layer=True, log_every_n_steps=1),
        TrainingHealthMonitor(response="warn", log_every_n_steps=1, report=False),
        metrics,
    ]
    if BARE:
        callbacks = [timer, metrics]
    elif os.environ.get("TP_TIMING"):  # benchmarks/tensor_parallel.py's timed runs: what a user attaches, no probes
        callbacks = [
            timer,
            GradientNormMonitor(max_norm=MAX_NORM),
            TrainingHealthMonitor(response="warn", report=False),
        ]
    restored = Restored()
    if MODE == "fp16":
        from lightning_stability import LossScaleTuner

        callbacks.append(LossScaleTuner(init_scale=2.0**10))
    if MODE in ("faults", "fp16"):
        callbacks.insert(0, Inject())  # before the monitor: the fault lands after every collective
    if MODE == "resume":
        callbacks.append(restored)
    common: dict[str, Any] = dict(
        accelerator="cpu",
        max_steps=STEPS + 1 if MODE == "resume" else STEPS,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        use_distributed_sampler=False,
        callbacks=callbacks,
    )
    if dp * tp == 1 and MODE != "resume":
        trainer = pl.Trainer(devices=1, **common)
    elif STABLE:
        from lightning_stability import StableFSDPStrategy

        precision = {"mixed_precision": "16-mixed"} if MODE == "fp16" else {}
        trainer = pl.Trainer(devices=dp * tp, strategy=StableFSDPStrategy(tensor_parallel=tp, **precision), **common)
    else:
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(data_parallel_size=dp, tensor_parallel_size=tp)
        clip = {"gradient_clip_val": MAX_NORM} if MODE == "clip" else {}
        trainer = pl.Trainer(devices=dp * tp, strategy=strategy, **clip, **common)
    module = TPModule(fsdp=dp > 1)
    rank = int(os.environ.get("RANK", 0))
    if MODE == "noplan":
        from lightning_stability import StabilityConfigError

        try:
            trainer.fit(module)
        except StabilityConfigError as err:
            (out / f"rank{rank}.json").write_text(json.dumps({"error": str(err)}))
            return
        raise AssertionError("StableFSDPStrategy(tensor_parallel=2) trained a module without a TP plan")
    if MODE == "clip":  # Lightning's own clipping on this model: record whether it runs
        try:
            trainer.fit(module)
        except Exception as err:
            (out / f"rank{rank}.json").write_text(json.dumps({"error": f"{type(err).__name__}: {err}"[:300]}))
            return
    else:
        trainer.fit(module, ckpt_path=sys.argv[5] if MODE == "resume" else None)
    final = {name: whole(p) for name, p in module.model.named_parameters()}  # every rank gathers
    if MODE == "faults":
        trainer.save_checkpoint(out / "tp.ckpt")  # sharded, every rank writes its part
    if rank == 0:
        torch.save(final, out / "final.pt")
        if MODE == "resume":
            torch.save(restored.weights, out / "restored.pt")
    placements = {
        name: [type(p).__name__ for p in getattr(param, "placements", ())]
        for name, param in module.model.named_parameters()
    }
    record = StepLedger.of(trainer).record_of() if not BARE else None
    outcomes = {"applied": int(record.applied_steps), "skipped": int(record.skipped_steps)} if record else {}
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    if scaler is not None:
        outcomes["scale"] = float(scaler.get_scale())
    (out / f"rank{rank}.json").write_text(
        json.dumps(
            {
                "norms": probe.norms,
                "metrics": metrics.rows,
                "placements": placements,
                "outcomes": outcomes,
                "step_times": [b - a for a, b in zip(timer.marks, timer.marks[1:], strict=False)],
                "param_bytes": sum(local_tensor(p).numel() * p.element_size() for p in module.model.parameters()),
            }
        )
    )


if __name__ == "__main__":
    main()
    exit_worker()  # results written: skip the teardown where gloo's threads can abort the process
