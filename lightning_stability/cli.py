"""Command line: ``lightning-stability demo | presets [NAME]``."""

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
