"""Chaos runs: a DDP run (2 processes, gloo) under a schedule of faults (kills in steps and in saves, a SIGTERM,
transient NaNs, a damaged checkpoint, a restart on 1 process) with a restart by ``trainer.fit(ckpt_path="last")``
after each death, against an uninterrupted run with the same poisoned samples; see chaos_run.py for the run and the
fault kinds.

``chaos(out, faults)`` launches the run as often as its faults end it: each launch arms the faults in order up to
and including the first that ends it (``sigterm`` or a kill), each firing once. A launch that a kill ends is
restarted at once, as torchrun's agent restarts a group (``--max-restarts``); a job ends (and the driver starts the
next, as a scheduler requeues one) after a ``sigterm`` (every rank saves and exits 0), after a
``Fault(..., damage=True)`` of kind ``kill_after_publish`` (the driver then flips a byte inside the checkpoint it
published, while the job is down) and after a ``resize`` (rank 1 SIGKILLed in its forward, a lost node: the next
job runs on 1 process, the one after it on 2 again). ``launcher="fork"`` forks each launch from a server that
imported everything (tests); ``"torchrun"`` runs each job as ``torchrun --max-restarts=<its launches - 1>``
(benchmarks/chaos.py). The result says where each launch started, what each fault cost, and the first step whose
samples or weights differ from the reference run (after a resize: the samples of each global batch, and the end
state within ``WORLD_BOUND``).

Used by tests/checkpoint/test_chaos.py and benchmarks/chaos.py.
"""

from __future__ import annotations

import contextlib
import itertools
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
from typing import Any, NamedTuple

import torch

from tests.checkpoint.chaos_run import FAULTS
from tests.checkpoint.soak import ForkServer
from tests.checkpoint.test_world_size import BOUND as WORLD_BOUND
from tests.helpers import kill_process_tree

REPO = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("chaos_run.py")
KILLS = ("kill_forward", "kill_before_update", "kill_in_save", "kill_in_async_save", "kill_after_publish")
ENDS_A_LAUNCH = ("sigterm", "resize", *KILLS)
SAVES = ("kill_in_save", "kill_in_async_save", "kill_after_publish")  # fire at a save: rank 0 for the writes


class ChaosFailure(AssertionError):
    def __init__(self, message: str, result: ChaosResult | None = None) -> None:
        super().__init__(message)
        self.result = result  # what was found before the failure


@dataclass(frozen=True)
class Fault:
    kind: str  # one of chaos_run.FAULTS, or "resize"
    rank: int
    step: int  # trainer.global_step when it fires (a save fault: the first save at or after it)
    damage: bool = False  # kill_after_publish: flip a byte of the published checkpoint while the job is down

    @property
    def label(self) -> str:
        """The fault kind as reported: a ``kill_after_publish`` with ``damage`` is ``damaged_while_down``."""
        return "damaged_while_down" if self.damage else self.kind

    @property
    def ends_job(self) -> bool:
        return self.kind in ("sigterm", "resize") or self.damage

    def spec(self, index: int, world: int) -> dict[str, object]:
        kind, rank = ("kill_forward", 1) if self.kind == "resize" else (self.kind, self.rank)
        return {"kind": kind, "rank": rank % world, "step": self.step, "id": index}


@dataclass
class Outcome:
    """What one fault did: where it fired, who restarted the run, where it resumed, the steps it cost."""

    fault: Fault
    fired_at: int | None = None  # trainer.global_step when it fired (None: it never fired)
    launch: int | None = None  # the launch it fired in
    time: float = 0.0
    restarted_by: str = ""  # "torchrun" (--max-restarts), "requeue" (the driver's next job), "" (in-process)
    resumed_at: int | None = None  # the step the launch after it started at
    lost: int = 0  # steps trained again: rank 0's steps of its launch after the step the next one resumed at
    damaged: str = ""  # the checkpoint the driver damaged after it (damage=True)
    down_s: float = 0.0  # seconds from the fault to the first step of the launch after it (start-up included)


@dataclass
class ChaosResult:
    resumed_at: list[int] = field(default_factory=list)  # the step each launch started at
    worlds: list[int] = field(default_factory=list)  # the processes of each launch
    exit_codes: list[list[int]] = field(default_factory=list)  # per job: every rank's per launch (fork), torchrun's
    first_divergence: int | None = None  # the first step (as logged at its end) whose samples or weights differ
    mismatches: list[str] = field(default_factory=list)
    max_abs_diff: float = 0.0
    tolerance: float = 0.0  # 0: bit-equal expected; WORLD_BOUND after a resize
    quarantined: list[int] = field(default_factory=list)
    outcomes: list[Outcome] = field(default_factory=list)
    damaged: dict[int, str] = field(default_factory=dict)  # fault index -> the checkpoint file damaged after it
    job_started: list[float] = field(default_factory=list)  # time.time() as each job was launched
    startup_s: list[float] = field(default_factory=list)  # per job: from its launch to its first launch's start
    executed: int = 0  # optimizer steps rank 0 trained, over every launch
    finished: bool = False
    wall_s: float = 0.0

    def line(self) -> str:
        if self.mismatches:
            verdict = f"DIFFERS from step {self.first_divergence}"
        else:
            verdict = "bit-equal" if self.tolerance == 0 else f"within {self.tolerance:g}"
        return (
            f"launches started at {self.resumed_at} on {self.worlds} processes, exits {self.exit_codes}; {verdict} "
            f"(max abs {self.max_abs_diff:g}); {len(self.quarantined)} quarantined; {self.executed} steps trained; "
            f"{self.wall_s:.1f} s" + ("" if not self.mismatches else f"; {'; '.join(self.mismatches[:4])}")
        )


@dataclass
class Job:
    """One job (a torchrun invocation): its processes and its launches, each the faults it arms (by index)."""

    world: int
    launches: list[list[int]] = field(default_factory=list)


def plan(faults: list[Fault]) -> list[Job]:
    """The jobs and launches of a schedule: a launch ends at its first fault in ``ENDS_A_LAUNCH``, a job at its
    first that ``ends_job``; the last launch runs to the end."""
    jobs, pending = [Job(2)], list(range(len(faults)))
    while True:
        armed: list[int] = []
        while pending and (not armed or faults[armed[-1]].kind not in ENDS_A_LAUNCH):
            armed.append(pending.pop(0))
        jobs[-1].launches.append(armed)
        if not armed or faults[armed[-1]].kind not in ENDS_A_LAUNCH:
            return jobs
        if faults[armed[-1]].ends_job:
            jobs.append(Job(1 if faults[armed[-1]].kind == "resize" else 2))


class Server(ForkServer):
    """``chaos_run.py serve``: forks the ranks of each launch from one process that imported everything; a job's
    launches one after the other (the next as soon as one ends, as torchrun's agent restarts a group)."""

    def __init__(self, out: Path) -> None:
        super().__init__(out, SCRIPT)

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

    def job(self, spec: dict[str, Any], attempts: list[dict[str, Any]], timeout: float = 600) -> list[int]:
        codes: list[int] = []
        for i, attempt in enumerate(attempts):
            codes += self.launch({**spec, **attempt, "launch": spec["launch"] + i}, timeout)
        return codes


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


class Torchrun:
    """Each job as ``torchrun --standalone --max-restarts=<its launches - 1>`` (``chaos_run.py worker``), with
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (without it, torch 2.13's restarted gloo group fails to connect)."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def job(self, spec: dict[str, Any], attempts: list[dict[str, Any]], timeout: float = 600) -> list[int]:
        """Run the job to its end; returns torchrun's exit status."""
        path = self.out / f"{spec['name']}.job-{spec['launch']}.json"
        path.write_text(json.dumps({**spec, "attempts": attempts}))
        env = dict(
            os.environ,
            PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
            OMP_NUM_THREADS="1",
            TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
        )
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={spec['world']}"]
        command += [f"--max-restarts={len(attempts) - 1}", "--monitor-interval=0.1", str(SCRIPT), "worker", str(path)]
        with open(self.out / "torchrun.log", "ab") as log:
            proc = subprocess.Popen(command, env=env, cwd=self.out, stdout=log, stderr=log, start_new_session=True)
            try:
                return [proc.wait(timeout=timeout)]
            except subprocess.TimeoutExpired:
                kill_process_tree(proc.pid)
                proc.wait()
                raise ChaosFailure(f"a job ran past {timeout} s: see {self.out / 'torchrun.log'}") from None

    def close(self) -> None:
        pass


class Step(NamedTuple):
    samples: str  # crc32 of the step's sample indices, in the order of the rank's batch
    weights: str  # crc32 of the weights after the step
    launch: int
    indices: tuple[int, ...]


def steps_log(out: Path, name: str, rank: int) -> dict[int, Step]:
    """``{step: Step}``, the last time each step was trained (the surviving timeline)."""
    return {step: line for step, line in trained(out, name, rank)}


def trained(out: Path, name: str, rank: int) -> list[tuple[int, Step]]:
    """Every step ``rank`` trained, in order, a step trained again repeated."""
    path = out / f"{name}.steps.{rank}"
    found = []
    for line in path.read_text().splitlines() if path.exists() else []:
        step, samples, weights, _, launch, *indices = line.split()
        found.append((int(step), Step(samples, weights, int(launch), tuple(json.loads(f"[{','.join(indices)}]")))))
    return found


def json_lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def compare(out: Path, name: str, reference: str, result: ChaosResult) -> None:
    """Step by step, then the end state. Up to the first launch on another world size, each rank's samples and
    weights must equal the reference's; from it on, each global batch's samples (every rank's together), and the
    end state within ``result.tolerance``."""
    starts = json_lines(out / f"{name}.starts")
    resized = [s for s in starts if s["world"] != 2]
    exact_until = resized[0]["global_step"] if resized else None
    logs = [steps_log(out, name, rank) for rank in range(2)]
    refs = [steps_log(out, reference, rank) for rank in range(2)]
    wrong: dict[int, str] = {}
    for step in refs[0]:
        if exact_until is None or step <= exact_until:
            for rank in range(2):
                mine = logs[rank].get(step)
                if mine is not None and mine[:2] != refs[rank][step][:2]:
                    what = "samples" if mine.samples != refs[rank][step].samples else "weights"
                    wrong.setdefault(step, f"rank {rank}: {what} differ")
            continue
        launch = logs[0][step].launch if step in logs[0] else None
        got = sorted(i for log in logs if step in log and log[step].launch == launch for i in log[step].indices)
        if got != sorted(i for ref in refs for i in ref[step].indices):
            wrong.setdefault(step, "the global batch's samples differ")
    if wrong:
        result.first_divergence = min(wrong)
        result.mismatches.append(f"{wrong[min(wrong)]} first at step {min(wrong)} ({len(wrong)} steps)")
    for rank in (r for r in range(2) if (out / f"{name}.{r}.pt").exists()):
        final, ref_final = (torch.load(out / f"{n}.{rank}.pt", weights_only=False) for n in (name, reference))
        for group in ("params", "optimizer"):
            for key, value in ref_final[group].items():
                got = final[group][key]
                diff = float((got.double() - value.double()).abs().max()) if value.numel() else 0.0
                result.max_abs_diff = max(result.max_abs_diff, diff)
                if not torch.equal(got, value) if result.tolerance == 0 else diff > result.tolerance:
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


def account(out: Path, name: str, faults: list[Fault], jobs: list[Job], result: ChaosResult) -> None:
    """Each fault's outcome from the logs: where it fired, who restarted the run, the steps trained again."""
    starts = {s["launch"]: s for s in json_lines(out / f"{name}.starts")}
    fired = {f["id"]: f for f in json_lines(out / f"{name}.fired")}
    steps = trained(out, name, 0)
    result.executed = len(steps)
    result.resumed_at = [starts[k]["global_step"] for k in sorted(starts)]
    result.worlds = [starts[k]["world"] for k in sorted(starts)]
    result.outcomes = [Outcome(f) for f in faults]
    launch = 0
    for job, started in zip(jobs, result.job_started, strict=False):
        if launch in starts:
            result.startup_s.append(starts[launch]["time"] - started)
        launch += len(job.launches)
    launch = 0
    for job in jobs:
        for i, armed in enumerate(job.launches):
            for index in armed:
                outcome = result.outcomes[index]
                outcome.damaged = result.damaged.get(index, "")
                if index in fired:
                    outcome.fired_at, outcome.launch, outcome.time = (fired[index][k] for k in ("at", "launch", "time"))
                if faults[index].kind not in ENDS_A_LAUNCH or launch + 1 not in starts:
                    continue
                outcome.restarted_by = "torchrun" if i + 1 < len(job.launches) else "requeue"
                resumed = outcome.resumed_at = starts[launch + 1]["global_step"]
                outcome.down_s = starts[launch + 1]["time"] - outcome.time
                outcome.lost = sum(1 for step, line in steps if line.launch == launch and step > resumed)
            launch += 1


def check_job(out: Path, name: str, faults: list[Fault], job: Job, first: int, codes: list[int], last: bool) -> None:
    """Raise ``ChaosFailure`` unless the job went as planned: each launch started, each fault fired, it ended as
    its last fault ends a job (a SIGTERM: every rank exits 0; a kill: non-zero), the last job at the run's end."""
    starts = {s["launch"] for s in json_lines(out / f"{name}.starts")}
    fired = {f["id"] for f in json_lines(out / f"{name}.fired")}
    where = f"job of launches {first}-{first + len(job.launches) - 1} ({job.world} processes, exit {codes})"
    missing = [first + i for i in range(len(job.launches)) if first + i not in starts]
    if missing:
        raise ChaosFailure(f"{where}: launches {missing} never started; see {out / (name + '.log')}")
    unfired = [faults[i] for armed in job.launches for i in armed if i not in fired]
    if unfired:
        raise ChaosFailure(f"{where}: the faults {unfired} never fired; see {out / (name + '.log')}")
    finished = (out / f"{name}.0.pt").exists()
    ending = faults[job.launches[-1][-1]] if job.launches[-1] else None
    if last and not (finished and codes[-1] == 0):
        raise ChaosFailure(f"{where}: the run did not finish; see {out / (name + '.log')}")
    if not last and (finished or (codes[-1] == 0) != (ending is not None and ending.kind == "sigterm")):
        raise ChaosFailure(f"{where}: ended unlike its last fault {ending}; see {out / (name + '.log')}")


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
    launcher: str = "fork",
    async_save: bool = False,
    timeout: float = 600,
) -> ChaosResult:
    """Run ``faults`` (in order, see the module's docstring) to ``steps``, then, unless ``reference`` is ``None``,
    the uninterrupted run under that name (or reuse it when ``out`` already holds it) and compare them. Saves are
    asynchronous in a launch arming ``kill_in_async_save``, synchronous in one arming ``kill_in_save``, else as
    ``async_save`` says. A schedule with a ``resize`` trains without dropout (the reference too: name it apart)."""
    started = time.monotonic()
    out.mkdir(parents=True, exist_ok=True)
    resized = any(f.kind == "resize" for f in faults)
    base = {"out": str(out), "steps": steps, "n": n, "batch": batch, "every": every, "poisoned": list(poisoned)}
    base["dropout"] = not resized
    result = ChaosResult(tolerance=WORLD_BOUND if resized else 0.0)
    jobs = plan(faults)
    runner: Server | Torchrun = Server(out) if launcher == "fork" else Torchrun(out)
    try:
        first = 0
        for number, job in enumerate(jobs):
            attempts = []
            for armed in job.launches:
                kinds = {faults[i].kind for i in armed}
                mode = "kill_in_async_save" in kinds or (async_save and "kill_in_save" not in kinds)
                attempts.append({"faults": [faults[i].spec(i, job.world) for i in armed], "async_save": mode})
            spec = {**base, "name": name, "kind": "chaos", "world": job.world, "launch": first}
            result.job_started.append(time.time())
            codes = runner.job(spec, attempts, timeout)
            result.exit_codes.append(codes)
            check_job(out, name, faults, job, first, codes, last=number == len(jobs) - 1)
            first += len(job.launches)
            if job.launches[-1] and faults[job.launches[-1][-1]].damage:
                result.damaged[job.launches[-1][-1]] = damage(out / name / "ckpts").name
        result.finished = True
        if reference is not None and not (out / f"{reference}.1.pt").exists():
            spec = {**base, "name": reference, "kind": "reference", "world": 2, "launch": 0}
            codes = runner.job(spec, [{"faults": []}], timeout)
            if codes[-1] != 0 or not (out / f"{reference}.1.pt").exists():
                raise ChaosFailure(f"the reference run failed {codes}: see {out / (reference + '.log')}")
    except ChaosFailure as failure:
        account(out, name, faults, jobs, result)
        failure.result = result
        raise
    finally:
        runner.close()
    account(out, name, faults, jobs, result)
    if reference is not None:
        compare(out, name, reference, result)
    result.wall_s = time.monotonic() - started
    return result


#: the kinds random_schedule draws, each once: a ``damaged_while_down`` is a ``kill_after_publish`` with damage
SCHEDULED = (*FAULTS, "damaged_while_down")


def random_schedule(
    seed: int, steps: int = 120, every: int = 10, resize: bool = False, kinds: tuple[str, ...] = SCHEDULED
) -> list[Fault]:
    """Every one of ``kinds`` (of ``SCHEDULED``) once, and a ``resize`` if asked, in a random order at random steps
    at least 4 apart (a SIGTERM stops a launch up to 2 steps after it), from step 2 to ``steps - 5``. The faults
    inside a save are at distinct multiples of ``every``, on rank 0 for the writes; the others on a random rank.

    Train a schedule with a ``resize`` without poisoned samples: a rank's batch that lost quarantined samples
    weighs each of its samples more than one process's batch does (DDP averages the ranks' means), so the end
    state moves away from the reference by far more than ``WORLD_BOUND`` (0.045 measured: benchmarks/README.md)."""
    rng = random.Random(seed)
    names = [*kinds, *(["resize"] if resize else [])]
    saves = [k for k in names if k in SAVES or k == "damaged_while_down"]
    for _ in range(100_000):
        at = dict(zip(saves, rng.sample(range(every, steps - 4, every), len(saves)), strict=True))
        for kind in names:
            at.setdefault(kind, rng.randrange(2, steps - 4))
        ordered = sorted(at.values())
        if all(b - a >= 4 for a, b in itertools.pairwise(ordered)):
            break
    else:
        raise ValueError(f"no schedule of {names} fits in {steps} steps")
    faults = []
    for kind in sorted(names, key=at.__getitem__):
        if kind == "damaged_while_down":
            faults.append(Fault("kill_after_publish", rng.randrange(2), at[kind], damage=True))
        else:
            rank = 0 if kind in SAVES[:2] else 1 if kind == "resize" else rng.randrange(2)
            faults.append(Fault(kind, rank, at[kind]))
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
