"""Benchmark: every fault at once (issue 46, item 6). A DDP run on 2 processes under torchrun (gloo, CPU) meets a
seeded random schedule of faults, each of 8 kinds once, restarted without a human after each death; per fault kind:
whether the run survived, whether the incident log names the fault, the end state against an uninterrupted run,
the steps the fault cost and the goodput.

**The run** (tests/checkpoint/chaos.py drives it, tests/checkpoint/chaos_run.py is the training script): the
regression model of tests/replay/test_replay.py (dropout 0.1) on 640 indexed samples, a global batch of 16 (40
steps an epoch), 120 steps, AdamW; ``TrainingHealthMonitor(response="skip")``, ``StepReplay``,
``StableCheckpoint(every_n_train_steps=10)`` with ``AtomicCheckpointIO``, ``trainer.fit(ckpt_path="last")`` in
every launch; ``--poisoned`` samples (3) of each seed are NaN. Saves are asynchronous (``async_save=True``) on odd
seeds, synchronous on even ones, except in a launch that arms a kill inside a save of the other kind.

**The faults** (``random_schedule``: every kind once per seed, in a random order, at random steps at least 4 apart;
the kills inside saves at multiples of 10, on rank 0, the writer; the others on a random rank):

* ``sigterm``: SIGTERM to one rank; ``StableCheckpoint`` saves at an agreed step on every rank, which exit 0;
* ``kill_forward`` / ``kill_before_update``: SIGKILL of one rank in ``training_step`` / before the update;
* ``kill_in_save`` / ``kill_in_async_save``: SIGKILL of rank 0 inside a checkpoint's write (its hidden file
  written, not yet sealed, synced or published), synchronous / in the background thread of an asynchronous save;
* ``kill_after_publish``: SIGKILL right after a checkpoint is published, before the healthy list names it;
* ``damaged_while_down``: the same, then one byte of that checkpoint flipped while the job is down;
* ``nan``: one exponent bit flipped in the last layer's output on one rank (``BitFlip``): a transient fault;
* ``poisoned_sample``: each poisoned sample (data, met once: quarantined);
* ``resize`` (the ``--resize-seeds``): SIGKILL of rank 1 (a lost node); the job comes back on 1 process and, at the
  next job end, on 2 again. These seeds train without dropout (masks drawn on 1 process cannot match 2) and without
  poisoned samples (a rank's batch that lost quarantined samples is weighed apart by DDP), and end within
  ``WORLD_BOUND`` (1e-5, tests/checkpoint/test_world_size.py) of their own reference.

**The launches.** Each job is ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc_per_node=W
--max-restarts=K``: a kill is restarted by torchrun (``restart by torchrun`` below); a job ends (and the driver
starts the next, as a scheduler requeues one) after a SIGTERM, after the kill before a damage (the byte is flipped
between the jobs) and after a ``resize``. ``--launcher fork`` forks each launch from one process instead (fast: the
smoke test).

**What is reported**, per fault: *survived*: the run reached its last step with no hand on it (the driver only
relaunches); *named*: the incident log (``read_incidents``) holds, after the fault, the incident that names it: a
kill: the first ``restart`` incident after it, at the step the next launch resumed (a ``damaged_while_down`` also
its ``damaged_checkpoint``, naming the file); a SIGTERM: a ``preemption`` within 3 steps; a NaN: a ``replay`` at
its step; a poisoned sample: a ``quarantine`` at the step that met it, or a ``replay`` there saying it quarantined
samples; a restart by torchrun: a ``restart`` incident of torchrun's attempt; *end state*: the seed's final
weights, AdamW state, step, epoch, ledger counts and quarantine against the uninterrupted run with the same
poisoned samples (bit-equal; within ``WORLD_BOUND`` for the resize seeds), and every step's samples (and, up to a
resize, weights) on the way; *steps lost*: rank 0's steps trained after the step the next launch resumed at (what
the restart trains again); *goodput*: for a kind, ``R / (R + lost)`` with ``R`` the steps of the seeds it is in
(1.000: it costs no step); for a seed, its steps / the steps rank 0 trained over all launches. Steps, not seconds:
start-up is left out, and shown apart: *down s*, from a fault that ends a launch to the first step of the next
(torchrun's detection, the new processes' imports and set-up, the checkpoint's load), and a job's start-up.

Run: ``python -m benchmarks.chaos [--seeds 10] [--resize-seeds 4]`` (about 80 s a seed on 2 cores).
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from lightning_stability.incidents import Incident, read_incidents
from tests.checkpoint.chaos import (
    SCHEDULED,
    WORLD_BOUND,
    ChaosFailure,
    ChaosResult,
    Outcome,
    chaos,
    random_schedule,
    trained,
)

TORCHRUN = "restart by torchrun"
KINDS = (*SCHEDULED, "poisoned_sample", "resize", TORCHRUN)


@dataclass
class Row:
    """One fault as the report counts it."""

    kind: str
    seed: int
    step: int
    survived: bool
    named: str  # the incident kind(s) naming it; "" when none does
    end: str  # "bit-equal", "within" (WORLD_BOUND), "differs", "failed"
    lost: int
    resized: bool = False  # a resize seed's: its end state is compared within WORLD_BOUND
    down_s: float = 0.0  # a fault that ends a launch: seconds from it to the next launch's first step


def first_after(found: list[Incident], kind: str, since: float) -> Incident | None:
    return next((i for i in found if i.kind == kind and i.time >= since), None)


def naming(outcome: Outcome, found: list[Incident]) -> str:
    """The incident kind(s) that name ``outcome``'s fault (see the module's docstring); "" when none does."""
    fault, since = outcome.fault, outcome.time
    if outcome.fired_at is None:
        return ""
    if fault.kind == "nan":
        hit = any(i.kind == "replay" and i.step == outcome.fired_at and i.time >= since for i in found)
        return "replay" if hit else ""
    if fault.kind == "sigterm":
        hit = any(
            i.kind == "preemption" and outcome.fired_at <= i.step <= outcome.fired_at + 3 and i.time >= since
            for i in found
        )
        return "preemption" if hit else ""
    restart = first_after(found, "restart", since)
    if restart is None or restart.step != outcome.resumed_at:
        return ""
    if fault.damage:
        damaged = [i for i in found if i.kind == "damaged_checkpoint" and i.time >= since]
        return "restart+damaged_checkpoint" if any(outcome.damaged in i.detail for i in damaged) else ""
    return "restart"


def named_by_torchrun(outcome: Outcome, found: list[Incident]) -> str:
    restart = first_after(found, "restart", outcome.time)
    ok = restart is not None and restart.step == outcome.resumed_at and "by torchrun" in restart.attempt
    return "restart (torchrun's attempt)" if ok else ""


def poisoned_rows(
    out: Path, reference: str, poisoned: list[int], found: list[Incident], seed: int, survived: bool, end: str
) -> list[Row]:
    """A row per poisoned sample: named where the log quarantines it at the step the reference met it (a step's
    line in the steps log is the global step after it; an incident's step is the one running)."""
    rows = []
    for sample in poisoned:
        met = [s for rank in range(2) for s, line in trained(out, reference, rank) if sample in line.indices]
        step = min(met) - 1 if met else -1
        quarantined = [i for i in found if i.step == step and i.kind in ("quarantine", "replay")]
        kinds = sorted({i.kind for i in quarantined if i.kind == "quarantine" or "quarantined" in i.detail})
        rows.append(Row("poisoned_sample", seed, step, survived, "+".join(kinds), end, 0, resized=False))
    return rows


def run_seed(
    seed: int, out: Path, args: argparse.Namespace, resize: bool, reference: str
) -> tuple[list[Row], ChaosResult | None, str]:
    """One seed's chaos run (and its reference, unless ``out`` holds it): the rows of its faults, the result, the
    failure ("" when none)."""
    kinds = tuple(args.kinds.split(",")) if args.kinds else SCHEDULED
    schedule = random_schedule(seed, steps=args.steps, every=args.every, resize=resize, kinds=kinds)
    poisoned = [] if resize else random.Random(seed).sample(range(args.n), args.poisoned)
    name = f"chaos-{seed}"
    print(f"seed {seed}: {', '.join(f'{f.label}@{f.step}/r{f.rank}' for f in schedule)}; poisoned {poisoned}")
    failure = ""
    try:
        result: ChaosResult | None = chaos(
            out,
            schedule,
            poisoned,
            steps=args.steps,
            n=args.n,
            every=args.every,
            name=name,
            reference=reference,
            launcher=args.launcher,
            async_save=seed % 2 == 1,
        )
    except ChaosFailure as err:
        failure, result = str(err), err.result
    found = read_incidents(out / name / "ckpts") if (out / name / "ckpts").is_dir() else []
    survived = not failure
    if failure or result is None:
        end = "failed"
    elif result.mismatches:
        end = "differs"
    else:
        end = "bit-equal" if result.tolerance == 0 else "within"
    rows: list[Row] = []
    for outcome in result.outcomes if result is not None else []:
        lost = outcome.lost
        fault, named = outcome.fault, naming(outcome, found)
        rows.append(Row(fault.label, seed, fault.step, survived, named, end, lost, resize, outcome.down_s))
        if outcome.restarted_by == "torchrun" and args.launcher == "torchrun":
            named = named_by_torchrun(outcome, found)
            rows.append(Row(TORCHRUN, seed, fault.step, survived, named, end, 0, resize, outcome.down_s))
    rows += poisoned_rows(out, reference, poisoned, found, seed, survived, end)
    print(f"  {result.line() if result is not None else ''}{f'; FAILED: {failure}' if failure else ''}", flush=True)
    return rows, result, failure


def count(rows: list[Row], end: str) -> str:
    return f"{sum(r.end == end for r in rows)}/{len(rows)}" if rows else "-"


def table(rows: list[Row], results: dict[int, ChaosResult | None], args: argparse.Namespace) -> list[str]:
    lines = [
        f"{'fault kind':<20} {'n':>3} {'survived':>8} {'named':>6}  {'named as':<28} {'bit-equal':>9} "
        f"{'within':>6} {'lost: mean':>10} {'max':>3} {'goodput':>7} {'down s':>6}",
        "-" * 119,
    ]
    for kind in KINDS:
        mine = [r for r in rows if r.kind == kind]
        if not mine:
            continue
        n, lost, reference_steps = len(mine), [r.lost for r in mine], args.steps * len({r.seed for r in mine})
        exact, resized = [r for r in mine if not r.resized], [r for r in mine if r.resized]
        named_as = "/".join(sorted({r.named for r in mine if r.named})) or "-"
        down = [r.down_s for r in mine if r.down_s]
        survived, named = f"{sum(r.survived for r in mine)}/{n}", f"{sum(bool(r.named) for r in mine)}/{n}"
        goodput, down_s = reference_steps / (reference_steps + sum(lost)), statistics.mean(down) if down else None
        lines.append(
            f"{kind:<20} {n:>3} {survived:>8} {named:>6}  {named_as:<28} {count(exact, 'bit-equal'):>9} "
            f"{count(resized, 'within'):>6} {statistics.mean(lost):>10.1f} {max(lost):>3} {goodput:>7.3f} "
            f"{'-' if down_s is None else f'{down_s:.1f}':>6}"
        )
    lines.append("-" * 119)
    done = [r for r in results.values() if r is not None and r.executed]
    if done:
        per_seed = [args.steps / r.executed for r in done]
        startup = [s for r in done for s in r.startup_s]
        lines.append(
            f"goodput per seed (steps {args.steps} / steps trained over all launches): mean "
            f"{statistics.mean(per_seed):.3f}, min {min(per_seed):.3f}, max {max(per_seed):.3f}; "
            f"{sum(len(r.startup_s) for r in done)} jobs, {sum(len(r.resumed_at) for r in done)} launches"
        )
        lines.append(f"a job's start-up (launched to its first step): mean {statistics.mean(startup):.1f} s")
    worst = max((r.lost for r in rows), default=0)
    verdict = "met" if worst <= args.every else "NOT met"
    lines.append(
        f"no fault costs more than one checkpoint interval ({args.every} steps): {verdict} (the most: {worst})"
    )
    unnamed = sorted({r.kind for r in rows if not r.named})
    lines.append(f"every fault named in the incident log: {'yes' if not unnamed else 'no: ' + ', '.join(unnamed)}")
    return lines


def main(argv: list[str] | None = None) -> list[Row]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--seeds", type=int, default=10, help="seeds with the 8 kinds and poisoned samples")
    parser.add_argument("--resize-seeds", type=int, default=4, help="seeds with the 8 kinds and a resize")
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--n", type=int, default=640, help="samples (a global batch of 16)")
    parser.add_argument("--every", type=int, default=10, help="StableCheckpoint(every_n_train_steps=...)")
    parser.add_argument("--poisoned", type=int, default=3)
    parser.add_argument("--kinds", default="", help="a comma-separated subset of the kinds (default: all 8)")
    parser.add_argument("--launcher", choices=("torchrun", "fork"), default="torchrun")
    parser.add_argument("--out", type=Path, default=None, help="keep the runs in this directory")
    args = parser.parse_args(argv)
    unknown = set(args.kinds.split(",")) - set(SCHEDULED) if args.kinds else set()
    if unknown:
        parser.error(f"unknown kinds {sorted(unknown)}: pick from {', '.join(SCHEDULED)}")

    import lightning.pytorch as pl
    import torch

    started, load_start = time.monotonic(), os.getloadavg()[0]
    print(
        f"{time.strftime('%a %b %d %H:%M UTC %Y', time.gmtime())}; {os.cpu_count()} CPUs ({platform.machine()}); "
        f"torch {torch.__version__}, lightning {pl.__version__}; launcher {args.launcher}; load average "
        f"{load_start:.1f} at the start",
        flush=True,
    )
    rows: list[Row] = []
    results: dict[int, ChaosResult | None] = {}
    with tempfile.TemporaryDirectory(prefix="chaos-") as tmp:
        root = args.out or Path(tmp)
        first = args.first_seed
        for seed in range(first, first + args.seeds):
            seed_rows, results[seed], _ = run_seed(seed, root / f"seed-{seed}", args, False, "reference")
            rows += seed_rows
        for seed in range(first + args.seeds, first + args.seeds + args.resize_seeds):
            # one uninterrupted run (no dropout, no poisoned sample) is every resize seed's reference
            seed_rows, results[seed], _ = run_seed(seed, root / "resize", args, True, "reference")
            rows += seed_rows
    print()
    print(
        f"{args.seeds} seed(s) with poisoned samples (end state bit-equal expected), {args.resize_seeds} with a resize "
        f"(within {WORLD_BOUND:g}); {args.steps} steps, a checkpoint every {args.every}"
    )
    for line in table(rows, results, args):
        print(line)
    print(
        f"wall time of the whole benchmark: {time.monotonic() - started:.1f} s; load average "
        f"{os.getloadavg()[0]:.1f} at the end"
    )
    return rows


if __name__ == "__main__":
    main()
