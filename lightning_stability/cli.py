"""Command line: ``lightning-stability demo | plan | presets [NAME]``."""

from __future__ import annotations

import argparse
import warnings
from collections.abc import Sequence


def _demo(args: argparse.Namespace) -> int:
    import logging

    lightning_logger = logging.getLogger("lightning.pytorch")
    previous_level = lightning_logger.level
    lightning_logger.setLevel(logging.WARNING)  # no "GPU available" / tip banners
    try:
        return _run_demo(args)
    finally:
        lightning_logger.setLevel(previous_level)


def _run_demo(args: argparse.Namespace) -> int:
    from lightning_stability.demo import run_demo

    print(
        f"Training a small transformer LM for {args.steps} steps (max_norm={args.max_norm}, "
        f"NaN loss injected at step {args.nan_at_step}) ..."
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = run_demo(steps=args.steps, max_norm=args.max_norm, nan_at_step=args.nan_at_step)
    for w in caught:
        if "Non-finite gradient" in str(w.message):
            print(f"warning: {w.message}")
    norms = result.grad_norms
    finite = [n for n in norms if n == n and n != float("inf")]
    print()
    print(f"optimizer steps         {result.steps}")
    print(f"applied / skipped (NaN) {result.applied} / {result.skipped_nonfinite}")
    print(
        f"grad norm first/median  {finite[0]:.3f} / {sorted(finite)[len(finite) // 2]:.3f} (clipped to {args.max_norm})"
    )
    lrs = result.lrs
    print(f"LR warmup/peak/final    {lrs[0]:.2e} / {max(lrs):.2e} / {lrs[-1]:.2e} (warmup -> constant -> cosine)")
    print(f"loss first -> last      {result.first_loss:.3f} -> {result.last_loss:.3f} (mean of 10 steps)")
    print(f"weights finite          {result.weights_finite}")
    ok = result.weights_finite and result.last_loss < result.first_loss and result.skipped_nonfinite == 1
    print("demo " + ("OK: the broken step was skipped and training went on." if ok else "FAILED"))
    return 0 if ok else 1


def _presets(args: argparse.Namespace) -> int:
    from lightning_stability.presets import describe, list_presets

    if args.name:
        print(describe(args.name))
        return 0
    table = list_presets()
    width = max(len(name) for name in table)
    for name, description in table.items():
        print(f"{name:<{width}}  {description}")
    print("\n`lightning-stability presets NAME` shows every setting of one, with its source.")
    return 0


def _plan(args: argparse.Namespace) -> int:
    from lightning_stability.planner import ModelShape, plan_memory
    from lightning_stability.presets import get_preset

    preset = get_preset(args.preset) if args.preset else None
    shape = ModelShape(args.params, layers=args.layers, hidden=args.hidden, heads=args.heads, vocab=args.vocab)
    precision = args.precision or (preset.precision if preset else "bf16-mixed")
    sharding = args.sharding or ("full" if preset is None or preset.fsdp else "none")
    checkpointing = args.activation_checkpointing or bool(preset and preset.activation_checkpointing)
    effective = args.effective_batch or (preset.effective_batch if preset else None)
    plan = plan_memory(
        shape,
        nodes=args.nodes if args.nodes is not None else (preset.num_nodes if preset else 1),
        gpus_per_node=args.gpus_per_node,
        gpu_memory=args.gpu_memory,
        precision=precision,
        optimizer=args.optimizer,
        sharding=sharding,  # type: ignore[arg-type]  # checked by plan_memory
        seq_len=args.seq_len,
        micro_batch=args.micro_batch,
        activation_checkpointing=checkpointing,
        effective_batch=effective,
        cpu_offload=args.cpu_offload,
    )
    if preset is not None:
        print(
            f"preset {preset.name}: precision {precision}, sharding {sharding}, activation checkpointing "
            f"{checkpointing}, effective batch {effective}"
        )
    print(plan.table())
    return 0 if plan.fits else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="lightning-stability", description="Stable large-model training for Lightning."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train a small transformer with the stability callbacks and report")
    demo.add_argument("--steps", type=int, default=60)
    demo.add_argument("--max-norm", type=float, default=1.0)
    demo.add_argument("--nan-at-step", type=int, default=20)
    demo.set_defaults(func=_demo)
    plan = sub.add_parser(
        "plan",
        help="memory per GPU of a training run: fits or not, the largest micro-batch, the accumulation",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    plan.add_argument("--preset", default=None, help="take precision, sharding, checkpointing, nodes and batch from it")
    plan.add_argument("--params", type=float, required=True, help="number of parameters, e.g. 175e9")
    plan.add_argument("--layers", type=int, default=None, help="transformer layers (for the activations)")
    plan.add_argument("--hidden", type=int, default=None, help="hidden size (for the activations)")
    plan.add_argument("--heads", type=int, default=None, help="attention heads (eager attention's scores)")
    plan.add_argument("--vocab", type=int, default=None, help="vocabulary size (the logits)")
    plan.add_argument("--nodes", type=int, default=None, help="machines (default: the preset's, else 1)")
    plan.add_argument("--gpus-per-node", type=int, default=1, help="GPUs per machine")
    plan.add_argument("--gpu-memory", default="80GiB", help="memory of one GPU, e.g. 80GiB, 40GB")
    plan.add_argument("--precision", default=None, help="16-mixed, bf16-mixed or 32-true (default: the preset's)")
    plan.add_argument("--optimizer", default="adamw", help="adamw, sgd or sgd_momentum")
    plan.add_argument("--sharding", default=None, help="full, grad_op, optimizer or none (default: from the preset)")
    plan.add_argument("--seq-len", type=int, default=2048, help="sequence length")
    plan.add_argument("--micro-batch", type=int, default=1, help="sequences per GPU per forward pass")
    plan.add_argument("--effective-batch", type=int, default=None, help="global batch (default: the preset's)")
    plan.add_argument("--activation-checkpointing", action="store_true", help="plan with it on")
    plan.add_argument("--cpu-offload", action="store_true", help="optimizer state in host memory")
    plan.set_defaults(func=_plan)
    presets = sub.add_parser("presets", help="list the presets, or describe one (every setting and its source)")
    presets.add_argument("name", nargs="?", default=None, help="the preset to describe (default: list them all)")
    presets.set_defaults(func=_presets)
    args = parser.parse_args(argv)
    from lightning_stability.errors import StabilityConfigError

    try:
        return int(args.func(args))
    except StabilityConfigError as err:
        parser.exit(2, f"lightning-stability {args.command}: {err}\n")


if __name__ == "__main__":
    raise SystemExit(main())
