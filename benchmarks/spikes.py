"""Benchmark: TrainingHealthMonitor's spike responses on data with a few poisoned batches, all in one run.

A small MLP (3 linear layers) learns a fixed random teacher network by regression on synthetic data, with
AdamW at a learning rate that trains stably on clean data. In every seed, ``--poison`` batches at random
positions (drawn per seed between step 30, after the monitor's 25-step warm-up, and ``--steps`` - 10) have
their inputs and targets multiplied by ``--factor``: a plain run's update on such a batch wrecks the weights.
Each configuration trains the same seeds on the same data from the same initial weights:

* ``clean``         -- bare Trainer on the data without the poisoned batches (the reference);
* ``bare``          -- bare Trainer on the poisoned data;
* ``clip_val=1.0``  -- Lightning's ``gradient_clip_val=1.0`` (clip the gradient norm to 1);
* ``monitor:warn`` / ``monitor:clip`` / ``monitor:skip`` / ``monitor:rollback`` -- ``TrainingHealthMonitor``
  with that response (rollback: log every 5 steps, snapshot every 20, skip 10 batches, at most 3 rollbacks);
* ``monitor:skip,loss`` -- ``TrainingHealthMonitor(response="skip", skip_on="loss")``: skips on a loss spike
  only, a gradient-norm spike alone is applied (the presets' setting);
* ``monitor:preset`` -- the presets' two spike parts as they ship: ``skip_on="loss"`` and ``PrecursorMonitor(
  lr_backoff=LRBackoff("update_ratio", 0.02), other_optimizers="warn")`` (the LR back-off);
* ``zclip``         -- ZClip's own Lightning callback (``pip install zclip``; ``max_grad_norm=None``, so only
  its adaptive clipping acts, as in ``monitor:clip``), when the package is installed.

After training, the final loss is the mean squared error on a fixed clean evaluation set (4096 samples, the
same for every seed and configuration). A run has *diverged* when that loss is NaN/inf, or above
``--bound`` times the median final loss of the ``clean`` runs, or when the monitor stopped it with
``TrainingDivergedError`` (its loss then counts as inf). Prints, per configuration: diverged runs (k/N), the
median and the worst final loss, the median number of optimizer steps skipped (monitor only), the poisoned
batches whose update was skipped over all seeds (``caught``, monitor only; from the monitor's history), and its time as
a ratio to the ``bare`` configuration's: the median over seeds of ``fit`` time / the same seed's bare ``fit`` time
(seeds outermost, configurations interleaved within each seed, so drift on the machine hits all alike).

Run: ``python -m benchmarks.spikes [--seeds 10] [--steps 300] [--factor 1000] [--poison 3]``.
"""

from __future__ import annotations

import argparse
import logging
import math
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import version
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from lightning_stability import Outcome, StepLedger, TrainingDivergedError, TrainingHealthMonitor
from lightning_stability.precursors import LRBackoff, PrecursorMonitor
from lightning_stability.presets import get_preset

D_IN, HIDDEN, BATCH, EVAL_SIZE = 32, 128, 64, 4096
MONITOR_WARMUP = 25  # TrainingHealthMonitor's default warmup_steps: no spike is called before it
FIRST_POISON, TAIL = MONITOR_WARMUP + 5, 10  # poisoned batches lie in [FIRST_POISON, steps - TAIL)


def teacher(x: Tensor) -> Tensor:
    """The fixed target function: a random 2-layer tanh network (the same in every seed)."""
    g = torch.Generator().manual_seed(1234)
    w1 = torch.randn(D_IN, 64, generator=g) / math.sqrt(D_IN)
    w2 = torch.randn(64, 1, generator=g) / math.sqrt(64)
    return torch.tanh(x @ w1) @ w2


def make_data(n: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    x = torch.randn(n, D_IN, generator=generator)
    return x, teacher(x) + 0.05 * torch.randn(n, 1, generator=generator)


class Batches(Dataset[tuple[Tensor, Tensor]]):
    """Pre-built batches, served in order (one per optimizer step)."""

    def __init__(self, x: Tensor, y: Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return self.x.shape[0]

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        return self.x[i], self.y[i]


class Regressor(pl.LightningModule):
    def __init__(self, lr: float) -> None:
        super().__init__()
        self.lr = lr
        self.net = nn.Sequential(
            nn.Linear(D_IN, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, 1)
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)


@dataclass
class Config:
    name: str
    poisoned: bool = True
    trainer_kwargs: dict[str, Any] = field(default_factory=dict)
    callbacks: Callable[[], list[pl.Callback]] = list


@dataclass
class Run:
    loss: float  # final MSE on the clean evaluation set; inf when stopped
    stopped: bool  # by TrainingDivergedError
    skipped: int  # optimizer steps the monitor skipped (spikes, non-finite values, the rollback data window)
    seconds: float  # trainer.fit alone
    caught: int = 0  # poisoned batches whose update the monitor skipped


def monitor(response: str, **options: Any) -> Callable[[], list[pl.Callback]]:
    def build() -> list[pl.Callback]:
        kwargs: dict[str, Any] = {"report": False, **options}
        if response == "rollback":  # scaled down from PaLM's ~100-step snapshots and 200-500 skipped batches
            kwargs.update(log_every_n_steps=5, snapshot_every=20, skip_batches=10, max_rollbacks=3)
        return [TrainingHealthMonitor(response=response, **kwargs)]  # type: ignore[arg-type]

    return build


def preset_parts() -> list[pl.Callback]:
    """The presets' health monitor and LR back-off, with the base preset's settings."""
    base = get_preset("gpt")
    assert base.health == "skip" and base.lr_backoff is not None
    backoff = PrecursorMonitor(lr_backoff=LRBackoff("update_ratio", base.lr_backoff), other_optimizers="warn")
    return [*monitor("skip", skip_on=base.skip_on)(), backoff]


def zclip_config() -> Config | None:
    try:
        from zclip import ZClipLightningCallback  # type: ignore[import-not-found, import-untyped, unused-ignore]
    except ImportError:
        return None
    # max_grad_norm=None: adaptive clipping only (its default 1.0 would add a fixed clip to 1.0 as well)
    return Config("zclip", callbacks=lambda: [ZClipLightningCallback(max_grad_norm=None)])


def configurations() -> list[Config]:
    configs = [
        Config("clean", poisoned=False),
        Config("bare"),
        Config("clip_val=1.0", trainer_kwargs={"gradient_clip_val": 1.0}),
        *(Config(f"monitor:{r}", callbacks=monitor(r)) for r in ("warn", "clip", "skip", "rollback")),
        Config("monitor:skip,loss", callbacks=monitor("skip", skip_on="loss")),
        Config("monitor:preset", callbacks=preset_parts),
    ]
    zclip = zclip_config()
    if zclip is None:
        print("zclip: could not be imported (pip install zclip); its configuration is left out")
    else:
        configs.append(zclip)
    return configs


def run_once(config: Config, seed: int, args: argparse.Namespace, eval_set: tuple[Tensor, Tensor]) -> Run:
    """Train one seed under one configuration, then score it on the evaluation set."""
    g = torch.Generator().manual_seed(seed)
    x, y = make_data(args.steps * BATCH, g)
    x, y = x.view(args.steps, BATCH, D_IN), y.view(args.steps, BATCH, 1)
    positions = FIRST_POISON + torch.randperm(args.steps - TAIL - FIRST_POISON, generator=g)[: args.poison]
    if config.poisoned:
        x, y = x.clone(), y.clone()
        x[positions] *= args.factor
        y[positions] *= args.factor
    pl.seed_everything(seed, verbose=False)
    model = Regressor(args.lr)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=args.steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        callbacks=config.callbacks(),
        **config.trainer_kwargs,
    )
    start = time.perf_counter()
    try:
        trainer.fit(model, DataLoader(Batches(x, y), batch_size=None))
        stopped = False
    except TrainingDivergedError:
        stopped = True
    seconds = time.perf_counter() - start
    with torch.no_grad():
        model.eval()
        loss = nn.functional.mse_loss(model(eval_set[0]), eval_set[1]).item()
    monitored = config.name.startswith("monitor")
    counts = StepLedger.of(trainer).record_of().counts.tolist() if monitored else [0] * len(Outcome)
    caught = 0
    if monitored:  # the steps whose update was not applied, from the monitor's history
        health = next(cb for cb in trainer.callbacks if isinstance(cb, TrainingHealthMonitor))  # type: ignore[attr-defined]
        series = health.history.series
        skipped = {int(step) for step, o in zip(series["step"], series["outcome"], strict=True) if o != 0}
        caught = sum(int(p) in skipped for p in positions.tolist())
    return Run(math.inf if stopped else loss, stopped, sum(counts[Outcome.SKIPPED_NONFINITE :]), seconds, caught)


WIDTHS = (17, 8, 12, 11, 8, 7, 12)


def row(*cells: str) -> str:
    """One table row: the configuration left-aligned, the numbers right-aligned."""
    first, *rest = cells
    return " ".join([f"{first:<{WIDTHS[0]}}", *(f"{c:>{w}}" for c, w in zip(rest, WIDTHS[1:], strict=True))])


def main(argv: list[str] | None = None) -> dict[str, int]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=10, help="seeds per configuration (default 10)")
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps per run (default 300)")
    parser.add_argument("--poison", type=int, default=3, help="poisoned batches per run (default 3)")
    parser.add_argument(
        "--factor", type=float, default=1000.0, help="scale of a poisoned batch's inputs and targets (default 1000)"
    )
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default 3e-3)")
    parser.add_argument(
        "--bound", type=float, default=10.0, help="diverged: final loss above this times the clean median (default 10)"
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="torch CPU threads (default 1: steadier timings on a shared machine)"
    )
    args = parser.parse_args(argv)
    if args.steps < FIRST_POISON + TAIL + args.poison:
        parser.error(f"--steps must be at least {FIRST_POISON + TAIL + args.poison}")

    wall = time.perf_counter()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")  # the monitor's spike warnings, Lightning's dataloader-worker hints
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    logging.getLogger("lightning.fabric").setLevel(logging.ERROR)
    eval_set = make_data(EVAL_SIZE, torch.Generator().manual_seed(10**6))

    configs = configurations()
    runs: dict[str, list[Run]] = {c.name: [] for c in configs}
    for seed in range(args.seeds):  # seeds outermost: drift on a shared machine hits every configuration alike
        for config in configs:
            runs[config.name].append(run_once(config, seed, args, eval_set))
    wall = time.perf_counter() - wall

    clean_median = statistics.median(r.loss for r in runs["clean"])
    bound = args.bound * clean_median
    zclip = f", zclip {version('zclip')}" if "zclip" in runs else ""
    print(f"torch {torch.__version__}, lightning {pl.__version__}{zclip}, {args.threads} torch thread(s)")
    print(
        f"MLP {D_IN}-{HIDDEN}-{HIDDEN}-1, AdamW lr={args.lr:g}, batch {BATCH}, {args.steps} steps, {args.seeds} seeds; "
        f"{args.poison} poisoned batches per run (inputs and targets x{args.factor:g})"
    )
    print(
        f"diverged: final eval MSE NaN/inf, or > {args.bound:g} x clean median ({clean_median:.4g}) = {bound:.4g}, "
        f"or stopped by TrainingDivergedError (a constant prediction scores {eval_set[1].var().item():.3g})"
    )
    header = row("configuration", "diverged", "median loss", "worst loss", "skipped", "caught", "time x bare")
    print(header)
    print("-" * len(header))
    diverged: dict[str, int] = {}
    for config in configs:
        losses = [r.loss for r in runs[config.name]]
        k = sum(r.stopped or not math.isfinite(r.loss) or r.loss > bound for r in runs[config.name])
        diverged[config.name] = k
        skipped = statistics.median(r.skipped for r in runs[config.name])
        pairs = zip(runs[config.name], runs["bare"], strict=True)
        time_ratio = statistics.median(r.seconds / b.seconds for r, b in pairs)
        cells = (
            config.name,
            f"{k}/{len(losses)}",
            f"{statistics.median(losses):.4g}",
            f"{max(losses):.4g}",
            f"{skipped:g}" if config.name.startswith("monitor") else "-",
            f"{sum(r.caught for r in runs[config.name])}/{args.poison * len(losses)}"
            if config.name.startswith("monitor")
            else "-",
            f"{time_ratio:.2f}",
        )
        print(row(*cells))
    print(f"wall time of the whole benchmark: {wall:.1f} s")
    return diverged


if __name__ == "__main__":
    main()
