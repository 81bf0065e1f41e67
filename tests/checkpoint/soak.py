"""The kill -9 soak: launch ``soak_run.py``, SIGKILL a random rank at a random moment, check every checkpoint on
disk, resume with ``ckpt_path="last"``, again; then finish the run and compare it with an uninterrupted one.

Used by tests/checkpoint/test_soak.py (3 kills per configuration) and benchmarks/fault_tolerance.py (10).
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

from lightning_stability.checkpoint import atomic, verify_checkpoint
from lightning_stability.checkpoint.ring import HealthyCheckpoints

REPO = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("soak_run.py")


class SoakFailure(AssertionError):
    pass


@dataclass
class SoakResult:
    config: str
    kills: int = 0
    mid_save: int = 0  # kills that left a never-published sibling: the kill landed inside a checkpoint write
    resumed_at: list[int] = field(default_factory=list)  # the step each launch resumed at
    checkpoints_verified: int = 0  # checkpoints on disk checked with verify_checkpoint after the kills
    max_abs_diff: float = 0.0  # weights and optimizer state against the uninterrupted run
    mismatches: list[str] = field(default_factory=list)
    wall_s: float = 0.0

    def line(self) -> str:
        verdict = "nothing lost" if not self.mismatches else f"LOST: {'; '.join(self.mismatches[:5])}"
        return (
            f"{self.config}: killed {self.kills} times ({self.mid_save} inside a checkpoint write), {verdict}: "
            f"resumed at steps {self.resumed_at}, {self.checkpoints_verified} checkpoints verified, max abs "
            f"difference to the uninterrupted run {self.max_abs_diff:g}, {self.wall_s:.1f} s"
        )


class ForkServer:
    """``SCRIPT serve`` in a process of its own (its stderr in ``out/server.log``), which forks the ranks of each
    launch from one process that imported everything; what a launch is, is the subclass's."""

    def __init__(self, out: Path, script: Path) -> None:
        env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1")
        self.log = open(out / "server.log", "ab")  # noqa: SIM115 (closed in close())
        self.proc = subprocess.Popen(
            [sys.executable, str(script), "serve"],
            env=env,
            cwd=out,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            start_new_session=True,
        )

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


class Server(ForkServer):
    """``soak_run.py serve``: the two ranks of each launch, forked."""

    def __init__(self, out: Path) -> None:
        super().__init__(out, SCRIPT)

    def launch(self, out: Path, config: str, steps: int, runs: list[str]) -> list[int]:
        """Start both ranks; returns their pids."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"{out} {config} {steps} {' '.join(runs)}\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise SoakFailure(f"the fork server died: {(out / 'server.log').read_text()[-4000:]}")
        return list(json.loads(line))

    def wait(self, timeout: float) -> list[int]:
        """The exit statuses of the launch's ranks (-9: killed); after ``timeout`` s both are killed."""
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            return []
        return list(json.loads(self.proc.stdout.readline()))


def kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def _log_tail(out: Path, config: str) -> str:
    return (out / f"{config}.log").read_text(errors="replace")[-6000:]


def check_directory(directory: Path) -> tuple[int, int]:
    """Every published checkpoint in ``directory`` and every listed healthy one verifies; returns (how many were
    checked, the step ``ckpt_path="last"`` must resume from).

    That step is the newest listed one, or newer: a checkpoint the killed launch published but could not list yet
    (killed between the rename and the list's rewrite, or, with ``async_save``, before the ranks agreed on it) is
    taken back at restart. Read here from each published file's own record (the launch that claimed the list, the
    step), not from the package's take-back code.
    """
    checked = 0
    listed = HealthyCheckpoints(directory).load()
    expected = 0
    for path in sorted(directory.glob("*.ckpt")):
        verify_checkpoint(path)  # raises CheckpointError naming the path
        checked += 1
        data = torch.load(path / "meta.pt" if path.is_dir() else path, map_location="cpu", weights_only=False)
        record = data.get("lightning_stability_checkpoint", {})
        if listed.run is not None and record.get("run") == listed.run and record.get("name") == path.name:
            expected = max(expected, int(record["step"]))
    for entry in listed.entries:
        verify_checkpoint(directory / entry.name)
        expected = max(expected, entry.step)
    return checked, expected


#: the steps a launch may take past its first before its kill (kills x this must stay below the run's steps)
MAX_STEPS_PER_LAUNCH = 3


def kill_once(
    server: Server, out: Path, config: str, steps: int, rng: random.Random, result: SoakResult, max_delay: float
) -> int:
    """One launch resuming from "last", one rank SIGKILLed at a random moment after its first step (then the
    other, which would wait in a collective for the dead one: what torchrun's agent does); returns the newest
    step the next launch must resume from (see check_directory)."""
    for stale in [out / f"{config}.progress", out / f"{config}.start.json"]:
        stale.unlink(missing_ok=True)
    pids = server.launch(out, config, steps, ["soak"])
    deadline = time.monotonic() + 240
    progress = out / f"{config}.progress"
    while not progress.exists() or not progress.read_text().split():
        if time.monotonic() > deadline or server.wait(0.01):
            for pid in pids:
                kill(pid)
            server.wait(30)
            raise SoakFailure(f"the {config} run ended before its first step:\n{_log_tail(out, config)}")
    # a random moment, but within MAX_STEPS_PER_LAUNCH steps of the first, so that every kill lands before the
    # run's end whatever the machine's speed (a fast machine would otherwise finish the run inside the delay)
    first = int(progress.read_text().split()[0])
    wait_until = time.monotonic() + rng.uniform(0.0, max_delay)
    while time.monotonic() < wait_until and int(progress.read_text().split()[-1]) < first + MAX_STEPS_PER_LAUNCH:
        time.sleep(0.002)
    victim = rng.randrange(2)
    kill(pids[victim])
    directory = out / config / "ckpts"
    result.mid_save += any(atomic.is_sibling(p.name) for p in directory.iterdir())
    time.sleep(rng.uniform(0.0, 0.05))
    kill(pids[1 - victim])
    codes = server.wait(60)
    # the other rank: killed, or ended by its error once gloo lost the dead peer (exit status 1)
    if len(codes) != 2 or codes[victim] != -signal.SIGKILL or codes[1 - victim] == 0:
        raise SoakFailure(f"the {config} run was not killed (exit statuses {codes}): give it more steps")
    result.kills += 1
    result.resumed_at.append(json.loads((out / f"{config}.start.json").read_text())["global_step"])
    checked, newest = check_directory(directory)
    result.checkpoints_verified += checked
    return newest


def _data(out: Path, config: str, kind: str, rank: int) -> dict[int, str]:
    lines = (out / f"{config}.{kind}.data.{rank}").read_text().split("\n")
    return dict((int(s), crc) for s, crc in (line.split() for line in lines if line))  # a repeated step: the last


def compare(out: Path, config: str, result: SoakResult) -> None:
    """The resumed run's end state against the uninterrupted run's, on each rank: bit for bit."""
    for rank in range(2):
        data, ref_data = _data(out, config, "soak", rank), _data(out, config, "reference", rank)
        wrong = [step for step in ref_data if data.get(step) != ref_data[step]]
        if wrong:
            result.mismatches.append(f"rank {rank} trained on other data at steps {wrong}")
        soak = torch.load(out / f"{config}.soak.{rank}.pt", weights_only=False)
        ref = torch.load(out / f"{config}.reference.{rank}.pt", weights_only=False)
        for group in ("params", "optimizer"):
            if soak[group].keys() != ref[group].keys():
                result.mismatches.append(f"rank {rank} {group} keys differ")
                continue
            for name, value in ref[group].items():
                diff = float((soak[group][name].double() - value.double()).abs().max()) if value.numel() else 0.0
                result.max_abs_diff = max(result.max_abs_diff, diff)
                if not torch.equal(soak[group][name], value):
                    result.mismatches.append(f"rank {rank} {group} {name} differs by up to {diff:g}")
        for key in ("lr", "scale", "scaler_state", "ledger", "global_step", "epoch"):
            if soak[key] != ref[key]:
                result.mismatches.append(f"rank {rank} {key}: {soak[key]} != uninterrupted {ref[key]}")


def soak(out: Path, config: str, kills: int, steps: int, seed: int, max_delay: float = 0.6) -> SoakResult:
    """Kill a run ``kills`` times, resume it each time, finish it and compare it with an uninterrupted run."""
    started = time.monotonic()
    if kills * (MAX_STEPS_PER_LAUNCH + 2) >= steps:
        raise ValueError(
            f"steps={steps} is too few for {kills} kills: pass more than {kills * (MAX_STEPS_PER_LAUNCH + 2)}"
        )
    rng = random.Random(seed)
    result = SoakResult(config)
    newest = 0
    server = Server(out)
    try:
        for _ in range(kills):
            listed_before = newest
            newest = kill_once(server, out, config, steps, rng, result, max_delay)
            if result.resumed_at[-1] != listed_before:
                result.mismatches.append(
                    f"launch {result.kills} resumed at step {result.resumed_at[-1]}, not at the newest healthy "
                    f"published checkpoint's {listed_before}"
                )
        pids = server.launch(out, config, steps, ["soak", "reference"])
        codes = server.wait(300)
        if codes != [0, 0]:
            for pid in pids:
                kill(pid)
            raise SoakFailure(f"the final {config} launch failed ({codes}):\n{_log_tail(out, config)}")
    finally:
        server.close()
    result.resumed_at.append(json.loads((out / f"{config}.start.json").read_text())["global_step"])
    if result.resumed_at[-1] != newest:
        result.mismatches.append(f"the last launch resumed at {result.resumed_at[-1]}, not at {newest}")
    checked, _ = check_directory(out / config / "ckpts")
    result.checkpoints_verified += checked
    compare(out, config, result)
    result.wall_s = time.monotonic() - started
    return result
