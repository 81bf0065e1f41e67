"""Benchmark: what router health costs a step of a tiny Mixtral (time and host syncs), against the same Trainer
without it, both timed in one run.

The model: a Hugging Face Mixtral built from a tiny config (``--layers`` layers of width ``--width``, 8 experts of
intermediate size ``2 x width``, top-2, 4 attention heads, vocabulary 256), on random tokens (``--batch`` sequences
of ``--seq`` tokens a step), AdamW (lr 1e-3, ``foreach=True``), fp32. Three configurations train it on the same
data from the same initial weights:

* ``plain``   -- ``lightning.pytorch.Trainer()``, no callback of the package;
* ``router``  -- the same with ``RouterHealthMonitor()``: router health on, watch only (every figure per layer and
  each expert's load share logged);
* ``actions`` -- the same with ``RouterHealthMonitor(balance_bias=1e-3, z_loss=1e-3)``, as the ``moe`` preset
  attaches it.

Each logs to a ``CSVLogger`` every 50 steps (the Trainer's default); no progress bar, model summary or checkpoint.
``--threads`` torch threads (default 1).

* **Step time**, as ``benchmarks/overhead.py`` measures it (its ``StepTimer``, placed first: batch start to the
  next batch start): each run trains ``--warmup`` + ``--steps`` + 1 steps, the warm-up and the last dropped, the
  run's figure the median of the rest. ``--repeats`` rounds: each round runs every configuration once, the order
  rotating between rounds; a round's ratio is a configuration's median over ``plain``'s. Printed: the median of
  the rounds' ratios and their min and max, and each configuration's median step (ms).
* **Host syncs per step**, as ``benchmarks/overhead.py`` counts them (``tests.helpers.SyncCounter``:
  ``.item()``/``bool(t)``/copies to the host; ``HostDataCounter``: tensors made from host data, a blocking copy to
  a GPU): one run of each configuration for ``--count-steps`` steps; the mean per step of each kind (the first, the
  non-logging steps, the logging steps), and the extra over ``plain``.

The target (issue 48): ``router`` <= 1.03x ``plain``, and no extra host read off logging steps. Run from the
repository root (it imports ``tests.helpers``)::

    python -m benchmarks.router_cost            # --repeats 7 --warmup 5 --steps 100 --count-steps 101 --threads 1
    python -m benchmarks.router_cost --repeats 15 --width 128
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import statistics
import tempfile
import warnings
from datetime import datetime, timezone
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import Tensor, nn
from torch.utils.data import DataLoader

from benchmarks.overhead import LOG_EVERY, StepTimer, step_kinds
from lightning_stability import RouterHealthMonitor
from tests.helpers import HostDataCounter, StepSyncCounter, SyncCounter

VOCAB, EXPERTS, TOP_K = 256, 8, 2
#: the configurations: name -> RouterHealthMonitor's arguments (None: without it)
CONFIGS: dict[str, dict[str, float] | None] = {
    "plain": None,
    "router": {},
    "actions": {"balance_bias": 1e-3, "z_loss": 1e-3},
}


def mixtral(layers: int, width: int) -> nn.Module:
    import transformers

    config = transformers.MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=width,
        intermediate_size=2 * width,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        num_local_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return transformers.MixtralForCausalLM(config)


class MixtralLM(pl.LightningModule):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        loss = self.model(input_ids=batch, labels=batch).loss
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3, foreach=True)


def fit(config: str, steps: int, args: argparse.Namespace, root: str, *first: pl.Callback) -> None:
    """One run of ``config`` for ``steps`` steps, ``first`` placed before the monitor."""
    torch.manual_seed(0)  # the same initial weights and data in every run
    module = MixtralLM(mixtral(args.layers, args.width))
    data = torch.randint(VOCAB, (steps, args.batch, args.seq))
    options = CONFIGS[config]
    callbacks: list[pl.Callback] = [*first]
    if options is not None:
        callbacks.append(RouterHealthMonitor(balance_bias=options.get("balance_bias"), z_loss=options.get("z_loss")))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        precision="32-true",
        callbacks=callbacks,
        logger=CSVLogger(root, name=config),
        log_every_n_steps=LOG_EVERY,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(module, DataLoader(list(data.unbind()), batch_size=None))  # type: ignore[arg-type]


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--repeats", type=int, default=7)
    add("--warmup", type=int, default=5)
    add("--steps", type=int, default=100)
    add("--count-steps", type=int, default=101, help="steps of each sync-counting run (logging steps 50 and 100)")
    add("--layers", type=int, default=2)
    add("--width", type=int, default=64)
    add("--batch", type=int, default=8)
    add("--seq", type=int, default=64)
    add("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    load_start = os.getloadavg()[0]
    names = list(CONFIGS)
    medians: dict[str, list[float]] = {c: [] for c in names}
    ratios: dict[str, list[float]] = {c: [] for c in names[1:]}
    syncs: dict[str, list[int]] = {}
    made: dict[str, list[int]] = {}
    with tempfile.TemporaryDirectory() as root:
        for r in range(args.repeats):
            order = names[r % len(names) :] + names[: r % len(names)]
            round_: dict[str, float] = {}
            for config in order:
                timer = StepTimer()
                fit(config, args.warmup + args.steps + 1, args, root, timer)
                round_[config] = statistics.median(timer.times[args.warmup :])
                medians[config].append(round_[config])
            for config in ratios:
                ratios[config].append(round_[config] / round_["plain"])
        for config in names:
            sync_counter, host_counter = SyncCounter(), HostDataCounter()
            sync_steps, host_steps = StepSyncCounter(sync_counter), StepSyncCounter(host_counter)
            with sync_counter, host_counter:
                fit(config, args.count_steps, args, root, sync_steps, host_steps)
            syncs[config], made[config] = sync_steps.per_step, host_steps.per_step

    now = datetime.now(timezone.utc).strftime("%a %b %d %H:%M UTC %Y")
    params = sum(p.numel() for p in mixtral(args.layers, args.width).parameters())
    print(
        f"{now}; {os.cpu_count()} CPUs ({platform.machine()}), load average {load_start:.1f} at the start and "
        f"{os.getloadavg()[0]:.1f} at the end; torch {torch.__version__}, lightning {pl.__version__}, "
        f"{args.threads} torch thread(s)"
    )
    print(
        f"tiny Mixtral: {args.layers} layers, width {args.width}, {EXPERTS} experts top-{TOP_K}, "
        f"{params / 1e6:.2f}M parameters; {args.batch} x {args.seq} tokens a step, fp32, AdamW(foreach=True)"
    )
    print(
        f"step time: median over the steps of a run ({args.warmup} warm-up steps dropped, {args.steps} timed); "
        f"ratio: the configuration over plain in each round, median [min, max] over {args.repeats} rounds"
    )
    print(f"{'config':<8} {'ms':>7} {'ratio':>6} {'min':>6} {'max':>6}")
    summary: dict[str, float] = {}
    for config in names:
        ms = 1e3 * statistics.median(medians[config])
        if config == "plain":
            print(f"{config:<8} {ms:>7.2f}")
            continue
        summary[config] = statistics.median(ratios[config])
        lo, hi = min(ratios[config]), max(ratios[config])
        print(f"{config:<8} {ms:>7.2f} {summary[config]:>6.3f} {lo:>6.3f} {hi:>6.3f}")
    print(
        f"per step, mean over the steps of each kind in a {args.count_steps}-step run: host syncs and tensors made "
        "from host data; extra: over plain"
    )
    print(f"{'config':<8} {'steps':<13} {'n':>3} {'syncs':>6} {'extra':>6} {'made':>6} {'extra':>6}")
    for config in names:
        for kind, steps in step_kinds(len(syncs["plain"])).items():
            if not steps:
                continue
            cells: list[Any] = []
            for counts in (syncs, made):
                mine, base = (statistics.fmean(counts[c][i] for i in steps) for c in (config, "plain"))
                cells += [mine, mine - base]
            print(
                f"{config:<8} {kind:<13} {len(steps):>3} {cells[0]:>6.2f} {cells[1]:>+6.2f} {cells[2]:>6.2f} "
                f"{cells[3]:>+6.2f}"
            )
    print("target (issue 48): router <= 1.03x plain, and no extra host read off logging steps")
    for config in summary:
        steps = step_kinds(len(syncs["plain"]))["non-logging"]
        extra = statistics.fmean(syncs[config][i] - syncs["plain"][i] for i in steps)
        extra_made = statistics.fmean(made[config][i] - made["plain"][i] for i in steps)
        verdict = "met" if summary[config] <= 1.03 and extra == 0 and extra_made == 0 else "NOT met"
        print(
            f"  {config}: {verdict} (ratio {summary[config]:.3f}, {extra:+.2f} syncs and {extra_made:+.2f} host-made "
            "tensors per non-logging step)"
        )
    return summary


if __name__ == "__main__":
    main()
