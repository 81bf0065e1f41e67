"""Benchmark: the demo's time on an idle machine and beside busy processes, per torch thread count.

``lightning-stability demo`` runs each of its processes on a fixed thread count (``demo.run.DEMO_THREADS``). On a
machine whose cores are taken by other work, a thread count above the cores left free can cost far more than a
fair share: each of the tiny model's hundreds of ops per step ends at a barrier that waits for every thread, and a
thread the scheduler has parked holds the others there. This runs the demo (``--steps`` steps, bare and the
"tiny" preset) in a fresh process per thread count, first with ``--busy 0`` then beside each count of busy
processes (``while True: pass``, one Python process each), and prints each run's time as the demo reports it.

A fair share: with ``n`` busy processes on ``c`` cores, a one-thread demo gets about ``c / (n + 1)`` of a core's
time once ``n + 1 > c``, so it should take about ``(n + 1) / c`` times its idle time (on 2 cores beside 4 busy
processes, 2.5x).

Run: ``python -m benchmarks.demo_load [--steps 150] [--threads 1,2] [--busy 0,4]``.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEMO = (
    "import sys, lightning_stability.demo.run as run; run.DEMO_THREADS = int(sys.argv[1]); "
    "from lightning_stability.cli import main; raise SystemExit(main(['demo', '--steps', sys.argv[2], "
    "'--out', sys.argv[3], '--no-progress-bar']))"
)


def time_demo(threads: int, steps: int) -> tuple[float, float, float]:
    """The demo's bare and preset run times (its table's) and the whole command's wall time, in seconds."""
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    with tempfile.TemporaryDirectory() as out:
        started = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-c", DEMO, str(threads), str(steps), out],
            env=env,
            capture_output=True,
            text=True,
            check=False,  # the exit code is the preset's verdict (1 when a short run did not train): the times count
        )
        wall = time.perf_counter() - started
    times = dict(re.findall(r"^(bare|tiny) .* (\d+)s$", done.stdout, re.M))
    if set(times) != {"bare", "tiny"}:
        raise RuntimeError(f"the demo printed no table (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return float(times["bare"]), float(times["tiny"]), wall


@contextmanager
def busy(count: int) -> Iterator[list[subprocess.Popen[bytes]]]:
    """``count`` busy processes (``while True: pass``) while the block runs, killed after it."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield spinners
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=150, help="the demo's --steps (150)")
    parser.add_argument("--threads", default="1,2", help="thread counts of the demo, comma-separated (1,2)")
    parser.add_argument("--busy", default="0,4", help="busy processes beside it, comma-separated (0,4)")
    args = parser.parse_args(argv)
    threads = [int(x) for x in args.threads.split(",")]
    busy_counts = [int(x) for x in args.busy.split(",")]
    print(
        f"{time.strftime('%a %b %d %H:%M UTC %Y', time.gmtime())}; {os.cpu_count()} CPUs, "
        f"{len(os.sched_getaffinity(0))} usable; the demo with --steps {args.steps}, a fresh process per row"
    )
    print(f"{'busy':>4} {'threads':>7} {'load (1 min)':>12} {'bare':>6} {'tiny':>6} {'whole':>7}")
    for count_busy in busy_counts:
        with busy(count_busy):
            time.sleep(2 if count_busy else 0)
            for count in threads:
                bare, tiny, wall = time_demo(count, args.steps)
                load = os.getloadavg()[0]
                print(f"{count_busy:>4} {count:>7} {load:>12.1f} {bare:>5.0f}s {tiny:>5.0f}s {wall:>6.1f}s", flush=True)


if __name__ == "__main__":
    main()
