"""Benchmark: the per-step overhead of the full preset stack against a bare Trainer (time and host syncs).

Two configurations train the same model on the same data from the same initial weights:

* ``bare``   -- ``lightning.pytorch.Trainer(gradient_clip_val=1.0)``: Lightning's own norm clipping at 1.0,
  and a constant LR (no scheduler: the preset's LR schedule is part of the overhead measured);
* ``preset`` -- ``StableTrainer.from_preset("tiny")`` (``lightning-stability presets tiny``): fp32, no
  accumulation, ``GradientNormMonitor(max_norm=1.0)``, ``WarmupConstantCosineLR`` (5% warmup, constant,
  cosine over the last 20%) and ``TrainingHealthMonitor(response="skip")``. Its end-of-fit stability report is
  switched off (``report = False``): it is written in ``on_train_end``, after every measured step, and would
  only add ~2 s of wall time per run.

The model is a GPT-style decoder defined here (token and position embeddings, pre-norm blocks of causal
self-attention through ``scaled_dot_product_attention`` and a GELU MLP, a final LayerNorm, an untied LM head;
cross-entropy, ``self.log("train_loss", loss)`` every step) on token sequences drawn from a fixed random bigram
table, with AdamW (lr 3e-4, weight decay 0.01). ``--size``: ``tiny`` (2 layers, d_model 32; a step of a few
ms, mostly per-op overhead) and ``small`` (4 layers, d_model 128, seq 128; ~100 ms on a 2-core CPU).
``--optimizers``: ``adamw`` is ``torch.optim.AdamW`` as torch builds it by default (on a CPU the per-parameter
loop, which reads each parameter's step count with ``.item()``), ``adamw_foreach`` with ``foreach=True``,
``adamw_fused`` with ``fused=True``.
Both configurations log to a ``CSVLogger`` with the Trainer's default ``log_every_n_steps=50``; no progress
bar, model summary or checkpointing. ``--threads`` torch threads (default 1).

Two measurements, for each size and optimizer:

* **Step time.** A callback placed first records ``time.perf_counter()`` at every ``on_train_batch_start``;
  a step's time is the interval to the next step's start (data, forward, backward, clipping, the optimizer
  step, every callback's batch-end work and Lightning's logging). A run trains ``--warmup`` + ``--steps`` + 1
  steps; the first ``--warmup`` steps and the last are dropped, and the run's figure is the median of the
  rest. ``--repeats`` pairs of runs: each pair runs ``bare`` and ``preset`` one after the other, the order
  alternating between pairs, and its ratio is preset / bare. Printed: the median of the pair ratios, their
  min and max, and each configuration's median over runs (ms).
* **Host syncs per step.** One run of each configuration for ``--count-steps`` steps under
  ``tests.helpers.SyncCounter`` (a host sync: ``aten._local_scalar_dense``, i.e. ``.item()``/``bool(t)``,
  or a tensor copied to the host) and ``tests.helpers.HostDataCounter`` (a tensor made from host data,
  ``aten.lift_fresh``: on a GPU a blocking host-to-device copy, which a CPU run cannot see as a sync), split
  into steps by ``tests.helpers.StepSyncCounter`` (batch start to the next batch start; the last step ends at
  ``on_train_end``). Printed: the mean per step, bare and preset, and the extra, for the first step (one-time
  setup), the non-logging steps, the first logging step and the later ones (batch ``i`` logs when
  ``(i + 1) % 50 == 0``).

The target (issue 11): ratio <= 1.03, and no extra sync on non-logging steps. Run from the repository root
(it imports ``tests.helpers``)::

    python -m benchmarks.overhead          # defaults: --size tiny small --optimizers adamw adamw_foreach adamw_fused
                                           # --repeats 7 --warmup 5 --steps 100 (tiny) / 30 (small)
                                           # --count-steps 101 --threads 1; ~4 minutes on 2 cores
    python -m benchmarks.overhead --size small --optimizers adamw_fused --repeats 15
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from lightning_stability import StableTrainer, TrainingHealthMonitor
from tests.helpers import HostDataCounter, StepSyncCounter, SyncCounter

LOG_EVERY = 50  # the Trainer's default log_every_n_steps, kept for both configurations
PRESET = "tiny"
PRESET_OVERRIDES: dict[str, Any] = {}  # --no-backoff: {"lr_backoff": None}
CONFIGS = ("bare", "preset")


@dataclass(frozen=True)
class Size:
    vocab: int
    d_model: int
    layers: int
    heads: int
    seq: int
    batch: int

    def describe(self) -> str:
        return (
            f"vocab {self.vocab}, d_model {self.d_model}, {self.layers} layers, {self.heads} heads, "
            f"seq {self.seq}, batch {self.batch}"
        )


SIZES = {
    "tiny": Size(vocab=64, d_model=32, layers=2, heads=4, seq=32, batch=8),
    "small": Size(vocab=1024, d_model=128, layers=4, heads=4, seq=128, batch=4),
}
DEFAULT_STEPS = {"tiny": 100, "small": 30}  # timed steps per run, after the warm-up


class Block(nn.Module):
    """A pre-norm transformer block: causal self-attention, then a GELU MLP, each with a residual."""

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attn = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class Decoder(pl.LightningModule):
    """A small GPT-style language model: an ordinary LightningModule, nothing stability-specific."""

    def __init__(self, size: Size, optimizer: str, lr: float = 3e-4) -> None:
        super().__init__()
        self.embed = nn.Embedding(size.vocab, size.d_model)
        self.pos = nn.Embedding(size.seq, size.d_model)
        self.blocks = nn.ModuleList(Block(size.d_model, size.heads) for _ in range(size.layers))
        self.norm = nn.LayerNorm(size.d_model)
        self.head = nn.Linear(size.d_model, size.vocab, bias=False)
        self.optimizer_name, self.lr = optimizer, lr

    def forward(self, tokens: Tensor) -> Tensor:
        h = self.embed(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        logits = self(batch[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        fused = self.optimizer_name == "adamw_fused"
        foreach = True if self.optimizer_name == "adamw_foreach" else None
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01, fused=fused or None, foreach=foreach)


class Batches(Dataset[Tensor]):
    """Pre-built batches, served in order (one per optimizer step)."""

    def __init__(self, tokens: Tensor) -> None:
        self.tokens = tokens

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def __getitem__(self, i: int) -> Tensor:
        return self.tokens[i]


def bigram_tokens(size: Size, steps: int, seed: int = 0) -> Tensor:
    """``steps`` batches of ``seq + 1`` tokens each, from a fixed random bigram table (the same every call)."""
    g = torch.Generator().manual_seed(seed)
    table = torch.softmax(3.0 * torch.randn(size.vocab, size.vocab, generator=g), dim=-1)
    n = steps * size.batch
    tokens = torch.empty(n, size.seq + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(size.vocab, (n,), generator=g)
    for t in range(1, size.seq + 1):
        tokens[:, t] = torch.multinomial(table[tokens[:, t - 1]], 1, generator=g).squeeze(1)
    return tokens.view(steps, size.batch, size.seq + 1)


class StepTimer(pl.Callback):
    """``clock()`` (``perf_counter``: wall time) at every batch start; ``times[i]`` is batch ``i``'s start to batch
    ``i + 1``'s."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.marks: list[float] = []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, i: int) -> None:
        self.marks.append(self.clock())

    @property
    def times(self) -> list[float]:
        return [b - a for a, b in zip(self.marks, self.marks[1:], strict=False)]


def make_trainer(config: str, steps: int, root: str, first: pl.Callback) -> pl.Trainer:
    """The configuration's Trainer; ``first`` is placed before every other callback."""
    common: dict[str, Any] = dict(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        logger=CSVLogger(root, name=config),
        default_root_dir=root,  # the preset's stability report lands here
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    if config == "bare":
        return pl.Trainer(gradient_clip_val=1.0, callbacks=[first], **common)
    trainer = StableTrainer.from_preset(PRESET, **PRESET_OVERRIDES, **common)
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        if isinstance(callback, TrainingHealthMonitor):
            callback.report = False  # written in on_train_end, after every measured step: wall time only
    trainer.callbacks.insert(0, first)  # type: ignore[attr-defined]
    return trainer


def model_for(size: Size, optimizer: str) -> Decoder:
    torch.manual_seed(0)  # the same initial weights in every run
    return Decoder(size, optimizer)


def timed_run(config: str, size: Size, optimizer: str, tokens: Tensor, root: str) -> list[float]:
    timer = StepTimer()
    trainer = make_trainer(config, tokens.shape[0], root, timer)
    trainer.fit(model_for(size, optimizer), DataLoader(Batches(tokens), batch_size=None))
    return timer.times


def counted_run(config: str, size: Size, optimizer: str, tokens: Tensor, root: str) -> tuple[list[int], list[int]]:
    """Host syncs and host-made tensors of each step (one run, both counters active)."""
    syncs, host_data = SyncCounter(), HostDataCounter()
    sync_steps, host_steps = StepSyncCounter(syncs), StepSyncCounter(host_data)
    trainer = make_trainer(config, tokens.shape[0], root, sync_steps)
    trainer.callbacks.insert(1, host_steps)  # type: ignore[attr-defined]
    with syncs, host_data:
        trainer.fit(model_for(size, optimizer), DataLoader(Batches(tokens), batch_size=None))
    return sync_steps.per_step, host_steps.per_step


@dataclass
class Result:
    steps: int  # timed steps per run
    ratios: list[float]  # per pair: median preset step / median bare step
    medians: dict[str, list[float]]  # per configuration: its median step time in each run (s)
    syncs: dict[str, list[int]]  # per configuration: host syncs of each step
    host_data: dict[str, list[int]]  # per configuration: tensors built from host data, each step


def measure(size: Size, optimizer: str, args: argparse.Namespace, root: str) -> Result:
    tokens = bigram_tokens(size, args.warmup + args.steps + 1)
    medians: dict[str, list[float]] = {c: [] for c in CONFIGS}
    ratios = []
    for r in range(args.repeats):
        order = CONFIGS if r % 2 == 0 else CONFIGS[::-1]
        pair: dict[str, float] = {}
        for config in order:
            times = timed_run(config, size, optimizer, tokens, root)[args.warmup :]
            pair[config] = statistics.median(times)
            medians[config].append(pair[config])
        ratios.append(pair["preset"] / pair["bare"])
    count_tokens = bigram_tokens(size, args.count_steps)
    syncs, host_data = {}, {}
    for config in CONFIGS:
        syncs[config], host_data[config] = counted_run(config, size, optimizer, count_tokens, root)
    return Result(args.steps, ratios, medians, syncs, host_data)


def step_kinds(n: int) -> dict[str, list[int]]:
    """Batch indices of an ``n``-step run by kind: the first step, the non-logging steps, the first logging step
    and the later ones (Lightning logs batch ``i`` when ``(i + 1) % log_every_n_steps == 0``)."""
    logging_steps = [i for i in range(n) if (i + 1) % LOG_EVERY == 0]
    return {
        "first": [0],
        "non-logging": [i for i in range(1, n) if i not in logging_steps],
        "1st logging": logging_steps[:1],
        "later logging": logging_steps[1:],
    }


def main(argv: list[str] | None = None) -> dict[tuple[str, str], float]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--size",
        nargs="+",
        choices=list(SIZES),
        default=list(SIZES),
        help="model sizes, each measured on its own (default: tiny small)",
    )
    parser.add_argument(
        "--optimizers",
        nargs="+",
        choices=["adamw", "adamw_foreach", "adamw_fused"],
        default=["adamw", "adamw_foreach", "adamw_fused"],
        help="torch.optim.AdamW as torch builds it by default, with foreach=True, with fused=True (default: all)",
    )
    parser.add_argument("--repeats", type=int, default=7, help="paired runs (bare + preset) per case (default 7)")
    parser.add_argument("--warmup", type=int, default=5, help="steps dropped at the start of each run (default 5)")
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help="timed steps per run after the warm-up (default: "
        + ", ".join(f"{k} {v}" for k, v in DEFAULT_STEPS.items())
        + ")",
    )
    parser.add_argument(
        "--count-steps",
        type=int,
        default=101,
        help="steps of each configuration's sync-counting run (default 101: logging steps 50 and 100)",
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="torch CPU threads (default 1: steadier timings on a shared machine)"
    )
    parser.add_argument(
        "--no-backoff", action="store_true", help="the preset without its LR back-off (lr_backoff=None): its own cost"
    )
    args = parser.parse_args(argv)
    PRESET_OVERRIDES.clear()
    if args.no_backoff:
        PRESET_OVERRIDES["lr_backoff"] = None
    if args.repeats < 1 or args.warmup < 0 or (args.steps is not None and args.steps < 1) or args.count_steps < 2:
        parser.error("needs --repeats >= 1, --warmup >= 0, --steps >= 1 and --count-steps >= 2")

    wall = time.perf_counter()
    load_start = os.getloadavg()[0]
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")  # Lightning's dataloader-worker hints
    for name in ("lightning.pytorch", "lightning.fabric", "lightning_stability"):
        logging.getLogger(name).setLevel(logging.ERROR)

    results: dict[tuple[str, str], Result] = {}
    with tempfile.TemporaryDirectory() as root:
        for size_name in args.size:
            steps = args.steps if args.steps is not None else DEFAULT_STEPS[size_name]
            run_args = argparse.Namespace(**{**vars(args), "steps": steps})
            for optimizer in args.optimizers:
                results[size_name, optimizer] = measure(SIZES[size_name], optimizer, run_args, root)
    wall = time.perf_counter() - wall

    now = datetime.now(timezone.utc).strftime("%a %b %d %H:%M UTC %Y")
    print(
        f"{now}; {os.cpu_count()} CPUs ({platform.machine()}), load average {load_start:.1f} at the start and "
        f"{os.getloadavg()[0]:.1f} at the end; torch {torch.__version__}, lightning {pl.__version__}, "
        f"{args.threads} torch thread(s)"
    )
    print(
        f"bare: Trainer(gradient_clip_val=1.0), constant LR; preset: StableTrainer.from_preset({PRESET!r}"
        + (", lr_backoff=None)" if args.no_backoff else ")")
    )
    for size_name in args.size:
        params = sum(p.numel() for p in Decoder(SIZES[size_name], "adamw").parameters())
        print(f"  {size_name}: {SIZES[size_name].describe()}; {params / 1e6:.2f}M parameters")

    print(
        f"step time: median over the steps of a run ({args.warmup} warm-up steps dropped); ratio: preset / bare "
        f"for each pair of runs, median [min, max] over {args.repeats} pairs"
    )
    header = (
        f"{'size':<6} {'optimizer':<11} {'steps':>5} {'bare ms':>8} {'preset ms':>9} {'ratio':>6} {'min':>6} {'max':>6}"
    )
    print(header)
    print("-" * len(header))
    summary: dict[tuple[str, str], float] = {}
    for (size_name, optimizer), res in results.items():
        ratio = statistics.median(res.ratios)
        summary[size_name, optimizer] = ratio
        bare_ms, preset_ms = (1e3 * statistics.median(res.medians[c]) for c in CONFIGS)
        print(
            f"{size_name:<6} {optimizer:<11} {res.steps:>5} {bare_ms:>8.2f} {preset_ms:>9.2f} {ratio:>6.3f} "
            f"{min(res.ratios):>6.3f} {max(res.ratios):>6.3f}"
        )

    print(
        f"per step, mean over the steps of each kind in a {args.count_steps}-step run: host syncs (.item(), bool(), "
        f"copies to the host) and tensors made from host data (blocking host-to-device copies on a GPU)"
    )
    header = (
        f"{'size':<6} {'optimizer':<11} {'steps':<13} {'n':>3} {'syncs:bare':>10} {'preset':>6} {'extra':>6} "
        f"{'made:bare':>9} {'preset':>6} {'extra':>6}"
    )
    print(header)
    print("-" * len(header))
    for (size_name, optimizer), res in results.items():
        for kind, steps in step_kinds(len(res.syncs["bare"])).items():
            if not steps:
                continue
            cells = []
            for counts in (res.syncs, res.host_data):
                b, p = (statistics.fmean(counts[c][i] for i in steps) for c in CONFIGS)
                cells += [f"{b:.2f}", f"{p:.2f}", f"{p - b:+.2f}"]
            print(
                f"{size_name:<6} {optimizer:<11} {kind:<13} {len(steps):>3} {cells[0]:>10} {cells[1]:>6} "
                f"{cells[2]:>6} {cells[3]:>9} {cells[4]:>6} {cells[5]:>6}"
            )
    print("target (issue 11): ratio <= 1.03 and no extra sync on non-logging steps")
    for (size_name, optimizer), res in results.items():
        steps = step_kinds(len(res.syncs["bare"]))["non-logging"]
        extra = statistics.fmean(res.syncs["preset"][i] - res.syncs["bare"][i] for i in steps)
        ratio = summary[size_name, optimizer]
        verdict = "met" if ratio <= 1.03 and extra == 0 else "NOT met"
        print(f"  {size_name} {optimizer}: {verdict} (ratio {ratio:.3f}, {extra:+.2f} syncs per non-logging step)")
    print(f"wall time of the whole benchmark: {wall:.1f} s")
    return summary


if __name__ == "__main__":
    main()
