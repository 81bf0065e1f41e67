"""The tables of ``benchmarks.stability``: per-configuration summaries, the restart cost, text layout."""

from __future__ import annotations

import platform
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from benchmarks.stability_runs import Run


def median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def fmt(value: float | None, spec: str = ".0f") -> str:
    return "-" if value is None else format(value, spec)


@dataclass
class Summary:
    n: int
    diverged: tuple[int, int]  # bare, preset
    steps: tuple[list[int], list[int]]  # steps to target of the converged runs that reached it
    paired: list[float]  # preset / bare steps, seeds where both converged and reached the target
    fit: list[float]  # preset / bare fit time, per seed
    loop: list[float]

    @staticmethod
    def of(bare: list[Run], preset: list[Run]) -> Summary:
        def reached(runs: list[Run]) -> list[int]:
            return [r.steps_to_target for r in runs if not r.diverged and r.steps_to_target is not None]

        pairs = list(zip(bare, preset, strict=True))
        return Summary(
            len(bare),
            (sum(r.diverged for r in bare), sum(r.diverged for r in preset)),
            (reached(bare), reached(preset)),
            [
                p.steps_to_target / b.steps_to_target
                for b, p in pairs
                if not b.diverged and not p.diverged and b.steps_to_target and p.steps_to_target
            ],
            [p.fit_s / b.fit_s for b, p in pairs],
            [p.loop_s / b.loop_s for b, p in pairs if b.loop_s > 0],
        )

    @staticmethod
    def pooled(parts: list[Summary]) -> Summary:
        return Summary(
            sum(s.n for s in parts),
            (sum(s.diverged[0] for s in parts), sum(s.diverged[1] for s in parts)),
            ([x for s in parts for x in s.steps[0]], [x for s in parts for x in s.steps[1]]),
            [x for s in parts for x in s.paired],
            [x for s in parts for x in s.fit],
            [x for s in parts for x in s.loop],
        )

    def cells(self, label: str) -> list[str]:
        n = self.n
        bare, preset = median(self.steps[0]), median(self.steps[1])
        ratio = None if bare is None or preset is None else preset / bare
        return [
            label,
            f"{self.diverged[0]}/{n}",
            f"{self.diverged[1]}/{n}",
            f"{100 * (n - self.diverged[0]) / n:.0f}%",
            f"{100 * (n - self.diverged[1]) / n:.0f}%",
            fmt(bare),
            fmt(preset),
            fmt(ratio, ".2f"),
            f"{fmt(median(self.paired), '.2f')} ({len(self.paired)})",
            fmt(median(self.fit), ".2f"),
            fmt(median(self.loop), ".2f"),
        ]


def restart_cost(length: int, n: int, diverged: int, steps: list[int]) -> float | None:
    """Expected optimizer steps until a trained model when each diverged run is restarted (None: never)."""
    stable = (n - diverged) / n
    best = median(steps)
    if stable == 0 or best is None:
        return None
    return length * (1 - stable) / stable + best


def table(rows: list[list[str]], widths: Sequence[int]) -> list[str]:
    """Rows with the first cell left-aligned and the others right-aligned."""
    return [
        " ".join([f"{r[0]:<{widths[0]}}", *(f"{c:>{w}}" for c, w in zip(r[1:], widths[1:], strict=True))]) for r in rows
    ]


def group_header(groups: Sequence[tuple[str, int]], widths: Sequence[int]) -> str:
    """A header line whose labels are centred over the columns they span (``(label, columns)`` pairs)."""
    cells, i = [], 0
    for label, span in groups:
        width = sum(widths[i : i + span]) + span - 1
        cells.append(f"{label:<{width}}" if i == 0 else f"{label:^{width}}")
        i += span
    return " ".join(cells).rstrip()


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
