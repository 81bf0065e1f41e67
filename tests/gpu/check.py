"""The GPU questions, one section at a time: ``python -m tests.gpu.check SECTION [--device cuda] [--summary FILE]``.

Each section prints its details and appends one line to ``--summary`` (``SECTION: PASS|FAIL|INFO ...``), so a
run cut short still reports what finished. ``tests/gpu/check.sh`` runs every section on a lent GPU, each under
its own time limit; ``tests/gpu/test_check.py`` runs them on the CPU with tiny sizes so this file cannot rot.

Sections:

* ``syncs``    the full ``from_preset("gpt")`` stack against a bare Trainer (no clipping: see ``overhead``), bf16
  with fused AdamW and fp16 with ``LossScaleTuner``, ``log_every_n_steps=10``: host syncs per step, split into
  logging and other steps. Counted three ways: torch's own CUDA sync detector
  (``torch.cuda.set_sync_debug_mode("warn")``, CUDA only), ``.item()``-like ops and copies to the host, and
  tensors made from host data (a blocking host-to-device copy on a GPU). PASS: no extra on non-logging steps,
  at most one on logging steps.
* ``overhead`` the step-time ratio, preset against a bare Trainer, over paired runs on a GPT-style model whose
  bare step takes ~20-50 ms on an H100, and the kernel launches per step of each (torch's profiler; on a CPU
  the dispatched ops). With torch's default AdamW the bare Trainer clips (``gradient_clip_val=1.0``); with the
  fused one it cannot (Lightning's mixed precision refuses to clip a fused optimizer).
* ``fp16auto`` fp16 on tensor cores with gradients 1000x too large for torch's default scale: torch's
  ``GradScaler(65536)`` against ``LossScaleTuner(init_scale="auto")``: updates lost before the first applied
  one, the scale found, and whether the loss falls.
* ``tp``       tensor parallelism, the parts one GPU can answer (a TP plan on a 1-GPU mesh splits nothing): our
  norms of DTensors on a 1 x 1 ``("data_parallel", "tensor_parallel")`` CUDA mesh, every placement FSDP2 x TP
  makes (``Shard``, ``_StridedShard``, ``Partial``, ``Replicate``, a plain tensor beside them), against the
  full tensors' norms; the host syncs of ``GradientNormMonitor`` over DTensor parameters (Lightning's
  ``ModelParallelStrategy`` on that mesh, ``parallelize_module`` + ``fully_shard``) against a bare Trainer;
  and the planner's TP advice for GPT-3 175B on 8 nodes of 8 GPUs like this one. The real 2 x 2 run with NCCL is
  ``check.sh``'s next section, on a machine with 4 GPUs or more.
* ``precursors`` ``PrecursorMonitor`` with every early action (QK-clip, update clipping, the LR back-off, the
  moment reset) on the same model, its attention taught by ``register_attention``, bf16 with fused AdamW, against
  the same Trainer without it (both with ``TrainingHealthMonitor(response="warn")``): host syncs per step (the
  three counters of ``syncs``; PASS as there), and whether every precursor key was logged.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

from benchmarks.overhead import Batches, Decoder, Size, StepTimer, bigram_tokens
from lightning_stability import LossScaleTuner, StableTrainer, TrainingHealthMonitor
from tests.helpers import HostDataCounter, OpCounter, StepSyncCounter, SyncCounter

LOG_EVERY = 10  # logging steps inside a 30-step run (Lightning logs batch i when (i + 1) % LOG_EVERY == 0)
SYNC_MESSAGE = "synchronizing CUDA operation"  # what torch's sync debug mode warns

#: model sizes: a bare bf16 step of ~20-50 ms on an H100/H200 ("gpu"), a few ms on a CPU ("cpu")
SIZES = {
    "gpu": Size(vocab=8192, d_model=1024, layers=12, heads=16, seq=512, batch=16),
    "cpu": Size(vocab=64, d_model=32, layers=2, heads=4, seq=32, batch=8),
}


def trainer_for(
    config: str, precision: str, steps: int, device: str, root: str, first: list[pl.Callback], optimizer: str
) -> pl.Trainer:
    """``bare``: a plain Trainer with Lightning's own clipping at 1.0, except with a fused optimizer, which
    Lightning's mixed precision refuses to clip; ``preset``: ``StableTrainer.from_preset("gpt")``."""
    common: dict[str, Any] = dict(
        accelerator=device,
        devices=1,
        max_steps=steps,
        precision=precision,
        log_every_n_steps=LOG_EVERY,
        logger=pl.loggers.CSVLogger(root, name=config),
        default_root_dir=root,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    if config == "bare":
        clip = {} if optimizer == "adamw_fused" else {"gradient_clip_val": 1.0}
        return pl.Trainer(callbacks=first, **clip, **common)
    if device == "cpu" and precision == "16-mixed":
        common.pop("precision")  # the preset adds an explicit fp16 scaler plugin on a CPU
        trainer = StableTrainer.from_preset("gpt", precision="16-mixed", callbacks=first, **common)
    else:
        trainer = StableTrainer.from_preset("gpt", callbacks=first, **common)
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        if isinstance(callback, TrainingHealthMonitor):
            callback.report = False  # written after the last step: wall time only
    return trainer


def fit(trainer: pl.Trainer, size: Size, tokens: torch.Tensor, optimizer: str = "adamw_fused") -> Decoder:
    torch.manual_seed(0)
    model = Decoder(size, optimizer)
    trainer.fit(model, DataLoader(Batches(tokens), batch_size=None))
    return model


# ---------------------------------------------------------------------------------------------- syncs
class CudaSyncWarnings:
    """Counts torch's sync-debug warnings (CUDA only): every synchronizing CUDA call, whoever makes it."""

    def __init__(self, record: list[warnings.WarningMessage]) -> None:
        self.record = record

    @property
    def count(self) -> int:
        return sum(SYNC_MESSAGE in str(w.message) for w in self.record)


@contextmanager
def cuda_sync_debug(device: str) -> Iterator[list[warnings.WarningMessage]]:
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        if device == "cuda":
            torch.cuda.set_sync_debug_mode("warn")
        try:
            yield record
        finally:
            if device == "cuda":
                torch.cuda.set_sync_debug_mode("default")


def sync_counts(
    config: str, precision: str, steps: int, device: str, size: Size, add: Sequence[pl.Callback] = ()
) -> tuple[dict[str, list[int]], set[str]]:
    """Per counter kind, the syncs of each step; and the ``stability/`` keys logged. ``add``: callbacks put first."""
    tokens = bigram_tokens(size, steps)
    with tempfile.TemporaryDirectory() as root, cuda_sync_debug(device) as record:
        syncs, made = SyncCounter(), HostDataCounter()
        counters: dict[str, Any] = {"ops": syncs, "host-made": made}
        if device == "cuda":
            counters["cuda"] = CudaSyncWarnings(record)
        steppers = {name: StepSyncCounter(c) for name, c in counters.items()}
        first = [*add, *steppers.values()]
        trainer = trainer_for(config, precision, steps, device, root, first, "adamw_fused")
        with syncs, made:
            fit(trainer, size, tokens)
    keys = {k for k in trainer.callback_metrics if k.startswith("stability/")}
    return {name: s.per_step for name, s in steppers.items()}, keys


def check_syncs(args: argparse.Namespace, report: Callable[[str], None]) -> bool:
    size, ok = SIZES[args.size], True
    for precision in ("bf16-mixed", "16-mixed"):
        counts = {c: sync_counts(c, precision, args.steps, args.device, size)[0] for c in ("bare", "preset")}
        cells, fine = extra_syncs(counts["bare"], counts["preset"], args.steps, f"{precision} ", "preset")
        ok &= fine
        report(f"{precision}, fused AdamW, {args.steps} steps: " + "; ".join(cells))
    return ok


def extra_syncs(
    bare: dict[str, list[int]], ours: dict[str, list[int]], steps: int, label: str, name: str
) -> tuple[list[str], bool]:
    """Per counter kind, the syncs ``ours`` adds to ``bare`` at each step, printed; and whether they stay within
    none on a non-logging step and one on a logging step. Step 0 sets the run up and the last one also holds
    ``on_train_end``: neither counts as a non-logging step."""
    logging_steps = {i for i in range(steps) if (i + 1) % LOG_EVERY == 0}
    cells, ok = [], True
    for kind in bare:
        extra = [o - b for b, o in zip(bare[kind], ours[kind], strict=True)]
        other = [e for i, e in enumerate(extra[:-1]) if i and i not in logging_steps]
        logged = [extra[i] for i in sorted(logging_steps)]
        print(f"  {label}{kind}: bare {bare[kind]}\n  {label}{kind}: {name} {ours[kind]}")
        cells.append(f"{kind} extra: non-logging max {max(other)}, logging max {max(logged)}")
        ok &= max(other) <= 0 and max(logged) <= 1
    return cells, ok


# ---------------------------------------------------------------------------------------------- tp
def tp_norm_errors(device: str) -> dict[str, float]:
    """The largest relative error of :func:`per_tensor_norms` / :func:`total_norm` of DTensors on a 1 x 1 mesh,
    per placement (and for the total of all of them beside a plain tensor), against the full tensors' norms."""
    import math

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard  # what FSDP2 x TP makes

    from lightning_stability.norms import per_tensor_norms, total_norm

    mesh = init_device_mesh(device, (1, 1), mesh_dim_names=("data_parallel", "tensor_parallel"))
    g = torch.Generator().manual_seed(0)
    full = [torch.randn(7, 3, generator=g).to(device), (torch.randn(5, generator=g) * 3).to(device)]
    plain = torch.randn(4, generator=g).to(device)
    placements = {
        "Shard": [Shard(0), Shard(0)],
        "_StridedShard": [_StridedShard(0, split_factor=1), Shard(0)],
        "Partial": [Replicate(), Partial()],
        "Replicate": [Replicate(), Replicate()],
    }
    errors: dict[str, float] = {}
    every: list[torch.Tensor] = []
    for name, where in placements.items():
        tensors = [DTensor.from_local(t, mesh, where, run_check=False) for t in full]
        every += tensors
        for p in (2.0, 1.0, math.inf):
            ours = per_tensor_norms(tensors, p)
            assert ours.device.type == torch.device(device).type and ours.dtype == torch.float32
            expected = torch.stack([torch.linalg.vector_norm(t, p) for t in full])
            errors[name] = max(errors.get(name, 0.0), float(((ours - expected).abs() / expected).max()))
    for p in (2.0, 1.0, math.inf):
        expected = torch.linalg.vector_norm(torch.cat([*(t.flatten() for t in full * len(placements)), plain]), p)
        ours = total_norm([*every, plain], p)
        errors["total"] = max(errors.get("total", 0.0), float((ours - expected).abs() / expected))
    return errors


class TPNet(torch.nn.Module):
    """A column/row-parallel MLP beside a LayerNorm left replicated."""

    def __init__(self, size: Size) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(size.vocab, size.d_model)
        self.ln = torch.nn.LayerNorm(size.d_model)
        self.fc1 = torch.nn.Linear(size.d_model, 4 * size.d_model)
        self.fc2 = torch.nn.Linear(4 * size.d_model, size.d_model)
        self.head = torch.nn.Linear(size.d_model, size.vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        return self.head(x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln(x)))))


class TPBlock(pl.LightningModule):
    """:class:`TPNet`; ``configure_model`` applies the TP plan and FSDP2, as a module written for Lightning's
    ``ModelParallelStrategy`` does."""

    def __init__(self, size: Size) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = TPNet(size)

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = self.device_mesh
        assert mesh is not None
        parallelize_module(self.net, mesh["tensor_parallel"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
        fully_shard(self.net, mesh=mesh["data_parallel"])

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        logits = self.net(batch[:, :-1])
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3, fused=True)


def tp_sync_counts(config: str, steps: int, device: str, size: Size) -> dict[str, list[int]]:
    """Host syncs per step under ModelParallelStrategy on one device: a bare Trainer, or GradientNormMonitor
    clipping at 1.0 (``config="ours"``)."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    from lightning_stability import GradientNormMonitor

    tokens = bigram_tokens(size, steps)
    with tempfile.TemporaryDirectory() as root, cuda_sync_debug(device) as record:
        syncs, made = SyncCounter(), HostDataCounter()
        counters: dict[str, Any] = {"ops": syncs, "host-made": made}
        if device == "cuda":
            counters["cuda"] = CudaSyncWarnings(record)
        steppers = {name: StepSyncCounter(c) for name, c in counters.items()}
        ours = [GradientNormMonitor(max_norm=1.0)] if config == "ours" else []
        trainer = pl.Trainer(
            accelerator=device,
            devices=1,
            strategy=ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1),
            max_steps=steps,
            log_every_n_steps=LOG_EVERY,
            logger=pl.loggers.CSVLogger(root, name=config),
            default_root_dir=root,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
            callbacks=[*steppers.values(), *ours],
        )
        with syncs, made:
            trainer.fit(TPBlock(size), DataLoader(Batches(tokens), batch_size=None))
        assert all(type(p).__name__ == "DTensor" for p in trainer.lightning_module.parameters())
    return {name: s.per_step for name, s in steppers.items()}


def check_tp(args: argparse.Namespace, report: Callable[[str], None]) -> bool:
    import torch.distributed as dist

    from lightning_stability.planner import ModelShape, advise_tensor_parallel

    if not dist.is_initialized():  # one process, a one-rank group: ModelParallelStrategy below keeps it
        with tempfile.NamedTemporaryFile(delete=False) as store:
            backend = "nccl" if args.device == "cuda" else "gloo"
            dist.init_process_group(backend, init_method=f"file://{store.name}", rank=0, world_size=1)
    errors = tp_norm_errors(args.device)
    print(f"  norm errors by placement: {errors}")
    ok = max(errors.values()) < 1e-5
    report(
        f"norms of DTensors on a 1x1 {args.device} mesh, max rel error {max(errors.values()):.1e} ({len(errors)} cases)"
    )

    counts = {c: tp_sync_counts(c, args.steps, args.device, SIZES[args.size]) for c in ("bare", "ours")}
    cells, fine = extra_syncs(counts["bare"], counts["ours"], args.steps, "", "ours")
    ok &= fine
    report("GradientNormMonitor over DTensor params (ModelParallelStrategy 1x1): " + "; ".join(cells))

    # issue 21's case (GPT-3 175B on 8 nodes of 8 GPUs), with this GPU's memory: pure arithmetic, reported
    memory = torch.cuda.get_device_properties(0).total_memory if args.device == "cuda" else 80 * 2**30
    advice = advise_tensor_parallel(ModelShape(175e9), nodes=8, gpus_per_node=8, gpu_memory=memory)
    print(f"  {advice.text()}")
    report(f"planner, 175B on 8 x 8 GPUs of {memory / 2**30:.0f} GiB: {advice.text()}")
    return ok and len(advice.plans) > 1


# ---------------------------------------------------------------------------------------------- overhead
class Profiled(pl.Callback):
    """torch's profiler around every step from ``first`` on (the first steps set the optimizer state up)."""

    def __init__(self, first: int) -> None:
        from torch.profiler import ProfilerActivity, profile

        self.first, self.steps = first, 0
        self.prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, i: int) -> None:
        if i == self.first:
            self.prof.start()
        self.steps += i >= self.first

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        torch.cuda.synchronize()
        self.prof.stop()


def kernel_launches_per_step(config: str, optimizer: str, device: str, size: Size, steps: int) -> float:
    """Kernel launches per step after the first two (CUDA: the runtime's launch calls that torch's profiler
    records; CPU: the dispatched tensor ops, each a launch on a GPU)."""
    tokens = bigram_tokens(size, steps)
    with tempfile.TemporaryDirectory() as root:
        if device != "cuda":
            ops = OpCounter()
            stepper = StepSyncCounter(ops)
            with ops:
                fit(
                    trainer_for(config, "bf16-mixed", steps, device, root, [stepper], optimizer),
                    size,
                    tokens,
                    optimizer,
                )
            return statistics.fmean(stepper.per_step[2:])
        profiled = Profiled(first=2)
        fit(trainer_for(config, "bf16-mixed", steps, device, root, [profiled], optimizer), size, tokens, optimizer)
    events = profiled.prof.key_averages()
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel"))
    return launches / profiled.steps


def check_overhead(args: argparse.Namespace, report: Callable[[str], None]) -> bool:
    """torch's default AdamW (foreach on CUDA; the bare Trainer clips at 1.0) and the fused one (Lightning's
    mixed precision refuses to clip a fused optimizer, so that bare Trainer does not clip)."""
    size = SIZES[args.size]
    tokens = bigram_tokens(size, args.warmup + args.steps + 1)
    for optimizer in ("adamw", "adamw_fused"):
        medians: dict[str, list[float]] = {"bare": [], "preset": []}
        ratios = []
        for r in range(args.repeats):
            pair = {}
            for config in ("bare", "preset") if r % 2 == 0 else ("preset", "bare"):
                timer = StepTimer()
                with tempfile.TemporaryDirectory() as root:
                    trainer = trainer_for(config, "bf16-mixed", len(tokens), args.device, root, [timer], optimizer)
                    fit(trainer, size, tokens, optimizer)
                pair[config] = statistics.median(timer.times[args.warmup :])
                medians[config].append(pair[config])
            ratios.append(pair["preset"] / pair["bare"])
            print(f"  {optimizer} pair {r}: bare {1e3 * pair['bare']:.2f} ms, preset {1e3 * pair['preset']:.2f} ms")
        launches = {c: kernel_launches_per_step(c, optimizer, args.device, size, 12) for c in ("bare", "preset")}
        bare_ms = 1e3 * statistics.median(medians["bare"])
        clip = "bare without clipping" if optimizer == "adamw_fused" else "bare clips at 1.0"
        report(
            f"bf16, {optimizer} ({clip}): bare step {bare_ms:.2f} ms; preset/bare {statistics.median(ratios):.3f} "
            f"(min {min(ratios):.3f}, max {max(ratios):.3f}, {args.repeats} pairs); kernel launches per step "
            f"bare {launches['bare']:.0f}, preset {launches['preset']:.0f}"
        )
    return True  # a measurement: the README quotes it, no threshold decides it here


# ---------------------------------------------------------------------------------------------- fp16 auto
class Applied(pl.Callback):
    """Whether each step changed the weights, and its loss."""

    def __init__(self) -> None:
        self.applied: list[bool] = []
        self.losses: list[float] = []
        self._before: torch.Tensor | None = None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self._before = next(pl_module.parameters()).detach().clone()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, *args: Any) -> None:
        assert self._before is not None
        self.applied.append(not torch.equal(self._before, next(pl_module.parameters())))
        self.losses.append(float(outputs["loss"]))


class LoudDecoder(Decoder):
    """The decoder with its loss, and so every gradient, multiplied by ``grad_mult``."""

    grad_mult = 1e3

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return super().training_step(batch, batch_idx) * self.grad_mult


def check_fp16_auto(args: argparse.Namespace, report: Callable[[str], None]) -> bool:
    size = SIZES[args.size]
    tokens = bigram_tokens(size, args.steps)
    results = {}
    for name in ("torch GradScaler(65536)", 'LossScaleTuner("auto")'):
        applied = Applied()
        tuner = [LossScaleTuner(init_scale="auto")] if "auto" in name else []
        plugins: dict[str, Any] = {"precision": "16-mixed"}
        if args.device == "cpu":  # Lightning makes "16-mixed" bf16 on a CPU; an explicit plugin keeps fp16
            scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
            plugins = {"plugins": [pl.plugins.MixedPrecision("16-mixed", "cpu", scaler=scaler)]}
        trainer = pl.Trainer(
            accelerator=args.device, devices=1, max_steps=args.steps, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, callbacks=[applied, *tuner], **plugins,
        )  # fmt: skip
        torch.manual_seed(0)
        trainer.fit(LoudDecoder(size, "adamw_fused"), DataLoader(Batches(tokens), batch_size=None))
        first = applied.applied.index(True) if any(applied.applied) else args.steps
        losses = [loss for loss, ok in zip(applied.losses, applied.applied, strict=True) if ok]
        k = max(1, len(losses) // 4)
        falls = len(losses) >= 2 and statistics.fmean(losses[-k:]) < statistics.fmean(losses[:k])
        scale = trainer.precision_plugin.scaler.get_scale()  # type: ignore[attr-defined]
        results[name] = (first, args.steps - sum(applied.applied), scale, falls)
        print(f"  {name}: applied {applied.applied}\n  losses {[round(x, 1) for x in applied.losses]}")
    report(
        "; ".join(
            f"{name}: {first} lost before the first update, {lost} skipped in all, scale {scale:g}, "
            f"loss {'falls' if falls else 'does NOT fall'}"
            for name, (first, lost, scale, falls) in results.items()
        )
    )
    first, lost, _, falls = results['LossScaleTuner("auto")']
    return first == 0 and lost == 0 and falls


# ---------------------------------------------------------------------------------------------- precursors
def block_query_key(block: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The overhead benchmark's attention, taught to ``PrecursorMonitor`` (its queries and keys per head)."""
    from lightning_stability import QueryKey

    x = args[0]
    b, t, d = x.shape
    q, k, _ = block.qkv(block.ln1(x)).view(b, t, 3, block.heads, d // block.heads).permute(2, 0, 3, 1, 4)
    return QueryKey(q, k, scale=(d // block.heads) ** -0.5, causal=True)


def block_heads(block: Any) -> Any:
    """QK-clip's view of that attention: q | k | v packed along the rows of ``qkv``."""
    from lightning_stability.precursors.actions import HeadBlocks, QKProjection

    d, heads = block.qkv.in_features, block.heads
    query = [HeadBlocks(block.qkv.weight, 0, 0), HeadBlocks(block.qkv.bias, 0, 0)]
    key = [HeadBlocks(block.qkv.weight, 0, d), HeadBlocks(block.qkv.bias, 0, d)]
    return QKProjection(query, key, heads, heads, d // heads)


def check_precursors(args: argparse.Namespace, report: Callable[[str], None]) -> bool:
    from benchmarks.overhead import Block
    from lightning_stability import LRBackoff, PrecursorMonitor, register_attention

    register_attention(Block, block_query_key, projection=block_heads)
    monitor = PrecursorMonitor(qk_clip=100.0, update_clip=1.0, lr_backoff=LRBackoff(), reset_moments=True)
    size = SIZES[args.size]

    def health() -> TrainingHealthMonitor:  # in both runs: the moment reset acts on its spikes
        return TrainingHealthMonitor(response="warn", report=False)

    bare, _ = sync_counts("bare", "bf16-mixed", args.steps, args.device, size, [health()])
    ours, keys = sync_counts("bare", "bf16-mixed", args.steps, args.device, size, [monitor, health()])
    cells, ok = extra_syncs(bare, ours, args.steps, "bf16-mixed ", "precursors")
    wanted = {
        "stability/attention_logit_max",
        "stability/log_z",
        "stability/update_ratio",
        "stability/qk_clipped_heads",
        "stability/update_clip_min",
        "stability/lr_backoff",
    }
    missing = sorted(wanted - keys)
    report(f"bf16-mixed, fused AdamW, {args.steps} steps: " + "; ".join(cells) + f"; keys missing: {missing or 'none'}")
    return ok and not missing


SECTIONS = {
    "syncs": check_syncs,
    "overhead": check_overhead,
    "fp16auto": check_fp16_auto,
    "tp": check_tp,
    "precursors": check_precursors,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("section", choices=list(SECTIONS))
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--size", default=None, choices=list(SIZES), help="default: gpu on cuda, cpu on cpu")
    parser.add_argument("--steps", type=int, default=30, help="steps per run (overhead: timed steps per run)")
    parser.add_argument("--warmup", type=int, default=5, help="overhead: steps dropped at the start of each run")
    parser.add_argument("--repeats", type=int, default=5, help="overhead: paired runs")
    parser.add_argument("--summary", type=Path, default=None, help="append the section's one-line result here")
    args = parser.parse_args(argv)
    args.size = args.size or ("gpu" if args.device == "cuda" else "cpu")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    warnings.filterwarnings("ignore")
    for name in ("lightning.pytorch", "lightning.fabric", "lightning_stability"):
        logging.getLogger(name).setLevel(logging.ERROR)

    lines: list[str] = []
    start = time.perf_counter()
    ok = SECTIONS[args.section](args, lines.append)
    verdict = ("PASS" if ok else "FAIL") if args.section != "overhead" else "INFO"
    line = f"{args.section}: {verdict} ({time.perf_counter() - start:.0f} s) " + " | ".join(lines)
    print(line)
    if args.summary is not None:
        with args.summary.open("a") as f:
            f.write(line + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
