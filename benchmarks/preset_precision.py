"""Benchmark: what a preset's precision costs on this CPU, against a plain fp32 Trainer in the same run.

Every configuration trains the same model on the same batches from the same initial weights: the demo's
character-level GPT (``lightning_stability.demo.model.CharGPT``: 6 Post-LN blocks, width 64, 4 heads, context 64,
AdamW lr 1e-2) on the demo's corpus, batch 16. The configurations:

* ``plain fp32`` -- ``lightning.pytorch.Trainer(precision="32-true")``: the baseline of every ratio;
* ``plain bf16`` -- ``Trainer(precision="bf16-mixed")``: bf16 autocast on this CPU;
* ``plain fp16`` -- ``Trainer(plugins=[MixedPrecision("16-mixed", "cpu", scaler=GradScaler("cpu"))])``: fp16
  autocast with a loss scaler on this CPU (Lightning turns ``precision="16-mixed"`` on a CPU into bf16);
* ``gpt bf16`` -- ``StableTrainer.from_preset("gpt", precision="bf16-mixed")``: what ``from_preset("gpt")`` built on
  every CPU before a preset looked at what the CPU runs fast;
* ``gpt`` -- ``StableTrainer.from_preset("gpt")``: the preset's own choice on this CPU (printed);
* ``175b fp16`` -- ``StableTrainer.from_preset("175b", accumulation=1, precision="16-mixed")``: the 175b recipe's
  fp16 with its loss scaler, as it ran on every CPU before;
* ``175b`` -- ``StableTrainer.from_preset("175b", accumulation=1)``: its own choice on this CPU. ``accumulation=1``
  in both 175b arms, so that every batch is a whole optimizer step as in the other arms.

The presets run with ``checkpoint=False`` and no logger in every arm. A step's time is one batch start to the next
(a callback placed first), in this process's CPU time (``--clock process``, the default: on a shared machine the
wall time follows whatever else runs; with one torch thread the CPU time is the step's work) or in wall time
(``--clock wall``); a run trains ``--warmup`` + ``--steps`` + 1 batches and its figure is the median of the
``--steps`` timed ones. ``--repeats`` rounds, each running every configuration once, the order rotated between
rounds; each round's ratio is the configuration's figure over ``plain fp32``'s in that round. Printed: the median
ratio and its min and max over rounds, and each configuration's median step (ms). ``--threads`` torch threads
(default 1: the figures do not depend on what else the machine runs on its other core).

Run from the repository root::

    python -m benchmarks.preset_precision     # defaults: --steps 30 --warmup 3 --repeats 5 --threads 1 --clock process
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
import platform
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins import MixedPrecision
from torch.utils.data import DataLoader

from benchmarks.overhead import StepTimer
from lightning_stability import StableTrainer, _compat
from lightning_stability.demo.model import CharGPT, CorpusWindows, load_corpus

BATCH, CONTEXT, LAYERS = 16, 64, 6


CLOCKS: dict[str, Callable[[], float]] = {"process": time.process_time, "wall": time.perf_counter}


def _plain(**kwargs: Any) -> Callable[[dict[str, Any]], pl.Trainer]:
    return lambda common: pl.Trainer(**common, **kwargs)


def _preset(name: str, **kwargs: Any) -> Callable[[dict[str, Any]], pl.Trainer]:
    return lambda common: StableTrainer.from_preset(name, checkpoint=False, **common, **kwargs)


def _fp16_plugin() -> list[MixedPrecision]:
    return [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))]


CONFIGS: dict[str, Callable[[dict[str, Any]], pl.Trainer]] = {
    "plain fp32": _plain(precision="32-true"),
    "plain bf16": _plain(precision="bf16-mixed"),
    "plain fp16": lambda common: pl.Trainer(**common, plugins=_fp16_plugin()),
    "gpt bf16": _preset("gpt", precision="bf16-mixed"),
    "gpt": _preset("gpt"),
    "175b fp16": _preset("175b", accumulation=1, precision="16-mixed"),
    "175b": _preset("175b", accumulation=1),
}


def run(config: str, steps: int, root: str, clock: Callable[[], float]) -> tuple[float, str]:
    """The median step (s) of one run of ``config``, and the precision it ran."""
    timer = StepTimer(clock)
    common: dict[str, Any] = dict(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        logger=False,
        default_root_dir=root,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        callbacks=[timer],
    )
    trainer = CONFIGS[config](common)
    trainer.callbacks.remove(timer)
    trainer.callbacks.insert(0, timer)  # first: its mark comes before any other callback's batch-start work
    corpus = load_corpus()
    torch.manual_seed(0)
    model = CharGPT(corpus.vocab, layers=LAYERS, context=CONTEXT)
    data = DataLoader(CorpusWindows(corpus, steps * BATCH, CONTEXT), batch_size=BATCH)
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):  # the health report's path
        warnings.simplefilter("ignore")
        trainer.fit(model, data)
    return statistics.median(timer.times), str(trainer.precision_plugin.precision)


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="timed steps per run (30)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (3)")
    parser.add_argument("--repeats", type=int, default=5, help="rounds of every configuration (5)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1)")
    parser.add_argument("--clock", default="process", choices=list(CLOCKS), help="process CPU time or wall time")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    args = parser.parse_args(argv)
    with quiet(args.threads):
        measure(args)


@contextlib.contextmanager
def quiet(threads: int) -> Iterator[None]:
    """``threads`` torch threads and Lightning's info lines off, both put back after (a test calls ``main``)."""
    names = ("lightning.pytorch", "lightning.fabric", "lightning_stability")
    levels, before = [logging.getLogger(n).level for n in names], torch.get_num_threads()
    torch.set_num_threads(threads)
    for name in names:
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        yield
    finally:
        torch.set_num_threads(before)
        for name, level in zip(names, levels, strict=True):
            logging.getLogger(name).setLevel(level)


def measure(args: argparse.Namespace) -> None:
    """Every configuration, ``args.repeats`` rounds; the table."""
    configs = ["plain fp32", *(c for c in args.configs if c != "plain fp32")]
    flags = torch.cpu.get_capabilities()
    units = ", ".join(f"{k} {'yes' if flags.get(k) else 'no'}" for k in ("avx512_bf16", "amx_bf16", "amx_fp16"))
    amx = sorted(str(d).removeprefix("torch.") for d in _compat.cpu_amx_dtypes()) or ["none"]
    load = os.getloadavg()[0]
    print(
        f"{datetime.now(timezone.utc):%a %b %d %H:%M UTC %Y}; {cpu_name()}, {os.cpu_count()} CPUs; {units}; "
        f"AMX dtypes usable: {', '.join(amx)}; load average {load:.1f} at the start; torch {torch.__version__}, "
        f"lightning {pl.__version__}, {args.threads} torch thread(s)"
    )
    times: dict[str, list[float]] = {c: [] for c in configs}
    ratios: dict[str, list[float]] = {c: [] for c in configs}
    ran: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as root:
        for r in range(args.repeats):
            order = configs[r % len(configs) :] + configs[: r % len(configs)]
            for config in order:
                step, ran[config] = run(config, args.warmup + args.steps + 1, root, CLOCKS[args.clock])
                times[config].append(step)
            for config in configs:
                ratios[config].append(times[config][-1] / times["plain fp32"][-1])
    print(f"load average {os.getloadavg()[0]:.1f} at the end")
    print(
        f"step ({args.clock} time): median of {args.steps} steps after {args.warmup} warm-up; ratio: / plain fp32 in "
        "the same round"
    )
    print(f"{'config':<12} {'precision':<11} {'ms':>8} {'ratio':>7} {'min':>7} {'max':>7}")
    for config in configs:
        ms = 1e3 * statistics.median(times[config])
        rs = ratios[config]
        print(f"{config:<12} {ran[config]:<11} {ms:8.1f} {statistics.median(rs):7.2f} {min(rs):7.2f} {max(rs):7.2f}")


if __name__ == "__main__":
    main()
