"""One launch of a DDP run (gloo, CPU) under a schedule of faults, for tests/checkpoint/chaos.py.

Usage: ``chaos_run.py serve`` (a fork server, as soak_run.py's: for each JSON line on stdin, a launch spec, it forks
the spec's ``world`` ranks, prints their pids as a JSON list, then their exit statuses), or under torchrun
``chaos_run.py worker SPEC_FILE`` (one job of several launches: torchrun's attempt ``TORCHELASTIC_RESTART_COUNT``
runs ``spec["attempts"][attempt]``, a restart by ``--max-restarts`` the next one).

The spec: ``{"out", "name", "kind", "steps", "n", "batch", "every", "poisoned", "faults"}`` and optionally
``"world"`` (processes, 2 unless told; the global batch stays ``2 * batch``), ``"async_save"``, ``"dropout"``
(``False``: none, for runs compared across world sizes, whose masks cannot match) and ``"launch"`` (a number for
the logs). ``kind`` is ``chaos`` (``StableCheckpoint(every_n_train_steps=every, async_save=...)`` into
``OUT/NAME/ckpts``, ``AtomicCheckpointIO``, ``trainer.fit(ckpt_path="last")``) or ``reference`` (no checkpoints,
no faults). Both train the regression ``Model`` of tests/replay/test_replay.py on ``n`` indexed samples with
``TrainingHealthMonitor(response="skip")`` and ``StepReplay``; the samples ``poisoned`` are NaN
(``PoisonedSamples``). Each fault, ``{"kind", "rank", "step", "id"}``, fires once in the launch, on its rank, at
``trainer.global_step == step``:

* ``sigterm``: SIGTERM to itself as the step starts (``StableCheckpoint`` saves and stops);
* ``kill_forward``: SIGKILL in ``training_step``;
* ``kill_before_update``: SIGKILL in ``on_before_optimizer_step``;
* ``kill_in_save`` / ``kill_in_async_save`` (rank 0, the writer): SIGKILL inside the write of the first checkpoint
  saved at or after that step, its hidden file written but neither sealed, synced nor published (synchronous:
  in the step; asynchronous: in the background thread, while the step goes on);
* ``kill_after_publish``: SIGKILL once the checkpoint of that step (or the first saved after it: a save waits for a
  healthy step) is published, before the healthy list names it;
* ``nan``: one exponent bit flipped in the last layer's output (``BitFlip``): a transient fault.

Writes, in ``OUT``: ``NAME.starts`` (rank 0, a JSON line per launch: its number, the step it started at, the
checkpoint path, the world size), ``NAME.fired`` (a JSON line per fault as it fires: id, kind, rank, step, launch,
time), ``NAME.steps.<rank>`` (each step trained, at its end: ``step crc32-of-its-sample-indices
crc32-of-the-weights quarantined launch indices``; a step trained again repeats), and at the end of the run
``NAME.<rank>.pt`` (soak_run.py's ``final_state``: weights, AdamW's state, the ledger's counts...) and
``NAME.quarantine.<rank>.json``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
import traceback
import zlib
from pathlib import Path
from typing import Any, NoReturn

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader

from lightning_stability import AtomicCheckpointIO, StableCheckpoint, TrainingHealthMonitor
from lightning_stability.checkpoint import atomic
from lightning_stability.checkpoint.ring import HealthyCheckpoints
from lightning_stability.replay import BitFlip, PoisonedSamples, StepReplay
from tests.checkpoint.soak_run import final_state, report_exits
from tests.helpers import exit_worker, quiet_trainer
from tests.replay.test_replay import IndexedData, Model

FAULTS = (
    "sigterm",
    "kill_forward",
    "kill_before_update",
    "kill_in_save",
    "kill_in_async_save",
    "kill_after_publish",
    "nan",
)


class ChaosModel(Model):
    def __init__(self, data: Any, batch: int, spec: dict[str, Any], faults: list[dict[str, Any]], rank: int) -> None:
        super().__init__(data, batch_size=batch)
        if not spec.get("dropout", True):
            self.net[2] = nn.Identity()
        self.out, self.name, self.launch = Path(spec["out"]), spec["name"], spec.get("launch", 0)
        self.faults, self.rank = faults, rank

    def fault(self, kind: str, at_or_after: int | None = None) -> bool:
        """Whether a fault of ``kind`` is due on this rank (it fires once, and is written to ``NAME.fired``): at
        ``trainer.global_step``, or, given ``at_or_after``, at that step or an earlier one."""
        for fault in self.faults:
            due = fault["step"] == self.trainer.global_step if at_or_after is None else fault["step"] <= at_or_after
            if fault["kind"] == kind and fault["rank"] == self.rank and due:
                self.faults.remove(fault)
                fired = {**fault, "at": self.trainer.global_step, "launch": self.launch, "time": time.time()}
                with open(self.out / f"{self.name}.fired", "a") as f:
                    f.write(json.dumps(fired) + "\n")
                return True
        return False

    def kill(self, kind: str, at_or_after: int | None = None) -> None:
        if self.fault(kind, at_or_after):
            os.kill(os.getpid(), signal.SIGKILL)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.kill("kill_forward")
        return super().training_step(batch, batch_idx)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=self.bs, shuffle=True)  # Lightning adds its DistributedSampler


class Record(pl.Callback):
    """The start of each launch, each step's samples and weights, the SIGTERM and pre-update kill faults, the NaN's
    firing."""

    def __init__(self, out: Path, name: str, replay: StepReplay) -> None:
        self.out, self.name, self.replay = out, name, replay
        self.indices: list[int] = []

    def on_train_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        if trainer.is_global_zero:
            start = {"launch": pl_module.launch, "global_step": trainer.global_step, "ckpt_path": trainer.ckpt_path}
            with open(self.out / f"{self.name}.starts", "a") as f:
                f.write(json.dumps({**start, "world": trainer.world_size, "time": time.time()}) + "\n")

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if pl_module.fault("sigterm"):
            os.kill(os.getpid(), signal.SIGTERM)
        pl_module.fault("nan")  # written to NAME.fired: BitFlip flips the bit in this step's forward
        self.indices = [int(i) for i in batch[2]]

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, optimizer: Any) -> None:
        pl_module.kill("kill_before_update")

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, *args: Any) -> None:
        weights = b"".join(p.detach().numpy().tobytes() for p in pl_module.parameters())
        samples = zlib.crc32(json.dumps(self.indices).encode())
        line = (
            f"{trainer.global_step} {samples} {zlib.crc32(weights)} {len(self.replay.quarantine.indices)} "
            f"{pl_module.launch} {','.join(map(str, self.indices))}\n"
        )
        with open(self.out / f"{self.name}.steps.{trainer.global_rank}", "a") as f:
            f.write(line)


def arm_save_faults(module: ChaosModel) -> None:
    """The faults inside a save: the kills in a checkpoint's write, and after its publication."""
    real_add, real_save_file, real_torch_save = HealthyCheckpoints.add, atomic.save_file, atomic.torch_save_durably

    def add(self: HealthyCheckpoints, name: str, step: int, kind: str, write: bool) -> None:
        module.kill("kill_after_publish", at_or_after=step)  # published (renamed into place), not yet listed
        real_add(self, name, step, kind, write)

    def save_file(target: Path, write: Any, *, seal: bool = False) -> None:
        if target.suffix == ".ckpt" and module.fault("kill_in_save", at_or_after=module.trainer.global_step):
            real_write = write

            def write(f: Any) -> None:
                real_write(f)
                f.flush()
                os.kill(os.getpid(), signal.SIGKILL)  # the hidden file written: not sealed, synced nor published

        real_save_file(target, write, seal=seal)

    def torch_save_durably(path: Path, obj: object, *, seal: bool = True) -> None:
        if module.fault("kill_in_async_save", at_or_after=module.trainer.global_step):
            torch.save(obj, str(path))
            os.kill(os.getpid(), signal.SIGKILL)  # in the background thread, as above
        real_torch_save(path, obj, seal=seal)

    HealthyCheckpoints.add = add  # type: ignore[method-assign]
    atomic.save_file = save_file
    atomic.torch_save_durably = torch_save_durably


def run(spec: dict[str, Any]) -> None:
    out, label, run_kind = Path(spec["out"]), spec["name"], spec["kind"]
    rank, world = int(os.environ["RANK"]), int(spec.get("world", 2))
    faults = [dict(f) for f in spec.get("faults", [])] if run_kind == "chaos" else []
    unknown = [f["kind"] for f in faults if f["kind"] not in FAULTS]
    assert not unknown, f"unknown fault kinds {unknown}: pick from {FAULTS}"
    pl.seed_everything(0, verbose=False)
    data = PoisonedSamples(IndexedData(spec["n"]), spec["poisoned"]) if spec["poisoned"] else IndexedData(spec["n"])
    module = ChaosModel(data, spec["batch"] * 2 // world, spec, faults, rank)
    arm_save_faults(module)
    flips = [f["step"] for f in faults if f["kind"] == "nan" and f["rank"] == rank]
    if flips:
        BitFlip(module, "net.5", step=flips, rank=rank)
    replay = StepReplay(quarantine_file=out / f"{label}.quarantine.json")
    callbacks: list[pl.Callback] = [
        Record(out, label, replay),
        TrainingHealthMonitor(response="skip", warmup_steps=5, report=False),
        replay,
    ]
    kwargs: dict[str, Any] = {}
    if run_kind == "chaos":
        checkpoints = StableCheckpoint(
            dirpath=out / label / "ckpts", every_n_train_steps=spec["every"], async_save=spec.get("async_save", False)
        )
        callbacks.append(checkpoints)
        kwargs["plugins"] = [AtomicCheckpointIO()]
    trainer = quiet_trainer(
        devices=world,
        strategy="ddp",
        max_steps=spec["steps"],
        enable_checkpointing=run_kind == "chaos",
        default_root_dir=out,
        callbacks=callbacks,
        **kwargs,
    )
    trainer.fit(module, ckpt_path="last" if run_kind == "chaos" else None)
    if trainer.global_step == spec["steps"]:
        torch.save(final_state(trainer, module), out / f"{label}.{rank}.pt")
        (out / f"{label}.quarantine.{rank}.json").write_text(json.dumps(replay.quarantine.state_dict()))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def work(spec: dict[str, Any]) -> NoReturn:
    """One rank of a launch, to its end (exit status 1: an exception, its traceback in ``NAME.log``)."""
    try:
        run(spec)
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    exit_worker()


def serve() -> None:
    """For each JSON spec on stdin: fork its ``world`` ranks (torchrun's environment), print their pids, wait for
    them, print their exit statuses (a SIGKILLed one: -9)."""
    for line in sys.stdin:
        spec = json.loads(line)
        port, world = _free_port(), int(spec.get("world", 2))
        pids = []
        for rank in range(world):
            pid = os.fork()
            if pid == 0:
                env = {"RANK": rank, "LOCAL_RANK": rank, "GROUP_RANK": 0, "WORLD_SIZE": world}
                os.environ.update({k: str(v) for k, v in env.items()}, LOCAL_WORLD_SIZE=str(world))
                os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_RUN_ID="chaos")
                log = os.open(Path(spec["out"]) / f"{spec['name']}.log", os.O_WRONLY | os.O_APPEND | os.O_CREAT)
                devnull = os.open(os.devnull, os.O_RDONLY)
                os.dup2(devnull, 0)
                os.dup2(log, 1)
                os.dup2(log, 2)
                work(spec)
            pids.append(pid)
        report_exits(pids)


def worker(spec_file: str) -> NoReturn:
    """Under torchrun: this attempt's launch of the job in ``spec_file`` (its output appended to ``NAME.log``)."""
    job = json.loads(Path(spec_file).read_text())
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    spec = {**job, **job["attempts"][attempt], "launch": job["launch"] + attempt}
    log = os.open(Path(spec["out"]) / f"{spec['name']}.log", os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    os.dup2(log, 1)
    os.dup2(log, 2)
    work(spec)


if __name__ == "__main__":
    if sys.argv[1:2] == ["worker"]:
        worker(sys.argv[2])
    serve()
