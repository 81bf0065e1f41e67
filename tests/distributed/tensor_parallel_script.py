"""torchrun script: a GPT-style model under Lightning's own ``ModelParallelStrategy`` with our callbacks.

Usage: ``torchrun --nproc_per_node=DP*TP tensor_parallel_script.py OUT_DIR DP TP [MODE]``; writes
``OUT_DIR/rank{R}.json`` (per-step norms, LRs and logged metrics, warnings) and, on rank 0, ``OUT_DIR/final.pt``
(the whole weights after training). The modes are listed at ``MODE`` below.
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
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_stability import (
    ClusterHealthMonitor,
    GradientAccumulation,
    GradientNormMonitor,
    StepLedger,
    TrainingHealthMonitor,
    WarmupConstantCosineLR,
)
from lightning_stability.ledger.callback import LedgerCallback
from lightning_stability.norms import local_tensor
from tests.helpers import QUIET, exit_worker

MODE = sys.argv[4] if len(sys.argv) > 4 else "lightning"
VOCAB, DIM, SEQ, GLOBAL_BATCH = 32, 16, 8, 8
#: benchmarks/tensor_parallel.py runs longer; a rollback needs the spike statistics' warm-up and snapshots first
STEPS = int(os.environ.get("TP_STEPS", 20 if MODE == "rollback" else 6))
MAX_NORM = 0.5  # below the norms of this model: every step clips
ACCELERATOR = os.environ.get("TP_ACCELERATOR", "cpu")  # "gpu": tests/gpu/check.sh on a machine with 4 GPUs (NCCL)


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
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        if MODE == "rollback" and self.global_step in SPIKES:  # every rank, as in the reference
            return loss * 100
        return loss

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
    """Before the monitor (first in the list): the ledger's 2- and inf-norms of each step, read on the host, and
    the LR the step's update uses."""

    def __init__(self) -> None:
        super().__init__(log_every_n_steps=1)
        self.norms: list[dict[str, float]] = []
        self.lrs: list[float] = []

    def on_step(self, trainer: pl.Trainer, ledger: StepLedger, optimizer: Any) -> None:
        self.norms.append({"2": float(ledger.gradients(2.0).total), "inf": float(ledger.gradients(math.inf).total)})
        self.lrs.append(float(optimizer.param_groups[0]["lr"]))  # what this update uses (a schedule wrote it)


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


#: lightning / stable: Lightning's ModelParallelStrategy / our StableFSDPStrategy(tensor_parallel=TP).
#: noplan: our strategy and a configure_model that forgets the TP plan; then fp16 under ModelParallelStrategy.
#: faults: our strategy, an LR schedule, an inf in one rank's gradient shard at step FAULT_STEP, and a checkpoint
#: at the end; resume: that checkpoint, loaded at another mesh (argv[5]), trained one more step.
#: accum: ModelParallelStrategy with GradientAccumulation(ACCUM), an LR schedule and both replica checks, the
#: gradient collectives counted per micro-batch; replicas: the same under our strategy with hybrid sharding
#: (DP replicas x TP), the last rank's gradient shard corrupted at CORRUPT_STEP; rollback: our strategy,
#: TrainingHealthMonitor(response="rollback"), a spike at SPIKES that outlasts its skipped update.
STABLE = MODE in (
    "stable",
    "noplan",
    "faults",
    "resume",
    "fp16",
    "replicas",
    "rollback",
    "precursors",
)  # fp16: faults in fp16
#: for benchmarks/tensor_parallel.py: Lightning's ModelParallelStrategy without our callbacks (bare), and with its
#: own gradient_clip_val instead (clip)
BARE = MODE in ("bare", "clip")
FAULT_STEP = 2
ACCUM, CORRUPT_STEP = 2, 4
SPIKES = (11, 12)  # the second spikes on the first's weights (its update skipped): rolled back at 13 to step 7


class Inject(pl.Callback):
    """At FAULT_STEP, after every collective, an inf in one element of the local ``fc1.weight`` gradient shard of
    the last rank only (every rank in the one-process reference, which then skips the same step)."""

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if trainer.global_step == FAULT_STEP and trainer.global_rank == trainer.world_size - 1:
            grad = pl_module.model.fc1.weight.grad
            (grad.to_local() if hasattr(grad, "to_local") else grad).view(-1)[0] = float("inf")


class Corrupt(pl.Callback):
    """At CORRUPT_STEP, after every collective, the last rank's local ``fc1.weight`` gradient shard tripled: one
    data-parallel replica's gradient goes bad (its tensor-parallel partner reduces the global norm with it)."""

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if trainer.global_step == CORRUPT_STEP and trainer.global_rank == trainer.world_size - 1:
            pl_module.model.fc1.weight.grad.to_local().mul_(3.0)


class Collectives(pl.Callback):
    """The gradient reductions across data-parallel ranks of each micro-batch, from its start to its end: FSDP2's
    reduce-scatters and hybrid sharding's all-reduces (torch.distributed calls by module attribute), and the
    all-reduces our callbacks make once per optimizer step (not in a non-final micro-batch either)."""

    def __init__(self) -> None:
        self.per_batch: list[int] = []
        self.count = 0
        self._at_start = 0
        for name in ("reduce_scatter_single", "reduce_scatter_tensor", "all_reduce"):  # the first: torch >= 2.13
            original = getattr(dist, name, None)
            if original is None:
                continue

            def counting(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
                self.count += 1
                return _original(*args, **kwargs)

            setattr(dist, name, counting)

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self._at_start = self.count

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.per_batch.append(self.count - self._at_start)


class Weights(pl.Callback):
    """The whole weights after every batch (every rank gathers; rank 0 keeps them), and where each parameter and
    its local shard live (a restore in place keeps both)."""

    def __init__(self) -> None:
        self.after: list[dict[str, torch.Tensor]] = []
        self.places: set[tuple[int, ...]] = set()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.after.append({name: whole(p) for name, p in pl_module.model.named_parameters()})
        params = list(pl_module.model.parameters())
        self.places.add(tuple(id(p) for p in params) + tuple(local_tensor(p).data_ptr() for p in params))


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


#: our strategy clips through Trainer(gradient_clip_val=MAX_NORM), the monitor only measures (and skips non-finite)
TRAINER_CLIPS = bool(os.environ.get("TP_TRAINER_CLIPS"))


def main() -> None:
    out, dp, tp = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    probe, metrics, timer = Probe(), Metrics(), Timer()
    callbacks: list[pl.Callback] = [
        timer,
        probe,
        GradientNormMonitor(max_norm=None if TRAINER_CLIPS else MAX_NORM, per_layer=True, log_every_n_steps=1),
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
    restored, collectives, weights = Restored(), None, Weights()
    warm = STEPS * 2 // 3  # steps; then a cosine decay: a new LR at every step but one
    schedule = WarmupConstantCosineLR(warmup=warm, decay=STEPS - warm, total_steps=STEPS)
    gradient_monitor = next((cb for cb in callbacks if isinstance(cb, GradientNormMonitor)), None)
    cluster = ClusterHealthMonitor(straggler_factor=None, weight_hash_every=1, log_every_n_steps=1)
    if MODE in ("faults", "resume", "accum", "replicas", "rollback"):
        callbacks.insert(-1, schedule)
    if MODE in ("accum", "replicas"):
        assert gradient_monitor is not None
        gradient_monitor.check_replicas = True
        collectives = Collectives()
        callbacks[-1:-1] = [GradientAccumulation(steps=ACCUM, lr_scaling="none"), cluster, collectives]
    if MODE == "replicas":
        callbacks.insert(1, Corrupt())  # before the monitor: after every collective
    if MODE == "rollback":
        rollback = TrainingHealthMonitor(
            response="rollback", warmup_steps=5, snapshot_every=4, skip_batches=3, log_every_n_steps=1, report=False
        )
        callbacks = [rollback if isinstance(cb, TrainingHealthMonitor) else cb for cb in callbacks]
        callbacks.append(weights)
    if MODE == "fp16":
        from lightning_stability import LossScaleTuner

        callbacks.append(LossScaleTuner(init_scale=2.0**10))
    if MODE in ("faults", "fp16"):
        callbacks.insert(0, Inject())  # before the monitor: the fault lands after every collective
    if MODE == "resume":
        callbacks.append(restored)
    if MODE in ("precursors", "precursors_refused"):
        from lightning_stability import LRBackoff, PrecursorMonitor

        # precursors: the update ratio and the back-off on it (a threshold low enough for it to act in 6 steps);
        # precursors_refused: update clipping, which reads partial gradients, is refused under tensor parallelism
        backoff = LRBackoff("update_ratio", threshold=1e-3, every=1, efficiency=None)
        monitor = PrecursorMonitor(lr_backoff=backoff, log_every_n_steps=1)
        callbacks.insert(-1, PrecursorMonitor(update_clip=1.0) if MODE == "precursors_refused" else monitor)
    common: dict[str, Any] = dict(
        accelerator=ACCELERATOR,
        max_steps=STEPS + 1 if MODE == "resume" else STEPS,
        enable_checkpointing=False,
        use_distributed_sampler=False,
        callbacks=callbacks,
        **QUIET,
    )
    if dp * tp == 1 and MODE != "resume":
        trainer = pl.Trainer(devices=1, **common)
    elif STABLE:
        from lightning_stability import StableFSDPStrategy

        kwargs: dict[str, Any] = {"mixed_precision": "16-mixed"} if MODE == "fp16" else {}
        if MODE == "replicas":  # dp replicas x 1 shard x tp: every data-parallel rank holds the whole TP shard
            kwargs.update(sharding="hybrid", device_mesh=(dp, 1))
        if os.environ.get("TP_HYBRID"):  # "replicas,shard": hybrid sharding, a replicate x shard x tensor mesh
            kwargs.update(sharding="hybrid", device_mesh=tuple(int(n) for n in os.environ["TP_HYBRID"].split(",")))
        clip_by = {"gradient_clip_val": MAX_NORM} if TRAINER_CLIPS else {}  # the strategy's global-norm clip
        strategy = StableFSDPStrategy(tensor_parallel=tp, **kwargs)
        trainer = pl.Trainer(devices=dp * tp, strategy=strategy, **clip_by, **common)
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
            errors = {"error": str(err), **fp16_under_model_parallel(dp, tp)}
            (out / f"rank{rank}.json").write_text(json.dumps(errors))
            return
        raise AssertionError("StableFSDPStrategy(tensor_parallel=2) trained a module without a TP plan")
    if MODE == "precursors_refused":
        from lightning_stability import StabilityConfigError

        try:
            trainer.fit(module)
        except StabilityConfigError as err:
            (out / f"rank{rank}.json").write_text(json.dumps({"error": str(err)}))
            return
        raise AssertionError("PrecursorMonitor trained under tensor parallelism")
    caught: list[warnings.WarningMessage] = []
    if MODE == "clip":  # Lightning's own clipping on this model: record whether it runs
        try:
            trainer.fit(module)
        except Exception as err:
            (out / f"rank{rank}.json").write_text(json.dumps({"error": f"{type(err).__name__}: {err}"[:300]}))
            return
    else:
        with warnings.catch_warnings(record=True) as recorded:
            warnings.simplefilter("always")
            trainer.fit(module, ckpt_path=sys.argv[5] if MODE == "resume" else None)
        caught = list(recorded or [])
    final = {name: whole(p) for name, p in module.model.named_parameters()}  # every rank gathers
    if MODE == "faults":
        trainer.save_checkpoint(out / "tp.ckpt")  # sharded, every rank writes its part
    if rank == 0:
        torch.save(final, out / "final.pt")
        if MODE == "resume":
            torch.save(restored.weights, out / "restored.pt")
        if MODE == "rollback":
            torch.save(weights.after, out / "weights.pt")
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
                "lrs": probe.lrs,
                "warnings": [str(w.message) for w in caught],
                "collectives": collectives.per_batch if collectives is not None else [],
                "replica_groups": {  # which ranks each check compares (None: off)
                    "grad_norm": getattr(gradient_monitor, "_replica_groups", None),
                    "weight_hash": list(cluster._layout.groups) if cluster._layout is not None else None,
                },
                "health": health_record(trainer),
                "weight_places": len(weights.places),  # 1: every parameter stayed where it was (rollback mode)
            }
        )
    )


def health_record(trainer: pl.Trainer) -> dict[str, Any]:
    """The health monitor's rollbacks and events, and each step's outcome."""
    monitor = next((cb for cb in trainer.callbacks if isinstance(cb, TrainingHealthMonitor)), None)  # type: ignore[attr-defined]
    if monitor is None:
        return {}
    return {
        "rollbacks": monitor.rollback.rollbacks,
        "events": [{k: v for k, v in e.items() if k in ("step", "kind", "to_step")} for e in monitor.events],
        "outcomes": [int(o) for o in monitor.history.series["outcome"]],
    }


def fp16_under_model_parallel(dp: int, tp: int) -> dict[str, str]:
    """fp16 under Lightning's ModelParallelStrategy, which has no loss scaler: ``"16-mixed"`` (Lightning refuses at
    construction) and ``"16-true"`` with our GradientNormMonitor (refused at setup), each error's message."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    from lightning_stability import StabilityConfigError

    found: dict[str, str] = {}
    common: dict[str, Any] = dict(accelerator=ACCELERATOR, devices=dp * tp, max_steps=1, logger=False)
    common.update(enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    for precision in ("16-mixed", "16-true"):
        try:
            strategy = ModelParallelStrategy(data_parallel_size=dp, tensor_parallel_size=tp)
            trainer = pl.Trainer(strategy=strategy, precision=precision, callbacks=[GradientNormMonitor()], **common)
            trainer.fit(TPModule(fsdp=True))
        except (ValueError, StabilityConfigError) as err:
            found[precision] = f"{type(err).__name__}: {err}"
        else:
            found[precision] = "trained"
    return found


if __name__ == "__main__":
    main()
    exit_worker()  # results written: skip the teardown where gloo's threads can abort the process
