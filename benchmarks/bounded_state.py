"""Benchmark: the health monitor's state does not grow with the run's length (issue 31, item 4).

A ``TrainingHealthMonitor``'s history is fed the rows of 1k to 1M simulated steps directly (no training: a row per
step as the monitor records it, with a loss spike every 50k steps and a skipped step every 20k), then its
``state_dict()`` is saved the way a checkpoint is (``AtomicCheckpointIO``: hidden sibling, ``fsync``, rename).
Printed per length: the saved file's size, the median save time of ``--repeats``, the host memory the history's
lists hold, and the size the unbounded layout (every step's row, as before) would have had, built from the same rows.

Run: ``python -m benchmarks.bounded_state [--repeats 5]`` (about 30 s on 2 cores).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

LENGTHS = (1_000, 10_000, 100_000, 1_000_000)
CHUNK = 5_000  # rows per feed, like the rows a logging step hands over (many at once: faster to simulate)


def rows(start: int, stop: int) -> list[dict[str, float]]:
    out = []
    for s in range(start, stop):
        spike = s % 50_000 == 49_999
        out.append(
            {
                "step": float(s),
                "loss": 50.0 if spike else 3.0 / math.log(s + 3.0),
                "grad_norm": 1.0 + 0.1 * math.sin(s),
                "clip_threshold": 2.0,
                "loss_spike": 1.0 if spike else 0.0,
                "grad_spike": 0.0,
                "lr": 3e-4,
                "loss_scale": 2.0**15,
                "outcome": 3.0 if s % 20_000 == 0 else 0.0,
                "update_ratio": 1e-3 if s % 50 == 49 else math.nan,
                "memory_gb": 41.0 if s % 50 == 49 else math.nan,
            }
        )
    return out


def host_bytes(history: Any) -> int:
    """Bytes of the floats the history's host lists hold (8 per value, plus a list slot each)."""
    values = sum(len(v) for v in history.series.values()) + sum(len(v) for v in history.buckets.values())
    return values * (8 + 24 + 8)  # the float, its object header, the list's pointer


def measure(steps: int, repeats: int, directory: Path) -> dict[str, float]:
    from lightning_stability import AtomicCheckpointIO, TrainingHealthMonitor
    from lightning_stability.health.history import COLUMNS, SPARSE

    monitor = TrainingHealthMonitor()
    unbounded = {k: [] for k in ("step", *COLUMNS, *SPARSE)}  # the layout before the bound: every row
    for start in range(0, steps, CHUNK):
        chunk = rows(start, min(steps, start + CHUNK))
        monitor.history.extend(chunk)
        for key, values in unbounded.items():
            values.extend(r[key] for r in chunk)
    io = AtomicCheckpointIO()
    path = directory / f"health-{steps}.ckpt"
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        io.save_checkpoint({"callbacks": {"TrainingHealthMonitor": monitor.state_dict()}}, path)
        times.append(time.perf_counter() - start)
    size = path.stat().st_size
    old = directory / "unbounded.pt"
    torch.save({"series": {k: torch.tensor(v, dtype=torch.float64) for k, v in unbounded.items()}}, old)
    return {
        "size": size,
        "save_ms": statistics.median(times[1:]) * 1e3,
        "host": host_bytes(monitor.history),
        "unbounded": old.stat().st_size,
        "buckets": len(monitor.history.buckets["count"]),
        "width": monitor.history.bucket_width,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(f"{'steps':>9} {'checkpoint':>11} {'save (ms)':>9} {'host (est.)':>11} {'buckets':>7} {'unbounded':>10}")
    with tempfile.TemporaryDirectory() as tmp:
        for steps in LENGTHS:
            r = measure(steps, args.repeats, Path(tmp))
            print(
                f"{steps:>9,} {r['size'] / 1024:>8.0f} KiB {r['save_ms']:>9.1f} {r['host'] / 1024:>7.0f} KiB "
                f"{int(r['buckets']):>4}x{int(r['width'])} {r['unbounded'] / 1024:>6.0f} KiB",
                flush=True,
            )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
