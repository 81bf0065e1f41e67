"""Chaos runs: a 2-process DDP run under a schedule of faults (kills, a SIGTERM, transient NaNs, a damaged
checkpoint) with a restart by ``trainer.fit(ckpt_path="last")`` after each death, against an uninterrupted run with
the same poisoned samples; see chaos_run.py for the run and the fault kinds.

``chaos(out, faults)`` launches the run as often as its faults end it: each launch arms the faults in order up to
and including the first that ends it (``sigterm`` or a kill), each firing once. A ``Fault(..., damage=True)`` of
kind ``kill_after_publish`` also flips a byte inside the checkpoint it published, while the job is down. The
result says where each launch started, and the first step whose samples or weights differ from the reference run.

Used by tests/checkpoint/test_chaos.py; reusable for a seeded random schedule (benchmarks/chaos.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("chaos_run.py")
ENDS_A_LAUNCH = ("sigterm", "kill_forward", "kill_before_update", "kill_after_publish")


class ChaosFailure(AssertionError):
    pass


@dataclass(frozen=True)
class Fault:
    kind: str  # one of chaos_run.FAULTS
    rank: int
    step: int  # trainer.global_step when it fires
    damage: bool = False  # kill_after_publish: flip a byte of the published checkpoint while the job is down

    def spec(self) -> dict[str, object]:
        return {"kind": self.kind, "rank": self.rank, "step": self.step}


@dataclass
class ChaosResult:
    resumed_at: list[int] = field(default_factory=list)  # the step each launch started at
    exit_codes: list[list[int]] = field(default_factory=list)
    first_divergence: int | None = None  # the first step (as logged at its end) whose samples or weights differ
    mismatches: list[str] = field(default_factory=list)
    max_abs_diff: float = 0.0
    quarantined: list[int] = field(default_factory=list)
    wall_s: float = 0.0

    def line(self) -> str:
        verdict = "bit-equal" if not self.mismatches else f"DIFFERS from step {self.first_divergence}"
        return (
            f"launches started at {self.resumed_at}, exits {self.exit_codes}; {verdict} (max abs "
            f"{self.max_abs_diff:g}); {len(self.quarantined)} quarantined; {self.wall_s:.1f} s"
            + ("" if not self.mismatches else f"; {'; '.join(self.mismatches[:4])}")
        )


class Server:
    """``chaos_run.py serve``: forks the two ranks of each launch from one process that imported everything."""

    def __init__(self, out: Path) -> None:
        env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1")
        self.log = open(out / "server.log", "ab")  # noqa: SIM115 (closed in close())
        self.proc = subprocess.Popen(
            [sys.executable, str(SCRIPT), "serve"],
            env=env,
            cwd=out,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            start_new_session=True,
        )

    def launch(self, spec: dict[str, object], timeout: float = 600) -> list[int]:
        """Run one launch to its end; a rank that dies takes the other down (as torchrun's agent does). Returns
        the exit statuses (-9: SIGKILLed)."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(spec) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise ChaosFailure(f"the fork server died: {(Path(str(spec['out'])) / 'server.log').read_text()[-4000:]}")
        pids = list(json.loads(line))
        deadline = time.monotonic() + timeout
        while True:
            ready, _, _ = select.select([self.proc.stdout], [], [], 0.05)
            if ready:
                return list(json.loads(self.proc.stdout.readline()))
            if time.monotonic() > deadline:
                for pid in pids:
                    _kill(pid)
            elif any(_dead(pid) for pid in pids):
                time.sleep(0.3)  # the survivor: stopped, as torchrun stops the group after a death
                for pid in pids:
                    _kill(pid)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.log.close()


def _dead(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # ended and reaped
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def damage(directory: Path) -> Path:
    """Flip one byte in the middle of the newest checkpoint published (inside its weights, for a small model)."""
    path = max(directory.glob("*.ckpt"), key=lambda p: p.stat().st_mtime_ns)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))
    return path


def steps_log(out: Path, name: str, rank: int) -> dict[int, tuple[str, str]]:
    """``{step: (samples crc, weights crc)}``, the last time each step was trained (the surviving timeline)."""
    found: dict[int, tuple[str, str]] = {}
    path = out / f"{name}.steps.{rank}"
    for line in path.read_text().splitlines() if path.exists() else []:
        step, samples, weights, _ = line.split()
        found[int(step)] = (samples, weights)
    return found


def compare(out: Path, name: str, reference: str, result: ChaosResult) -> None:
    for rank in range(2):
        mine, ref = steps_log(out, name, rank), steps_log(out, reference, rank)
        wrong = sorted(s for s in ref if s in mine and mine[s] != ref[s])
        if wrong:
            first = wrong[0]
            what = "samples" if mine[first][0] != ref[first][0] else "weights"
            result.first_divergence = min(first, result.first_divergence or first)
            result.mismatches.append(f"rank {rank}: {what} differ first at step {first} ({len(wrong)} steps)")
        final, ref_final = (torch.load(out / f"{n}.{rank}.pt", weights_only=False) for n in (name, reference))
        for group in ("params", "optimizer"):
            for key, value in ref_final[group].items():
                got = final[group][key]
                diff = float((got.double() - value.double()).abs().max()) if value.numel() else 0.0
                result.max_abs_diff = max(result.max_abs_diff, diff)
                if not torch.equal(got, value):
                    result.mismatches.append(f"rank {rank} {group} {key} differs by up to {diff:g}")
        for key in ("ledger", "global_step", "epoch"):
            if final[key] != ref_final[key]:
                result.mismatches.append(f"rank {rank} {key}: {final[key]} != reference {ref_final[key]}")
        quarantine = json.loads((out / f"{name}.quarantine.{rank}.json").read_text())
        ref_quarantine = json.loads((out / f"{reference}.quarantine.{rank}.json").read_text())
        indices = sorted({i for e in quarantine["entries"] for i in e["indices"]})
        ref_indices = sorted({i for e in ref_quarantine["entries"] for i in e["indices"]})
        if indices != ref_indices:
            result.mismatches.append(f"rank {rank} quarantined {indices}, the reference {ref_indices}")
        result.quarantined = ref_indices


def chaos(
    out: Path,
    faults: list[Fault],
    poisoned: list[int],
    steps: int = 120,
    n: int = 640,
    batch: int = 8,
    every: int = 10,
    name: str = "chaos",
    reference: str | None = "reference",
    max_launches: int = 20,
) -> ChaosResult:
    """Run ``faults`` (in order, see the module's docstring) to ``steps``, then, unless ``reference`` is ``None``,
    the uninterrupted run under that name (or reuse it when ``out`` already holds it) and compare them."""
    started = time.monotonic()
    out.mkdir(parents=True, exist_ok=True)
    base = {"out": str(out), "steps": steps, "n": n, "batch": batch, "every": every, "poisoned": list(poisoned)}
    result = ChaosResult()
    pending = list(faults)
    server = Server(out)
    try:
        for _ in range(max_launches):
            armed: list[Fault] = []
            while pending:
                armed.append(pending.pop(0))
                if armed[-1].kind in ENDS_A_LAUNCH:
                    break
            codes = server.launch({**base, "name": name, "kind": "chaos", "faults": [f.spec() for f in armed]})
            result.exit_codes.append(codes)
            result.resumed_at.append(json.loads((out / f"{name}.start.json").read_text())["global_step"])
            finished = (out / f"{name}.0.pt").exists()
            if finished and any(f.kind in ENDS_A_LAUNCH for f in armed):
                raise ChaosFailure(f"launch {len(result.resumed_at)} finished the run before its faults {armed} fired")
            if finished:
                break
            if codes == [1, 1] or (-9 not in codes and codes != [0, 0]):
                raise ChaosFailure(f"launch {len(result.resumed_at)} failed {codes}: see {out / (name + '.log')}")
            if any(f.damage for f in armed):
                damage(out / name / "ckpts")
        else:
            raise ChaosFailure(f"not finished after {max_launches} launches")
        if pending:
            raise ChaosFailure(f"the run ended before the faults {pending} fired")
        if reference is not None and not (out / f"{reference}.1.pt").exists():
            codes = server.launch({**base, "name": reference, "kind": "reference", "faults": []})
            if codes != [0, 0]:
                raise ChaosFailure(f"the reference run failed {codes}: see {out / (reference + '.log')}")
    finally:
        server.close()
    if reference is not None:
        compare(out, name, reference, result)
    result.wall_s = time.monotonic() - started
    return result


def random_schedule(seed: int, steps: int = 120, count: int = 8, every: int = 10) -> list[Fault]:
    """``count`` faults of every kind (a ``kill_after_publish`` damaging its checkpoint half the time), on a random
    rank at increasing random steps at least 4 apart (a SIGTERM stops a launch up to 2 steps after it), the last
    before ``steps - 4``; a ``kill_after_publish`` at a multiple of ``every``."""
    rng = random.Random(seed)
    kinds = ["sigterm", "kill_forward", "kill_before_update", "kill_after_publish", "nan"]
    faults: list[Fault] = []
    step = 1
    for _ in range(count):
        kind = rng.choice(kinds)
        step += rng.randint(4, max(4, (steps - 4 - step) // max(1, count - len(faults))))
        if kind == "kill_after_publish":
            step = -(-step // every) * every
        if step >= steps - 4:
            break
        faults.append(Fault(kind, rng.randrange(2), step, damage=kind == "kill_after_publish" and rng.random() < 0.5))
    return faults


#: the schedule of issue 46, problem 8
ISSUE_46 = [
    Fault("sigterm", 0, 24),
    Fault("kill_before_update", 0, 34),
    Fault("kill_after_publish", 0, 40),
    Fault("nan", 0, 53),
    Fault("kill_forward", 1, 81),
    Fault("kill_after_publish", 0, 90, damage=True),
    Fault("nan", 1, 114),
]


if __name__ == "__main__":  # chaos.py OUT [SEED]: the issue's schedule, or a random one (3 poisoned samples)
    target = Path(sys.argv[1])
    if len(sys.argv) > 2:
        seed = int(sys.argv[2])
        schedule, bad = random_schedule(seed), random.Random(seed).sample(range(640), 3)
    else:
        schedule, bad = ISSUE_46, [3, 100, 500]
    print(schedule, bad)
    print(chaos(target, schedule, bad).line())
