"""Benchmark: updates lost to loss-scale calibration, ``init_scale="auto"`` versus 65536, in one run.

For models whose gradients are scaled by a factor (the loss times ``grad_mult``), train fp16 on the CPU
with three scalers and count the optimizer steps skipped before the first applied update, and in all:

* torch's ``GradScaler(init_scale=65536)`` (no hysteresis),
* ``LossScaleTuner(init_scale=65536)`` (hysteresis 2, the default),
* ``LossScaleTuner(init_scale="auto")``.

Then the cost of the tuner against torch's scaler, both starting at 65536 on the same model:

* the time per training step (interleaved repeats; the median of per-repeat ratios) against torch's scaler
  alone and against torch's scaler plus an empty Lightning ``Callback`` (what the hook calls of any
  callback cost), with torch's default AdamW (the tuner decides on the host) and with ``fused=True`` (on
  the device);
* the tensor ops per training step (each one a kernel launch on a GPU), counted with a dispatch mode;
* ``update()`` alone, after the ``step()`` of a plain optimizer (torch reads the overflow flag on the host;
  so does the tuner, which then decides there) and of a fused one (the flag stays on the device).

Run: ``python -m benchmarks.loss_scale_auto [--steps 30] [--repeats 11] [--timed-steps 200]``.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins import MixedPrecision
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_stability.amp.callback import LossScaleTuner
from lightning_stability.amp.scaler import TunedGradScaler
from tests.helpers import OpCounter, StepSyncCounter


class MLP(pl.LightningModule):
    def __init__(self, grad_mult: float, width: int = 128, n: int = 4096, fused: bool = False) -> None:
        super().__init__()
        self.fused = fused
        torch.manual_seed(0)
        self.net = nn.Sequential(
            nn.Linear(32, width), nn.GELU(), nn.Linear(width, width), nn.GELU(), nn.Linear(width, 1)
        )
        self.grad_mult = grad_mult
        x = torch.randn(n, 32)
        self.data = TensorDataset(x, x.sum(dim=1, keepdim=True).sin())

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x).float(), y) * self.grad_mult

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3, fused=self.fused)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=64)


class Applied(pl.Callback):
    """Whether each step changed the weights (a skipped step leaves them bit-identical)."""

    def __init__(self) -> None:
        self.applied: list[bool] = []
        self._before: torch.Tensor | None = None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self._before = next(pl_module.parameters()).detach().clone()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        assert self._before is not None
        self.applied.append(not torch.equal(self._before, next(pl_module.parameters())))


class StepTimer(pl.Callback):
    """Per-step CPU time of this thread (torch runs single-threaded here, so other jobs on a shared
    machine do not count) and wall time."""

    def __init__(self, warmup: int) -> None:
        self.warmup, self.steps = warmup, 0
        self.cpu = self.wall = 0.0

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if trainer.global_step == self.warmup:
            self.cpu, self.wall = time.thread_time(), time.perf_counter()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.steps = trainer.global_step - self.warmup
        self.cpu = (time.thread_time() - self.cpu) / self.steps
        self.wall = (time.perf_counter() - self.wall) / self.steps


def fit(grad_mult: float, scaler: str, steps: int, callbacks: list[pl.Callback], fused: bool = False) -> pl.Trainer:
    torch_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    if scaler == "tuner-65536":
        callbacks = [LossScaleTuner(init_scale=2.0**16, fit_start_checks=False), *callbacks]
    elif scaler == "tuner-auto":
        callbacks = [LossScaleTuner(init_scale="auto", fit_start_checks=False), *callbacks]
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=torch_scaler)],
    )  # fmt: skip
    trainer.fit(MLP(grad_mult, fused=fused))
    return trainer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--timed-steps", type=int, default=200)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)  # one thread: its CPU time is the whole cost of a step
    import logging

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)

    scalers = ["torch-65536", "tuner-65536", "tuner-auto"]
    print(f"Steps skipped before the first applied update (and in all, of {args.steps}):")
    print(f"{'grad x':>8} | " + " | ".join(f"{s:>18}" for s in scalers))
    for grad_mult in (1e-3, 1.0, 1e2, 1e3, 1e4):
        cells = []
        for scaler in scalers:
            applied = Applied()
            trainer = fit(grad_mult, scaler, args.steps, [applied])
            first = applied.applied.index(True) if any(applied.applied) else args.steps
            final = trainer.precision_plugin.scaler.get_scale()  # type: ignore[attr-defined]
            cells.append(f"{first:>3} ({args.steps - sum(applied.applied):>2}) s={final:<8g}")
        print(f"{grad_mult:>8g} | " + " | ".join(f"{c:>18}" for c in cells))

    # Per-step cost. The machine may be shared: runs are interleaved and the median reported.
    runs = {  # name: (scaler, an empty callback too, fused AdamW)
        "torch": ("torch-65536", False, False),
        "torch + empty callback": ("torch-65536", True, False),
        "tuner": ("tuner-65536", False, False),
        "torch, fused AdamW": ("torch-65536", False, True),
        "tuner, fused AdamW": ("tuner-65536", False, True),
    }
    timers: dict[str, list[StepTimer]] = {name: [] for name in runs}
    for _ in range(args.repeats):
        for name, (scaler, empty, fused) in runs.items():
            timer = StepTimer(warmup=10)
            callbacks: list[pl.Callback] = [timer, pl.Callback()] if empty else [timer]
            fit(1.0, scaler, 10 + args.timed_steps, callbacks, fused=fused)
            timers[name].append(timer)
    cpu = {name: statistics.median(t.cpu for t in ts) for name, ts in timers.items()}
    print(f"\nCPU time per training step, median of {args.repeats} interleaved runs of {args.timed_steps} steps:")
    for name, value in cpu.items():
        print(f"  {name:<24} {value * 1e3:.3f} ms")
    # one ratio per repeat (its runs ran back to back), so a slow spell of a shared machine cancels out
    for tuned, base in (
        ("tuner", "torch"),
        ("tuner", "torch + empty callback"),
        ("tuner, fused AdamW", "torch, fused AdamW"),
    ):
        ratios = sorted(t.cpu / b.cpu for t, b in zip(timers[tuned], timers[base], strict=True))
        print(
            f"  {tuned} / {base}: median {statistics.median(ratios):.3f} "
            f"(per-repeat ratios {ratios[0]:.3f}-{ratios[-1]:.3f})"
        )
    ops = {name: ops_per_step(scaler) for name, scaler in (("torch", "torch-65536"), ("tuner", "tuner-65536"))}
    print(
        f"\nTensor ops per training step (mean over steps 10-29): torch GradScaler {ops['torch']:.1f}, "
        f"LossScaleTuner {ops['tuner']:.1f}"
    )

    # The update alone, after a real `step()`: with a plain optimizer torch's `step()` reads the overflow flag on
    # the host and the tuned scaler decides there; with a fused one the flag stays on the device.
    costs: dict[tuple[str, bool], list[float]] = {(n, f): [] for f in (False, True) for n in ("torch", "tuned")}
    for _ in range(args.repeats):
        for name, fused in costs:
            costs[name, fused].append(update_cost(name, fused, calls=2000))
    print(f"\nscaler.update() alone, after step() (CPU thread time, best of {args.repeats} x 2000 calls):")
    for fused, label in ((False, "plain SGD (decided on the host)"), (True, "fused SGD (decided on the device)")):
        base, tuned = min(costs["torch", fused]), min(costs["tuned", fused])
        print(
            f"  {label:<34} torch GradScaler {base * 1e6:.1f} us, TunedGradScaler {tuned * 1e6:.1f} us, "
            f"ratio {tuned / base:.2f}"
        )


def ops_per_step(scaler: str) -> float:
    """Mean tensor ops per training step (batch start to the next batch start), after 10 warm-up steps."""
    ops = OpCounter()
    steps = StepSyncCounter(ops)
    with ops:
        fit(1.0, scaler, 30, [steps])
    return statistics.mean(steps.per_step[10:])


def update_cost(name: str, fused: bool, calls: int) -> float:
    """Seconds per ``update()`` call, each after a finite step of a one-parameter SGD (``fused`` or not)."""
    scaler = torch.amp.GradScaler("cpu") if name == "torch" else TunedGradScaler("cpu")
    param = nn.Parameter(torch.ones(4))
    opt = torch.optim.SGD([param], lr=0.0, fused=fused)
    total = 0.0
    for _ in range(calls):
        opt.zero_grad()
        scaler.scale(param.sum()).backward()
        scaler.step(opt)
        start = time.thread_time()
        scaler.update()
        total += time.thread_time() - start
    return total / calls


if __name__ == "__main__":
    main()
