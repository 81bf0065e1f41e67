"""Benchmark: run stability and speed of convergence, a bare Trainer versus ``StableTrainer.from_preset("tiny")``.

The project's headline claim (issue 11): on fragile configurations the preset keeps at least 98% of runs stable
where a bare Trainer keeps at most 60%, and converges no slower. Three fragile configurations, each trained over
``--seeds`` seeds (20) in two arms, with the same data and initial weights per seed (seeds outermost, the two
arms back to back, so drift on a shared machine hits both alike):

* **bare** -- a plain ``lightning.pytorch.Trainer``: the same model, data, AdamW and LR; no clipping, no schedule.
* **preset** -- ``StableTrainer.from_preset("tiny")``: ``GradientNormMonitor(max_norm=1.0)``,
  ``WarmupConstantCosineLR`` (5% linear warmup, constant, cosine to 0 over the last 20%),
  ``TrainingHealthMonitor(response="skip", skip_on="loss")``, ``PrecursorMonitor(lr_backoff=LRBackoff("update_ratio",
  0.02))``, fp32. Overrides only where the configuration needs them (fp16).

The configurations:

* ``postln`` -- a deep Post-LN transformer at a high LR: 6 ``nn.TransformerEncoderLayer(norm_first=False)``
  blocks (width 32, 4 heads, feed-forward 128, no dropout, no final norm) as a causal LM on a synthetic task:
  sequences of 17 tokens from a fixed random bigram table (vocab 32, logits x3), a fresh batch of 16 each step,
  AdamW lr 2e-2 (weight decay 0.01), 100 steps. A bare run that fails does not go NaN: its loss stalls at the
  unigram level (~3.23 nats, against ln 32 = 3.47 for a uniform guess and ~1.46 for the true table).
* ``fp16`` -- fp16 mixed precision with a too-high initial loss scale: the same LM with 2 Pre-LN blocks and a
  final norm (the demo's shape), AdamW lr 3e-3, fp16 with initial scale 2**32 (Megatron-LM's default initial
  scale, 2**16 above torch's). Bare: ``plugins=[MixedPrecision("16-mixed", "cpu", scaler=GradScaler("cpu",
  init_scale=2**32))]`` (on a CPU Lightning turns ``precision="16-mixed"`` alone into bf16). Preset: overrides
  ``precision="16-mixed", init_scale=2**32`` -- the same too-high scale; on a CPU the preset runs fp16 through
  an explicit scaler plugin whose scaler its ``LossScaleTuner`` (hysteresis 2, floor 1) replaces.
  **This configuration does not make the bare Trainer fail.** torch's ``GradScaler`` skips every step whose
  gradients overflow and halves the scale, so after ~15 skipped steps the run trains normally: scaling by a
  power of two is exact until it overflows, and an overflow is detected and skipped, so a too-high initial
  scale only costs steps. The preset cannot do better with the same scale (its hysteresis tolerates one
  overflow before the first backoff: one more skipped step). Reported as measured. The opt-in configuration
  ``fp16-auto`` (``--configs fp16,fp16-auto``) trains the same bare runs against the preset with
  ``init_scale="auto"`` (the tuner measures the first gradients and picks the scale).
* ``poison`` -- poisoned batches: benchmarks/spikes.py's setup unchanged (a 32-128-128-1 GELU MLP regresses a
  fixed random teacher, batch 64, AdamW lr 3e-3, 300 steps; 3 batches at random steps in [30, 290), drawn per
  seed, have inputs and targets multiplied by 1000).

Scoring. A run's final loss is its loss on a fixed evaluation set after training (512 sequences / 4096
samples, the same for every seed and arm, in fp32). Each configuration has a know-nothing loss L0 (uniform
guess, ln 32, for the LM; the constant prediction, var(y), for the regression) and a floor L* (the evaluation
set's irreducible loss: the cross-entropy of the true bigram table; the MSE of the label noise). A run has
**diverged** when its final loss is NaN/inf, or closes less than half the gap from L0 to L*
(final > L0 - 0.5 (L0 - L*): 2.46 nats for the LM, 0.20 for the regression; ``--diverged-below``), or when
training was stopped by ``TrainingDivergedError``/``LossScaleFloorError``. The **target loss** closes 3/4 of
that gap (L0 - 0.75 (L0 - L*): 1.96 nats, 0.10; ``--target``). **Steps to target**: the first step at which
the mean training loss of the last 10 batches (``--window``; poisoned batches left out) is at or below the
target; every batch counts, skipped updates included. It is taken over the converged runs that reached the
target: ``bare``/``preset`` are the medians, ``ratio`` = median preset / median bare, ``paired`` = the median
over seeds where both arms converged and reached it of preset steps / bare steps (``n`` such seeds). The
``overall`` row pools all configurations: its diverged counts are sums; its median steps mix different tasks
(and bare's converged runs come mostly from the easy ones), so ``paired`` is the like-for-like comparison.
In ``poison`` the target usually falls before the first poisoned batch (step >= 30), so there steps-to-target
mostly measures the warmup's cost on clean data. **Time**: medians over seeds of preset / bare of the same
seed; ``fit`` = ``trainer.fit`` as the user waits (it includes the preset's end-of-fit stability report, JSON
and PNG with matplotlib, ~0.3 s here, which is why tiny runs show a large ratio), ``loop`` = first to
last training batch. A second table gives each arm's runs: diverged, converged runs that reached the target,
the median and worst final loss, the median number of batches whose update was not applied (loss scaler,
non-finite or spike skips: batches minus AdamW's step counter) and runs stopped by an error.

Choice of the hyperparameters: once, while writing this, on seeds 0-3 (then every seed is reported).
Post-LN LR, diverged runs bare / preset: lr 1e-2 0/4 / 0/4, 1.5e-2 1/4 / 0/4, 2e-2 4/4 / 0/4, 3e-2 4/4 / 2/4.
2e-2 is the LR where the bare Trainer failed on every probe seed and the preset on none: chosen for that
contrast, which is what "fragile" means here. The window is narrow: at 3e-2 the preset fails too, and at
1.5e-2 the bare Trainer mostly trains (``--postln-lr`` reproduces either). The fp16 scale is Megatron-LM's
default, not tuned; the fp16 LR is the demo's; the poisoned setup is spikes.py's defaults. The 0.5 / 0.75
fractions and the window were fixed before the full run.

**LR sweep** (``benchmarks/stability_sweep.py``). One learning rate cannot show what stability buys in speed:
where the bare Trainer trains, the preset's warmup costs a few steps; where it breaks, there is nothing to
compare. So the Post-LN task is also trained at ``--sweep-lrs`` (5e-3, 1e-2, 1.5e-2; the table's 2e-2 runs are
reused), both arms on the same seeds. For each arm, its **fastest reliable LR** is the one with the fewest median
steps to target among those where at least ``--reliable`` (98%) of its runs are stable, and the sweep's verdict is
the ratio of the two arms' steps there, each at its own best setting: what a user who tunes the LR for speed,
under the constraint that runs must not break, gets. The grid was set from a 6-seed look (bare: 3e-3 33.5 steps,
5e-3 26, 1e-2 26, 1.5e-2 2/6 diverged; preset stable up to 2e-2), which brackets the bare Trainer's best.

Run: ``python -m benchmarks.stability [--seeds 20] [--configs postln,fp16,poison]`` (about 4 minutes on 2
CPU cores; ``--seeds 3`` for a quick look). ``--help`` lists every option.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import math
import os
import platform
import statistics
import tempfile
import time
import warnings

import lightning.pytorch as pl
import torch

from benchmarks.spikes import FIRST_POISON, TAIL, make_data
from benchmarks.stability_runs import (
    EVAL_SEED,
    HEADS,
    LM_BATCH,
    LM_EVAL,
    MLP_BATCH,
    MLP_EVAL,
    SEQ,
    VOCAB,
    WIDTH,
    Config,
    Run,
    Task,
    bound_of,
    lm_task,
    mlp_task,
    run_once,
    sequences,
)
from benchmarks.stability_sweep import report as sweep_report
from benchmarks.stability_sweep import sweep
from benchmarks.stability_tables import Summary, cpu_name, fmt, group_header, restart_cost, table

CONFIGS = ("postln", "fp16", "poison")
EXTRA = ("fp16-auto",)  # opt-in: not in the default run


def configurations(args: argparse.Namespace) -> list[Config]:
    every = {
        "postln": Config(
            "postln",
            f"post-LN x{args.layers} lr {args.postln_lr:g}",
            args.lm_steps,
            args.postln_lr,
            layers=args.layers,
        ),
        "fp16": Config(
            "fp16",
            f"fp16 scale 2^{math.log2(args.init_scale):g}",
            args.lm_steps,
            args.fp16_lr,
            layers=2,
            norm_first=True,
            init_scale=args.init_scale,
        ),
        "fp16-auto": Config(
            "fp16-auto",
            f"fp16 2^{math.log2(args.init_scale):g}, auto",
            args.lm_steps,
            args.fp16_lr,
            layers=2,
            norm_first=True,
            init_scale=args.init_scale,
            preset_init_scale="auto",
        ),
        "poison": Config(
            "poison",
            f"poisoned {args.poison}x{args.factor:g}",
            args.poison_steps,
            args.poison_lr,
            poison=args.poison,
            factor=args.factor,
        ),
    }
    return [every[k] for k in args.configs]


def main(argv: list[str] | None = None) -> dict[str, tuple[int, int]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--seeds", type=int, default=20, help="seeds per configuration, each trained bare and with the preset (20)")
    add(
        "--configs",
        default=",".join(CONFIGS),
        help=f"configurations to run, comma-separated (default {','.join(CONFIGS)}; opt-in: {','.join(EXTRA)})",
    )
    add("--layers", type=int, default=6, help="post-LN configuration: transformer blocks (default 6)")
    add("--postln-lr", type=float, default=2e-2, help="post-LN configuration: AdamW learning rate (default 2e-2)")
    add("--fp16-lr", type=float, default=3e-3, help="fp16 configuration: AdamW learning rate (default 3e-3)")
    add("--init-scale", type=float, default=2.0**32, help="fp16 configuration: initial loss scale (default 2^32)")
    add("--lm-steps", type=int, default=100, help="optimizer steps of the two transformer configurations (100)")
    add("--poison-steps", type=int, default=300, help="poisoned configuration: optimizer steps (default 300)")
    add("--poison", type=int, default=3, help="poisoned configuration: poisoned batches per run (default 3)")
    add("--factor", type=float, default=1000.0, help="poisoned configuration: scale of a poisoned batch (1000)")
    add("--poison-lr", type=float, default=3e-3, help="poisoned configuration: AdamW learning rate (default 3e-3)")
    add(
        "--diverged-below",
        type=float,
        default=0.5,
        help="diverged: final eval loss closes less than this share of the gap know-nothing -> floor (0.5)",
    )
    add("--target", type=float, default=0.75, help="target loss: closes this share of that gap (default 0.75)")
    add("--window", type=int, default=10, help="steps to target: mean training loss over this many batches (10)")
    add(
        "--sweep-lrs",
        default="5e-3,1e-2,1.5e-2",
        help="post-LN configuration: further AdamW learning rates for the LR sweep, comma-separated (the table's "
        "--postln-lr is reused); empty: no sweep (default 5e-3,1e-2,1.5e-2)",
    )
    add(
        "--reliable",
        type=float,
        default=0.98,
        help="LR sweep: an LR is reliable for an arm when at least this share of its runs is stable (0.98)",
    )
    add("--threads", type=int, default=1, help="torch CPU threads (default 1: steadier timings on a shared machine)")
    args = parser.parse_args(argv)
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    try:
        args.sweep_lrs = [float(x) for x in args.sweep_lrs.split(",") if x.strip()]
    except ValueError:
        parser.error(f"--sweep-lrs must be numbers separated by commas, got {args.sweep_lrs!r}")
    if any(lr <= 0 for lr in args.sweep_lrs):
        parser.error(f"--sweep-lrs must be positive, got {args.sweep_lrs}")
    if not 0 < args.reliable <= 1:
        parser.error(f"--reliable must be in (0, 1], got {args.reliable}")
    unknown = sorted(set(args.configs) - set(CONFIGS) - set(EXTRA))
    if unknown:
        parser.error(f"unknown configuration(s) {unknown}; known: {', '.join(CONFIGS + EXTRA)}")
    if args.poison_steps < FIRST_POISON + TAIL + args.poison:
        parser.error(f"--poison-steps must be at least {FIRST_POISON + TAIL + args.poison}")
    if not 0 < args.diverged_below <= args.target < 1:
        parser.error("need 0 < --diverged-below <= --target < 1")

    started = datetime.datetime.now(datetime.timezone.utc)
    wall = time.perf_counter()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")  # the monitor's spike warnings, Lightning's dataloader-worker hints
    for name in ("lightning.pytorch", "lightning.fabric", "lightning_stability"):
        logging.getLogger(name).setLevel(logging.ERROR)
    lm_eval = sequences(LM_EVAL, torch.Generator().manual_seed(EVAL_SEED))
    mlp_eval = make_data(MLP_EVAL, torch.Generator().manual_seed(EVAL_SEED))

    configs = configurations(args)
    runs: dict[tuple[str, bool], list[Run]] = {(c.key, p): [] for c in configs for p in (False, True)}
    tasks: dict[str, Task] = {}
    with tempfile.TemporaryDirectory() as root:
        for seed in range(args.seeds):  # seeds outermost: drift on a shared machine hits every arm alike
            for config in configs:
                poison = config.key == "poison"
                task = mlp_task(config, seed, mlp_eval) if poison else lm_task(config, seed, lm_eval)
                tasks[config.key] = task
                for preset in (False, True):
                    runs[config.key, preset].append(run_once(config, preset, seed, task, args, root))
        points = []
        if "postln" in args.configs and args.sweep_lrs:
            base = next(c for c in configs if c.key == "postln")
            known = {base.lr: (runs["postln", False], runs["postln", True])}
            lrs = sorted(set(args.sweep_lrs) | {base.lr})
            points = sweep(base, lrs, args.seeds, lambda seed: lm_task(base, seed, lm_eval), args, root, known)
    wall = time.perf_counter() - wall

    print(
        f"{started:%a %b %d %H:%M UTC %Y}; {os.cpu_count()} CPUs ({cpu_name()}), "
        f"{platform.system()} {platform.release()}"
    )
    print(f"torch {torch.__version__}, lightning {pl.__version__}, {args.threads} torch thread(s); {args.seeds} seeds")
    print("configurations (the same seeds, data and initial weights in both arms; AdamW, weight decay 0.01):")
    for c in configs:
        if c.key == "poison":
            what = (
                f"32-128-128-1 MLP regression (benchmarks/spikes.py), batch {MLP_BATCH}, {c.steps} steps, "
                f"lr {c.lr:g}; {c.poison} batches at random steps in [{FIRST_POISON}, {c.steps - TAIL}) x{c.factor:g}"
            )
        else:
            block = "pre-LN" if c.norm_first else "post-LN"
            what = (
                f"{c.layers}-layer {block} transformer LM (width {WIDTH}, {HEADS} heads), bigram task, vocab "
                f"{VOCAB}, seq {SEQ}, batch {LM_BATCH}, {c.steps} steps, lr {c.lr:g}"
            )
            if c.init_scale is not None:
                what += f"; fp16 mixed, initial loss scale {c.init_scale:g}"
                what += " in both arms" if c.preset_init_scale is None else f" (preset: {c.preset_init_scale!r})"
        print(f"  {c.label}: {what}")
    print(
        "preset: StableTrainer.from_preset('tiny'): clip 1.0, warmup 5% -> constant -> cosine over the last 20%, "
        "TrainingHealthMonitor(response='skip', skip_on='loss'), PrecursorMonitor's LR back-off (update ratio 0.02); "
        "the fp16 configuration adds precision='16-mixed', "
        "init_scale=<the same scale> (LossScaleTuner: hysteresis 2, floor 1)"
    )
    print(
        f"diverged: final eval loss NaN/inf, or closing < {args.diverged_below:g} of the gap from the know-nothing "
        f"loss to the floor; target: closing {args.target:g} of it, as the mean training loss of "
        f"{args.window} clean batches"
    )
    for c in configs:
        t = tasks[c.key]
        print(
            f"  {c.label}: know-nothing {t.know_nothing:.4g}, floor {t.floor:.4g} -> diverged above "
            f"{bound_of(t, args.diverged_below):.4g}, target {bound_of(t, args.target):.4g} (eval set of the last seed)"
        )
    print()
    head = ["configuration", "bare", "preset", "bare", "preset", "bare", "preset", "ratio", "paired (n)", "fit", "loop"]
    widths = (22, 8, 7, 6, 7, 6, 7, 6, 11, 6, 5)
    groups = [("", 1), ("diverged", 2), ("stable", 2), ("steps to target (median)", 4), ("time x bare", 2)]
    summaries = [Summary.of(runs[c.key, False], runs[c.key, True]) for c in configs]
    body = [s.cells(c.label) for s, c in zip(summaries, configs, strict=True)]
    lines = table([head, *body], widths)
    print(group_header(groups, widths), *lines[:1], "-" * len(lines[0]), *lines[1:], sep="\n")
    if len(configs) > 1:
        print("-" * len(lines[1]))
        print(table([Summary.pooled(summaries).cells("overall")], widths)[0])
    print()
    print(
        "steps to a trained model, counting restarts: a diverged run is thrown away after its full length L and "
        "restarted with a new seed;\nwith a share p of runs stable, that costs L (1 - p) / p + the median steps to "
        "target of a stable run"
    )
    restart = [["configuration", "bare", "preset", "preset/bare"]]
    for s_, c in zip(summaries, configs, strict=True):
        costs = [restart_cost(c.steps, s_.n, s_.diverged[arm], s_.steps[arm]) for arm in (0, 1)]
        ratio = None if costs[0] is None or costs[1] is None else costs[1] / costs[0]
        restart.append([c.label, fmt(costs[0]), fmt(costs[1]), fmt(ratio, ".2f")])
    rl = table(restart, (22, 8, 8, 12))
    print(rl[0], "-" * len(rl[0]), *rl[1:], sep="\n")
    print("(-: no run of that arm reached the target)")
    print()
    detail_head = ["configuration / arm", "diverged", "reached", "median loss", "worst loss", "skipped", "stopped"]
    detail_widths = (30, 8, 8, 11, 11, 8, 8)
    detail = [detail_head]
    for c in configs:
        for preset in (False, True):
            rs = runs[c.key, preset]
            converged = [r for r in rs if not r.diverged]
            finals = [r.final for r in rs]
            detail.append(
                [
                    f"{c.label} / {'preset' if preset else 'bare'}",
                    f"{sum(r.diverged for r in rs)}/{len(rs)}",
                    f"{sum(r.steps_to_target is not None for r in converged)}/{len(converged)}",
                    f"{statistics.median(finals):.4g}",
                    f"{max(finals):.4g}",
                    f"{statistics.median(r.skipped for r in rs):g}",
                    str(sum(bool(r.stopped) for r in rs)),
                ]
            )
    dl = table(detail, detail_widths)
    print(dl[0], "-" * len(dl[0]), *dl[1:], sep="\n")
    print(
        "reached: converged runs that reached the target; skipped: median batches whose update was not applied; "
        "stopped: runs ended by TrainingDivergedError/LossScaleFloorError"
    )
    fixed = {p: [r.fit_s - r.loop_s for c in configs for r in runs[c.key, p]] for p in (False, True)}
    print(
        f"fit - loop (setup and end of fit; the preset's includes its stability report, JSON + PNG): median "
        f"bare {statistics.median(fixed[False]):.2f} s, preset {statistics.median(fixed[True]):.2f} s per run"
    )
    if points:
        print()
        lines, _ = sweep_report(points, f"post-LN x{args.layers}", args.reliable)
        print(*lines, sep="\n")
    print(f"wall time of the whole benchmark: {wall:.1f} s ({wall / 60:.1f} min)")
    return {c.key: s.diverged for c, s in zip(configs, summaries, strict=True)}


if __name__ == "__main__":
    main()
