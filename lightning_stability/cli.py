"""Command line: ``lightning-stability demo | plan | presets [NAME] | quarantine FILE | verify DIR | incidents DIR``."""

from __future__ import annotations

import argparse
import os
import re
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path


def _say(text: str) -> None:
    from lightning.pytorch.utilities import rank_zero_only

    if getattr(rank_zero_only, "rank", 0) == 0:  # --devices 2: the second process runs this command too
        print(text, flush=True)


def _demo(args: argparse.Namespace) -> int:
    from lightning_stability.demo.model import load_corpus
    from lightning_stability.demo.run import demo_threads, quiet_lightning, run_demo

    corpus = load_corpus()
    fault = int(0.6 * args.steps) if args.nan_at_step is None else args.nan_at_step
    _say(
        f"A Post-LN character-level GPT (4 layers) on {len(corpus.tokens):,} characters of this package's source "
        f"(a frozen copy), AdamW lr={args.lr:g} from step 0, {args.steps} steps"
        + (f", the loss of step {fault} made NaN (a corrupted batch)." if fault >= 0 else ".")
        + (" The same run bare, then with the preset." if args.compare else "")
        + f" Repeatable: seed {args.seed}, {demo_threads(args.devices)} CPU thread(s) per process, torch's "
        "deterministic algorithms."
    )
    with warnings.catch_warnings(record=True) as caught, quiet_lightning():
        warnings.simplefilter("always")  # recorded; the callbacks' own warnings are printed after the runs
        runs = run_demo(
            preset=args.preset,
            steps=args.steps,
            precision=args.precision,
            devices=args.devices,
            out=args.out,
            compare=args.compare,
            nan_at_step=fault,
            lr=args.lr,
            seed=args.seed,
            progress_bar=not args.no_progress_bar,
            say=_say,
        )
    ours = {str(w.message).split(". ")[0] for w in caught if "lightning_stability" in str(w.filename)}
    for message in sorted(ours):
        _say(f"warning from the preset's callbacks: {message}")
    _say("")
    _say(f"{'run':<10} {'result':<10} {'at step':>7} {'final loss':>10} {'skipped':>7} {'time':>6}")
    for run in runs:
        v = run.verdict
        skipped = "-" if run.skipped is None else str(run.skipped)
        at = "-" if v.step is None or v.status == "trained" else str(v.step)
        _say(f"{run.name:<10} {v.status:<10} {at:>7} {v.final_loss:>10.3f} {skipped:>7} {run.seconds:>5.0f}s")
    _say(
        f"Checked: a run diverged if its loss was NaN/inf or above {corpus.uniform_loss + 1:.2f} (ln V + 1) at any "
        f"step; it stalled if its final loss (mean of the last 10% of steps) is above "
        f"{corpus.unigram_loss - 0.1:.2f}, i.e. no better than guessing characters by frequency."
    )
    preset_run = runs[-1]
    ok = preset_run.verdict.status == "trained"
    if ok and len(runs) == 2 and runs[0].verdict.status != "trained":
        bare = runs[0].verdict
        verdict = f"OK: the plain Trainer {bare.status} ({bare.detail}); the preset trained"
        verdict += f" ({preset_run.verdict.detail})."
    elif ok and len(runs) == 2:
        verdict = (
            f"OK: both runs trained with these settings (final loss: bare {runs[0].verdict.final_loss:.3f}, "
            f"preset {preset_run.verdict.final_loss:.3f})."
        )
    elif ok:
        verdict = f"OK: the preset trained ({preset_run.verdict.detail})."
    else:
        verdict = f"FAILED: the preset's run {preset_run.verdict.status}: {preset_run.verdict.detail}."
    _say(verdict)
    out = Path(args.out)
    _say("Files:")
    if (out / "comparison.png").exists():
        _say(f"  {out / 'comparison.png'}  both runs' loss on one chart")
    for path in preset_run.report:
        _say(f"  {path}  the preset run's stability report")
    for run in runs:
        _say(f"  {run.log_dir / 'metrics.csv'}  the {run.name} run's logged metrics (CSV)")
    return 0 if ok else 1


def _presets(args: argparse.Namespace) -> int:
    from lightning_stability.presets import describe_preset, list_presets

    if args.name:
        print(describe_preset(args.name))
        return 0
    table = list_presets()
    width = max(len(name) for name in table)
    for name, description in table.items():
        print(f"{name:<{width}}  {description}")
    print("\n`lightning-stability presets NAME` shows every setting of one, with its source.")
    return 0


def _plan(args: argparse.Namespace) -> int:
    from lightning_stability.planner import ModelShape, advise_tensor_parallel, plan_memory
    from lightning_stability.presets import get_preset, layout

    preset = get_preset(args.preset) if args.preset else None
    shape = ModelShape(args.params, layers=args.layers, hidden=args.hidden, heads=args.heads, vocab=args.vocab)
    nodes = args.nodes if args.nodes is not None else (preset.num_nodes if preset else 1)
    built = None
    if preset is not None:  # what StableTrainer.from_preset builds on these GPUs
        built = layout(
            preset,
            world_size=nodes * args.gpus_per_node,
            devices_per_node=args.gpus_per_node,
            gpu=True,
            own_precision=args.precision is not None,
        )
    precision = args.precision or (built.precision if built else "bf16-mixed")
    tensor_parallel = args.tensor_parallel or (built.tensor_parallel if built else 1)
    # without a preset, what a plain Trainer runs: one replica per GPU (DDP); tensor parallelism runs only inside
    # StableFSDPStrategy, which shards fully
    sharding = args.sharding or (built.sharding if built else "full" if tensor_parallel > 1 else "none")
    checkpointing = args.activation_checkpointing or bool(built and built.activation_checkpointing)
    effective = args.effective_batch or (preset.effective_batch if preset else None)
    settings = dict(
        nodes=nodes,
        gpus_per_node=args.gpus_per_node,
        gpu_memory=args.gpu_memory,
        precision=precision,
        optimizer=args.optimizer,
        sharding=sharding,
        seq_len=args.seq_len,
        micro_batch=args.micro_batch,
        activation_checkpointing=checkpointing,
        effective_batch=effective,
        cpu_offload=args.cpu_offload,
        flash_attention=args.flash_attention,
        sequence_parallel=args.sequence_parallel,
        pipeline_parallel=args.pp,
    )
    plan = plan_memory(shape, tensor_parallel=tensor_parallel, **settings)
    advice = advise_tensor_parallel(shape, **settings)
    if preset is not None:
        print(
            f"preset {preset.name}: precision {precision}, sharding {sharding}, activation checkpointing "
            f"{checkpointing}, effective batch {effective}, tensor parallel {tensor_parallel}"
            + (f" ({'; '.join(built.notes)})" if built and built.notes else "")
        )
    else:
        if args.sharding:
            why = "--sharding"
        elif sharding == "full":
            why = "StableFSDPStrategy, which tensor parallelism runs in"
        else:
            why = "one replica per GPU, as a plain Trainer or DDP runs; --sharding full plans StableFSDPStrategy"
        print(
            f"no preset: precision {precision}, sharding {sharding} ({why}), activation checkpointing "
            f"{checkpointing}, tensor parallel {tensor_parallel}; --preset NAME plans what a preset builds"
        )
    print(plan.table())
    print(advice.text())
    return 0 if plan.fits else 1


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a default where it says something (not for flags, nor where the help text says it)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if isinstance(action.default, bool) or action.default is None or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text}")
    return value


_NUMBER = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)(?:[eE]([+-]?\d+))?\s*([a-zA-Z]*)\s*$")
_COUNT_SUFFIXES = {"": 1.0, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}
#: the smallest parameter count ``--params`` takes: below it the number is a slip for billions (``--params 7``)
MIN_PARAMS = 1e6


def _params(text: str) -> float:
    """``--params``: a count (``7e9``, ``6738415616``) or a count with a suffix K, M, B or T (``7B``, ``350M``)."""
    fix = "Fix: e.g. --params 7e9 or --params 7B (K, M, B, T: thousand, million, billion, trillion)"
    match = _NUMBER.match(text)
    if match is None or match.group(3).lower() not in _COUNT_SUFFIXES:
        raise argparse.ArgumentTypeError(f"{text!r} is not a parameter count. {fix}")
    mantissa, exponent, suffix = match.groups()
    value = float(mantissa) * 10 ** int(exponent or 0) * _COUNT_SUFFIXES[suffix.lower()]
    if value < MIN_PARAMS:
        raise argparse.ArgumentTypeError(
            f"{text} is {value:g} parameters, below the {MIN_PARAMS:g} this planner plans (a slip for billions?). {fix}"
        )
    return value


def _gpu_memory(text: str) -> str:
    """``--gpu-memory``: a size with its unit (``80GiB``, ``40GB``, ``81920MiB``); a bare number is GiB."""
    from lightning_stability.errors import StabilityConfigError
    from lightning_stability.planner import parse_memory

    fix = "Fix: a number of GiB (--gpu-memory 80) or a size with its unit (80GiB, 40GB, 81920MiB)"
    match = _NUMBER.match(text)
    value = f"{text.strip()}GiB" if match is not None and not match.group(3) else text
    try:
        size = parse_memory("--gpu-memory", value)
    except StabilityConfigError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a memory size. {fix}") from None
    if size == 0:
        raise argparse.ArgumentTypeError(f"{text!r} is no memory. {fix}")
    return value


def _quarantine(args: argparse.Namespace) -> int:
    from lightning_stability.replay.quarantine import read_quarantine

    try:
        entries = read_quarantine(args.file)
    except (OSError, ValueError) as err:
        raise _Refused(str(err)) from err
    total = sorted({int(i) for e in entries for i in e.get("indices", [])})
    print(f"{len(total)} sample(s) quarantined in {len(entries)} batch(es), from {args.file}")
    for e in entries:
        where = f"step {e.get('step')}, epoch {e.get('epoch')}, rank {e.get('rank')}, batch_idx {e.get('batch_idx')}"
        print(f"  {where} ({e.get('cause')}): {' '.join(str(i) for i in e.get('indices', []))}")
    return 0


def _verify(args: argparse.Namespace) -> int:
    from lightning_stability.checkpoint.survey import COMPLETE, FAILED, survey

    directory = Path(args.dir)
    fix = "Fix: pass the directory the checkpoints are saved in (StableCheckpoint's dirpath)"
    if not directory.exists():
        raise _Refused(f"{args.dir} does not exist. {fix}.")
    if not directory.is_dir():
        raise _Refused(f"{args.dir} is a file, not a directory of checkpoints. {fix}, e.g. {directory.parent}.")
    rows = survey(directory)
    if not rows:
        raise _Refused(
            f"{args.dir} holds no checkpoint (no *.ckpt or *.pt file, no sharded directory, no "
            f"stable_checkpoints.json). {fix}."
        )
    print(f"{'step':>8}  {'healthy':<7}  {'verified':<8}  checkpoint")
    for row in rows:
        step = "?" if row.step is None else str(row.step)
        print(f"{step:>8}  {'yes' if row.listed else '-':<7}  {row.status:<8}  {row.name}")
    failed = [row for row in rows if row.status == FAILED]
    for row in failed:
        print(f"\n{row.name}: {row.detail}")
    unchecked = sum(row.status == COMPLETE for row in rows)
    print(
        f"\n{len(rows)} checkpoint(s) in {directory}: {len(rows) - len(failed) - unchecked} verified (every file's "
        f"checksum matches), {unchecked} complete without checksums (written by another writer or an older "
        f"version), {len(failed)} failed. healthy: on stable_checkpoints.json (saved healthy by StableCheckpoint)."
    )
    return 1 if failed else 0


def _incidents(args: argparse.Namespace) -> int:
    from lightning_stability.incidents import format_incidents, read_incidents
    from lightning_stability.incidents.log import log_dir

    directory = Path(args.dir)
    if not directory.is_dir():
        raise _Refused(
            f"{args.dir} is not a directory. Fix: pass the directory the checkpoints are saved in (StableCheckpoint's "
            "dirpath, or the ModelCheckpoint's), or the Trainer's default_root_dir when no checkpoint is saved."
        )
    if not log_dir(directory).is_dir():
        raise _Refused(
            f"{args.dir} holds no incident log ({log_dir(directory)} does not exist). Fix: pass the directory the "
            "checkpoints are saved in; the log is written there once a fault is handled."
        )
    print(format_incidents(read_incidents(directory)))
    return 0


class _Refused(Exception):
    """A command's argument is unusable: exit status 2 with this message."""


#: the exit status of a command whose reader went away (``plan | head``): 128 + SIGPIPE, what a shell reports for
#: ``yes | head`` under ``set -o pipefail``
BROKEN_PIPE = 141


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``lightning-stability`` with ``argv`` (default: the process's arguments); returns the exit status.

    When the output's reader goes away early (``lightning-stability plan | head``) it stops quietly, as Unix tools
    do: no traceback, exit status :data:`BROKEN_PIPE`.
    """
    try:
        try:
            return _run(argv)
        finally:
            sys.stdout.flush()  # a closed pipe shows here rather than at the interpreter's exit
    except BrokenPipeError:
        # the rest of the output, and the interpreter's own flush at exit, go nowhere instead of failing again
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return BROKEN_PIPE


def _run(argv: Sequence[str] | None) -> int:
    parser = argparse.ArgumentParser(
        prog="lightning-stability", description="Stable large-model training for Lightning."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo",
        help="a fragile training run, bare and with a preset, side by side",
        description="Train the same fragile run (a Post-LN character-level GPT at a high learning rate, with one "
        "NaN step) with a plain lightning.Trainer and with StableTrainer.from_preset, and judge both.",
        formatter_class=_Help,
    )
    demo.add_argument("--preset", default="tiny", help="the preset to run (`lightning-stability presets` lists them)")
    demo.add_argument("--steps", type=_positive, default=300, help="optimizer steps of each run")
    demo.add_argument("--precision", default=None, help="16-mixed, bf16-mixed or 32-true (default: the preset's)")
    demo.add_argument("--devices", type=_positive, default=1, help="devices; on a CPU, 2 runs 2 DDP processes")
    demo.add_argument("--out", default="lightning_stability_demo", help="folder for the logs, report and chart")
    demo.add_argument(
        "--no-compare", dest="compare", action="store_false", help="run only the preset, not the plain Trainer"
    )
    demo.add_argument(
        "--nan-at-step", type=int, default=None, help="the step whose loss is made NaN (default: 60%% in; -1: none)"
    )
    demo.add_argument("--lr", type=float, default=1e-2, help="AdamW's learning rate (peak LR for the preset)")
    demo.add_argument("--seed", type=int, default=0, help="seed of the weights and the batches")
    demo.add_argument("--no-progress-bar", action="store_true", help="no progress bars (for logs)")
    demo.set_defaults(func=_demo)
    plan = sub.add_parser(
        "plan",
        help="memory per GPU of a training run: fits or not, the largest micro-batch, the accumulation, the "
        "tensor-parallel size that fits",
        formatter_class=_Help,
    )
    plan.add_argument(
        "--preset",
        default=None,
        help="take precision, sharding, checkpointing, nodes and batch from it (default: none, a plain Trainer's "
        "settings: bf16-mixed, one replica per GPU)",
    )
    plan.add_argument(
        "--params", type=_params, required=True, help="number of parameters, e.g. 175e9, 7B or 350M (K, M, B, T)"
    )
    plan.add_argument("--layers", type=_positive, default=None, help="transformer layers (for the activations)")
    plan.add_argument("--hidden", type=_positive, default=None, help="hidden size (for the activations)")
    plan.add_argument("--heads", type=_positive, default=None, help="attention heads (eager attention's scores)")
    plan.add_argument("--vocab", type=_positive, default=None, help="vocabulary size (the logits)")
    plan.add_argument("--nodes", type=_positive, default=None, help="machines (default: the preset's, else 1)")
    plan.add_argument("--gpus-per-node", type=_positive, default=1, help="GPUs per machine")
    plan.add_argument(
        "--gpu-memory",
        type=_gpu_memory,
        default="80",
        help="memory of one GPU: a bare number is GiB (80: 80 GiB, an 80 GB A100/H100), or give the unit: 80GiB, "
        "40GB (10**9 bytes), 81920MiB (default: 80 GiB)",
    )
    plan.add_argument(
        "--precision", default=None, help="16-mixed, bf16-mixed or 32-true (default: the preset's, else bf16-mixed)"
    )
    plan.add_argument("--optimizer", default="adamw", help="adamw, sgd or sgd_momentum")
    plan.add_argument(
        "--sharding",
        default=None,
        help="full (FSDP, ZeRO-3), grad_op, optimizer or none (default: the preset's; without --preset none, one "
        "replica per GPU as a plain Trainer runs, or full with --tensor-parallel above 1)",
    )
    plan.add_argument("--seq-len", type=_positive, default=2048, help="sequence length")
    plan.add_argument("--micro-batch", type=_positive, default=1, help="sequences per GPU per forward pass")
    plan.add_argument(
        "--effective-batch", type=_positive, default=None, help="global batch (default: the preset's, else none)"
    )
    plan.add_argument("--activation-checkpointing", action="store_true", help="plan with it on")
    plan.add_argument("--cpu-offload", action="store_true", help="optimizer state in host memory")
    plan.add_argument("--flash-attention", action="store_true", help="attention scores recomputed, not stored")
    plan.add_argument(
        "--tensor-parallel",
        "--tp",
        type=_positive,
        default=None,
        help="GPUs splitting each layer, a divisor of --gpus-per-node (default: the preset's, else 1)",
    )
    plan.add_argument(
        "--sequence-parallel", action="store_true", help="with --tensor-parallel: split norms and dropouts too"
    )
    plan.add_argument(
        "--pp",
        "--pipeline-parallel",
        dest="pp",
        type=_positive,
        default=1,
        help="pipeline stages, on paper only (Lightning has no pipeline strategy)",
    )
    plan.set_defaults(func=_plan)
    presets = sub.add_parser("presets", help="list the presets, or describe one (every setting and its source)")
    presets.add_argument("name", nargs="?", default=None, help="the preset to describe (default: list them all)")
    presets.set_defaults(func=_presets)
    quarantine = sub.add_parser(
        "quarantine",
        help="list the samples StepReplay quarantined: from its quarantine.json or from a checkpoint",
        formatter_class=_Help,
    )
    quarantine.add_argument("file", help="a quarantine.json written by StepReplay, or a checkpoint of its run")
    quarantine.set_defaults(func=_quarantine)
    verify = sub.add_parser(
        "verify",
        help="verify every checkpoint in a directory: step, healthy or not, checksums (exit 1 if any fails)",
        description="List every checkpoint in DIR with its step, whether StableCheckpoint listed it as healthy, "
        "and whether it verifies: complete, and every file's checksum as written. Exit status 1 if any fails.",
    )
    verify.add_argument("dir", metavar="DIR", help="the directory of the checkpoints (StableCheckpoint's dirpath)")
    verify.set_defaults(func=_verify)
    incidents = sub.add_parser(
        "incidents",
        help="print a run's incident log: every fault handled (skips, replays, rollbacks, preemptions, restarts)",
        description="Print the incident log in DIR/incidents/ (every rank's, across restarts): a count per kind, "
        "then each incident with its step, rank, host, what was done and what it cost.",
    )
    incidents.add_argument("dir", metavar="DIR", help="the directory of the checkpoints (where the log is kept)")
    incidents.set_defaults(func=_incidents)
    args = parser.parse_args(argv)
    if args.command == "demo" and args.nan_at_step is not None and not -1 <= args.nan_at_step < args.steps:
        demo.error(
            f"argument --nan-at-step: {args.nan_at_step} is outside the run (steps 0..{args.steps - 1}). "
            f"Fix: pass a step below --steps {args.steps}, or -1 for no NaN step."
        )
    from lightning_stability.errors import StabilityConfigError

    try:
        return int(args.func(args))
    except (StabilityConfigError, _Refused) as err:
        parser.exit(2, f"lightning-stability {args.command}: {err}\n")


if __name__ == "__main__":
    raise SystemExit(main())
