"""Benchmark: StepReplay's attributions against the truth over a long CPU run with faults injected at random
steps, and its step-time cost without faults.

**Attribution.** A regression MLP with dropout (16 -> 64 -> 64 -> 1, AdamW, batch 16, a shuffled loader over 4,096
samples; ``--target``: ``linear``, a linear function plus Gaussian noise of std 0.1, whose batch losses have light
tails; ``curved``, the sum of the inputs plus a tenth of the first one squared, whose residual has heavy tails and
spikes of its own by the monitor's rule) trains ``--steps`` steps with ``TrainingHealthMonitor(response="skip")``
and ``StepReplay`` (``max_faults`` above the number of faults, so no run stops). Injected, at random (seeded by
``--seed``): ``--flips`` bit flips (``BitFlip``: bit 30 of one element of the last layer's output, at steps drawn
after the monitor's warm-up) and ``--poisoned`` NaN samples (``PoisonedSamples``). The truth: each flip's step is a
transient fault (unless the same step's batch holds a poisoned sample: then the data), each poisoned sample lies in
a batch attributed to the data and is quarantined, every other step is healthy. Printed: each attribution's count
against the truth, the healthy steps replayed, and the poisoned samples served after their quarantine.

**Cost.** ``benchmarks/overhead.py``'s decoder (``--size``), the ``tiny`` preset against the same preset with
``StepReplay`` added, no faults. ``--repeats`` pairs, the order alternating; each run's figure is the median step
time after ``--warmup`` steps; printed: the median of the pair ratios (with replay / without), their range, and the
wall time a step spends in StepReplay's own hooks (:class:`HookClock`), a figure the machine's noise moves less.

Run: ``python benchmarks/replay.py`` (``--quick``: a short run of both, as the tests do).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.overhead import SIZES, Batches, StepTimer, bigram_tokens, model_for  # noqa: E402
from lightning_stability import (  # noqa: E402
    BitFlip,
    PoisonedSamples,
    StableTrainer,
    StepLedger,
    StepReplay,
    TrainingHealthMonitor,
)

WARMUP = 10  # the monitor's warm-up steps: flips are drawn after it


class LossSpikes(pl.Callback):
    """The steps whose update's loss the monitor called a spike or non-finite, as it scored them: after a replay,
    the replayed values (instrumentation: one host read a step)."""

    def __init__(self) -> None:
        self.steps: set[int] = set()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        ledger = StepLedger.of(trainer)  # the step just closed (one micro-batch per step here)
        verdict, loss = ledger.health, ledger.step.loss
        if verdict is not None and (bool(verdict.spikes[0]) or (loss is not None and not bool(loss.isfinite()))):
            self.steps.add(trainer.global_step - 1)


class Regression(pl.LightningModule):
    def __init__(self, data: Any) -> None:
        super().__init__()
        self.data = data
        self.net = nn.Sequential(
            nn.Linear(16, 64), nn.GELU(), nn.Dropout(0.1), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 1)
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=16, shuffle=True)


def _targets(x: torch.Tensor, target: str, seed: int) -> torch.Tensor:
    if target == "linear":
        g = torch.Generator().manual_seed(seed + 1)
        w = torch.randn(16, 1, generator=g)
        return x @ w + 0.1 * torch.randn(x.shape[0], 1, generator=g)
    return x.sum(1, keepdim=True) + 0.1 * x[:, :1] ** 2


def attribution(steps: int, flips: int, poisoned: int, seed: int, target: str = "curved") -> dict[str, Any]:
    pick = random.Random(seed)
    flip_steps = sorted(pick.sample(range(WARMUP + 5, steps), flips))
    bad = sorted(pick.sample(range(4096), poisoned))
    pl.seed_everything(seed)
    x = torch.randn(4096, 16, generator=torch.Generator().manual_seed(seed))
    data = PoisonedSamples(TensorDataset(x, _targets(x, target, seed)), bad)
    model = Regression(data)
    flip = BitFlip(model, "net.5", step=flip_steps)
    replay = StepReplay(max_faults=flips + 1, quarantine_file=None)
    spikes = LossSpikes()
    trainer = pl.Trainer(
        max_steps=steps,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[TrainingHealthMonitor(response="skip", warmup_steps=WARMUP, report=False), replay, spikes],
    )
    trainer.fit(model)
    events = [e for e in StepLedger.of(trainer).events if e.get("kind") == "replay"]
    by_step = {e["step"]: e for e in events}
    entries = {e["step"]: set(e["indices"]) for e in replay.quarantine.entries}
    data_steps = {s for s, idx in entries.items() if idx & set(bad)}
    right = {"transient": 0, "data": 0}
    wrong: list[str] = []
    for s in flip_steps:
        want = "data" if s in data_steps else "transient"
        got = by_step.get(s, {}).get("cause", "not replayed")
        if got == want:
            right[want] += 1
        else:
            wrong.append(f"flip at step {s}: {got}, expected {want}")
    for s in sorted(data_steps - set(flip_steps)):
        if by_step.get(s, {}).get("cause") == "data":
            right["data"] += 1
        else:
            wrong.append(f"poisoned batch at step {s}: {by_step.get(s, {}).get('cause')}")
    natural = sorted(set(by_step) - set(flip_steps) - data_steps)  # replayed without an injected fault
    spiked = [s for s in natural if s in spikes.steps]  # the monitor's own loss spikes, reproduced by the replay
    healthy_replayed = [s for s in natural if s not in spikes.steps]
    served_twice = sorted(i for i in bad if data.served.count(i) > 1)
    return {
        "flips": flip_steps,
        "flipped": len(flip.flipped),
        "poisoned": bad,
        "right": right,
        "wrong": wrong,
        "healthy_replayed": healthy_replayed,
        "natural_spikes": spiked,
        "quarantined_all_poisoned": set(bad) <= replay.quarantine.indices,
        "served_after_quarantine": served_twice,
        "replays": len(events),
    }


def _preset_trainer(steps: int, root: str, timer: pl.Callback, with_replay: bool) -> pl.Trainer:
    extra = [StepReplay(quarantine_file=None)] if with_replay else []
    trainer = StableTrainer.from_preset(
        "tiny",
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        logger=False,
        default_root_dir=root,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        callbacks=extra,
    )
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        if isinstance(callback, TrainingHealthMonitor):
            callback.report = False
    trainer.callbacks.insert(0, timer)  # type: ignore[attr-defined]
    return trainer


class HookClock:
    """Wall time spent in StepReplay's own hooks (its look at the step less the monitor's flags, which the monitor
    computes for its own votes anyway), and in the monitor's flags: the part of the step StepReplay adds, measured
    inside the run, where the step-time ratio of two runs carries this machine's noise."""

    OWN = ("on_train_batch_start", "on_before_backward", "after_step", "on_train_batch_end", "_look")

    def __init__(self) -> None:
        self.seconds = {"own": 0.0, "flags": 0.0}
        self._saved: list[tuple[Any, str, Any]] = []

    def __enter__(self) -> HookClock:
        for name in self.OWN:
            self._time(StepReplay, name, "own")
        self._time(TrainingHealthMonitor, "flags_on_host", "flags")
        return self

    def _time(self, owner: Any, name: str, bucket: str) -> None:
        original = owner.__dict__[name]
        self._saved.append((owner, name, original))

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[bucket] += time.perf_counter() - start

        setattr(owner, name, timed)

    def __exit__(self, *exc: Any) -> None:
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self.seconds["own"] -= self.seconds["flags"]  # the look's flags are the monitor's work


def cost(size_name: str, steps: int, warmup: int, repeats: int) -> dict[str, Any]:
    size = SIZES[size_name]
    tokens = bigram_tokens(size, warmup + steps + 1)
    medians: dict[bool, list[float]] = {False: [], True: []}
    ratios: list[float] = []
    own: list[float] = []  # seconds a step in StepReplay's own hooks
    flags: list[float] = []  # seconds a step in the monitor's flags, computed in StepReplay's look
    with tempfile.TemporaryDirectory() as root:
        for pair in range(repeats):
            order = (False, True) if pair % 2 == 0 else (True, False)
            got = {}
            for with_replay in order:
                timer = StepTimer()
                trainer = _preset_trainer(tokens.shape[0], root, timer, with_replay)
                with HookClock() as clock:
                    trainer.fit(model_for(size, "adamw"), DataLoader(Batches(tokens), batch_size=None))
                if with_replay:
                    own.append(clock.seconds["own"] / len(timer.times))
                    flags.append(clock.seconds["flags"] / len(timer.times))
                got[with_replay] = statistics.median(timer.times[warmup:])
                medians[with_replay].append(got[with_replay])
            ratios.append(got[True] / got[False])
    return {
        "ratio": statistics.median(ratios),
        "range": (min(ratios), max(ratios)),
        "ms": {k: 1e3 * statistics.median(v) for k, v in medians.items()},
        "own_ms": 1e3 * statistics.median(own),
        "flags_ms": 1e3 * statistics.median(flags),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2000, help="steps of the attribution run")
    parser.add_argument("--flips", type=int, default=10)
    parser.add_argument("--poisoned", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--target", default="curved", choices=["linear", "curved"], help="the regression's target")
    parser.add_argument("--size", default="small", choices=sorted(SIZES))
    parser.add_argument("--cost-steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="a short run of both parts")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.flips, args.poisoned, args.size, args.cost_steps, args.repeats = 200, 3, 2, "tiny", 20, 1
    torch.set_num_threads(1)
    found = attribution(args.steps, args.flips, args.poisoned, args.seed, args.target)
    print(
        f"attribution ({args.target} target): {args.steps} steps, {args.flips} bit flips at steps {found['flips']}, "
        f"poisoned samples {found['poisoned']}"
    )
    print(
        f"  attributed right: {found['right']} of {args.flips} flips and the poisoned batches; "
        f"wrong: {found['wrong'] or 'none'}"
    )
    print(
        f"  steps replayed: {found['replays']}; without an injected fault: the data's own loss spikes (flagged again "
        f"when replayed) {found['natural_spikes'] or 'none'}, healthy steps {found['healthy_replayed'] or 'none'}"
    )
    print(
        f"  every poisoned sample quarantined: {found['quarantined_all_poisoned']}; "
        f"served again after it: {found['served_after_quarantine'] or 'none'}"
    )
    paid = cost(args.size, args.cost_steps, args.warmup, args.repeats)
    print(
        f"cost ({args.size} decoder, tiny preset, {args.repeats} pairs of {args.cost_steps} steps): with StepReplay / "
        f"without = {paid['ratio']:.3f} (range {paid['range'][0]:.3f}-{paid['range'][1]:.3f}); "
        f"{paid['ms'][False]:.2f} ms without, {paid['ms'][True]:.2f} ms with"
    )
    print(
        f"  in the run with StepReplay, a step spent {paid['own_ms']:.3f} ms in StepReplay's own hooks "
        f"({paid['own_ms'] / paid['ms'][True]:.2%} of the step) and {paid['flags_ms']:.3f} ms in the monitor's flags "
        "(computed at the look instead of in the monitor's own hook)"
    )
    return {"attribution": found, "cost": paid}


if __name__ == "__main__":
    main()
