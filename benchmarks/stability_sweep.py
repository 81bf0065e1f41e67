"""The LR sweep of ``benchmarks.stability``: convergence at each arm's fastest reliable learning rate.

The source article's "convergence 3x faster" is a claim about what stability buys: a run that does not break can be
driven harder. Comparing the two arms at one learning rate cannot show it (where the bare Trainer trains, the
preset's warmup costs it a few steps; where it does not, there is nothing to compare), so the Post-LN task is
also trained at several learning rates, both arms on the same seeds, data and initial weights. For each arm the
**fastest reliable LR** is the one with the fewest median steps to target among those where at least
``--reliable`` (98%) of its runs are stable; the claim is then the ratio of the two arms' steps there, each at
its own best setting -- what a user who tunes the LR for speed, under the constraint that runs must not break,
would get.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from dataclasses import dataclass

from benchmarks.stability_runs import Config, Run, Task, run_once


@dataclass
class LRPoint:
    lr: float
    bare: list[Run]
    preset: list[Run]

    def arm(self, preset: bool) -> list[Run]:
        return self.preset if preset else self.bare

    def stable(self, preset: bool) -> float:
        runs = self.arm(preset)
        return sum(not r.diverged for r in runs) / len(runs)

    def steps(self, preset: bool) -> list[int]:
        return [r.steps_to_target for r in self.arm(preset) if not r.diverged and r.steps_to_target is not None]

    def median_steps(self, preset: bool) -> float | None:
        steps = self.steps(preset)
        return statistics.median(steps) if steps else None

    def paired(self) -> list[float]:
        return [
            p.steps_to_target / b.steps_to_target
            for b, p in zip(self.bare, self.preset, strict=True)
            if not b.diverged and not p.diverged and b.steps_to_target and p.steps_to_target
        ]


def sweep(
    base: Config,
    lrs: list[float],
    seeds: int,
    task_of: Callable[[int], Task],
    args: argparse.Namespace,
    root: str,
    known: dict[float, tuple[list[Run], list[Run]]],
) -> list[LRPoint]:
    """Both arms of ``base`` at each LR over ``seeds`` seeds (seeds outermost); ``known`` runs are reused."""
    todo = [lr for lr in lrs if lr not in known]
    runs: dict[float, tuple[list[Run], list[Run]]] = {lr: ([], []) for lr in todo}
    for seed in range(seeds):
        task = task_of(seed)  # the data and the initial weights do not depend on the LR
        for lr in todo:
            config = Config(base.key, f"{base.key} lr {lr:g}", base.steps, lr, layers=base.layers)
            for preset in (False, True):
                runs[lr][preset].append(run_once(config, preset, seed, task, args, root, report=False))
    runs.update(known)
    return [LRPoint(lr, *runs[lr]) for lr in sorted(lrs)]


def fastest_reliable(points: list[LRPoint], preset: bool, reliable: float) -> LRPoint | None:
    """The LR with the fewest median steps to target among those where the arm is stable often enough."""
    candidates = [p for p in points if p.stable(preset) >= reliable and p.median_steps(preset) is not None]
    return min(candidates, key=lambda p: (p.median_steps(preset), p.lr), default=None)


def report(points: list[LRPoint], label: str, reliable: float) -> tuple[list[str], float | None]:
    """The sweep's table and verdict lines; also the preset/bare steps ratio at the arms' fastest reliable LRs."""

    def fmt(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    n = len(points[0].bare) if points else 0
    lines = [
        f"LR sweep, {label} ({n} seeds per arm and LR, the same seeds, data and weights in every cell; the "
        "preset's report off)",
        f"{'lr':<8} {'diverged: bare':>14} {'preset':>7} {'steps to target: bare':>22} {'preset':>7} "
        f"{'ratio':>6} {'paired (n)':>11}",
    ]
    lines.append("-" * len(lines[1]))
    for p in points:
        bare, preset = p.median_steps(False), p.median_steps(True)
        ratio = None if bare is None or preset is None else preset / bare
        paired = p.paired()
        lines.append(
            f"{p.lr:<8g} {sum(r.diverged for r in p.bare):>11}/{n:<2} {sum(r.diverged for r in p.preset):>4}/{n:<2} "
            f"{fmt(bare, '.1f'):>22} {fmt(preset, '.1f'):>7} {fmt(ratio, '.2f'):>6} "
            f"{fmt(statistics.median(paired) if paired else None, '.2f'):>6} ({len(paired)})"
        )
    best = {arm: fastest_reliable(points, arm, reliable) for arm in (False, True)}
    ratio = None
    for arm in (False, True):
        chosen = best[arm]
        name = "preset" if arm else "bare"
        if chosen is None:
            lines.append(f"fastest reliable LR ({name}, >= {reliable:.0%} of runs stable): none")
        else:
            lines.append(
                f"fastest reliable LR ({name}, >= {reliable:.0%} of runs stable): {chosen.lr:g}, "
                f"{chosen.median_steps(arm):g} steps to target"
            )
    bare_best, preset_best = best[False], best[True]
    if bare_best is not None and preset_best is not None:
        bare_steps, preset_steps = bare_best.median_steps(False), preset_best.median_steps(True)
        assert bare_steps is not None and preset_steps is not None
        ratio = preset_steps / bare_steps
        lines.append(
            f"each arm at its fastest reliable LR: preset / bare steps to target = {ratio:.2f} "
            f"(the preset {'faster' if ratio < 1 else 'slower' if ratio > 1 else 'as fast'}; "
            f"{1 / ratio:.2f}x the bare Trainer's speed)"
        )
    return lines, ratio
