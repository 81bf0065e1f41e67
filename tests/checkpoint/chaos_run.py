"""One launch of a 2-process DDP run (gloo, CPU) under a schedule of faults, for tests/checkpoint/chaos.py.

Usage: ``chaos_run.py serve`` (a fork server, as soak_run.py's: for each JSON line on stdin, a launch spec, it forks
the two ranks, prints their pids as a JSON list, then their exit statuses).

The spec: ``{"out", "name", "kind", "steps", "n", "batch", "every", "poisoned", "faults"}``. ``kind`` is ``chaos``
(``StableCheckpoint(every_n_train_steps=every)`` into ``OUT/NAME/ckpts``, ``AtomicCheckpointIO``,
``trainer.fit(ckpt_path="last")``) or ``reference`` (no checkpoints, no faults). Both train the regression ``Model``
of tests/replay/test_replay.py (dropout) on ``n`` indexed samples, ``batch`` per rank, with
``TrainingHealthMonitor(response="skip")`` and ``StepReplay``; the samples ``poisoned`` are NaN
(``PoisonedSamples``). Each fault, ``{"kind", "rank", "step"}``, fires once in the launch, on its rank, at
``trainer.global_step == step``:

* ``sigterm``: SIGTERM to itself as the step starts (``StableCheckpoint`` saves and stops);
* ``kill_forward``: SIGKILL in ``training_step``;
* ``kill_before_update``: SIGKILL in ``on_before_optimizer_step``;
* ``kill_after_publish``: SIGKILL once the checkpoint of that step (or the first saved after it: a save waits for a
  healthy step) is published, before the healthy list names it;
* ``nan``: one exponent bit flipped in the last layer's output (``BitFlip``): a transient fault.

Writes, in ``OUT``: ``NAME.start.json`` (rank 0, each launch: the step it started at, the checkpoint path),
``NAME.steps.<rank>`` (each step trained, at its end: ``step crc32-of-its-sample-indices crc32-of-the-weights
quarantined``; a step trained again repeats), and at the end of the run ``NAME.<rank>.pt`` (soak_run.py's
``final_state``: weights, AdamW's state, the ledger's counts...) and ``NAME.quarantine.<rank>.json``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import traceback
import zlib
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

from lightning_stability import AtomicCheckpointIO, StableCheckpoint, TrainingHealthMonitor
from lightning_stability.checkpoint.ring import HealthyCheckpoints
from lightning_stability.replay import BitFlip, PoisonedSamples, StepReplay
from tests.checkpoint.soak_run import final_state
from tests.helpers import exit_worker, quiet_trainer
from tests.replay.test_replay import IndexedData, Model

FAULTS = ("sigterm", "kill_forward", "kill_before_update", "kill_after_publish", "nan")


class ChaosModel(Model):
    def __init__(self, data: Any, batch: int, faults: list[dict[str, Any]], rank: int) -> None:
        super().__init__(data, batch_size=batch)
        self.faults, self.rank = faults, rank

    def fault(self, kind: str) -> bool:
        """Whether a fault of ``kind`` is due now on this rank (it fires once)."""
        for fault in self.faults:
            if fault["kind"] == kind and fault["rank"] == self.rank and fault["step"] == self.trainer.global_step:
                self.faults.remove(fault)
                return True
        return False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.fault("kill_forward"):
            os.kill(os.getpid(), signal.SIGKILL)
        return super().training_step(batch, batch_idx)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=self.bs, shuffle=True)  # Lightning adds its DistributedSampler


class Record(pl.Callback):
    """The start of each launch, each step's samples and weights, and the SIGTERM and pre-update kill faults."""

    def __init__(self, out: Path, name: str, replay: StepReplay) -> None:
        self.out, self.name, self.replay = out, name, replay
        self.indices: list[int] = []

    def on_train_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        if trainer.is_global_zero:
            start = {"global_step": trainer.global_step, "ckpt_path": trainer.ckpt_path}
            (self.out / f"{self.name}.start.json").write_text(json.dumps(start))

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if pl_module.fault("sigterm"):
            os.kill(os.getpid(), signal.SIGTERM)
        self.indices = [int(i) for i in batch[2]]

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, optimizer: Any) -> None:
        if pl_module.fault("kill_before_update"):
            os.kill(os.getpid(), signal.SIGKILL)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, *args: Any) -> None:
        weights = b"".join(p.detach().numpy().tobytes() for p in pl_module.parameters())
        samples = zlib.crc32(json.dumps(self.indices).encode())
        line = f"{trainer.global_step} {samples} {zlib.crc32(weights)} {len(self.replay.quarantine.indices)}\n"
        with open(self.out / f"{self.name}.steps.{trainer.global_rank}", "a") as f:
            f.write(line)


def run(spec: dict[str, Any]) -> None:
    out, label, run_kind = Path(spec["out"]), spec["name"], spec["kind"]
    rank = int(os.environ["RANK"])
    faults = [dict(f) for f in spec.get("faults", [])] if run_kind == "chaos" else []
    unknown = [f["kind"] for f in faults if f["kind"] not in FAULTS]
    assert not unknown, f"unknown fault kinds {unknown}: pick from {FAULTS}"
    real_add = HealthyCheckpoints.add

    def add(self: HealthyCheckpoints, name: str, step: int, kind: str, write: bool) -> None:
        if any(f["kind"] == "kill_after_publish" and f["rank"] == rank and f["step"] <= step for f in faults):
            os.kill(os.getpid(), signal.SIGKILL)  # published (renamed into place), not yet listed
        real_add(self, name, step, kind, write)

    HealthyCheckpoints.add = add  # type: ignore[method-assign]
    pl.seed_everything(0, verbose=False)
    data = PoisonedSamples(IndexedData(spec["n"]), spec["poisoned"]) if spec["poisoned"] else IndexedData(spec["n"])
    module = ChaosModel(data, spec["batch"], faults, rank)
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
        callbacks.append(StableCheckpoint(dirpath=out / label / "ckpts", every_n_train_steps=spec["every"]))
        kwargs["plugins"] = [AtomicCheckpointIO()]
    trainer = quiet_trainer(
        devices=2,
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


def serve() -> None:
    """For each JSON spec on stdin: fork the two ranks (torchrun's environment), print their pids, wait for both,
    print their exit statuses (a SIGKILLed one: -9)."""
    for line in sys.stdin:
        spec = json.loads(line)
        port = _free_port()
        pids = []
        for rank in range(2):
            pid = os.fork()
            if pid == 0:
                env = {"RANK": rank, "LOCAL_RANK": rank, "GROUP_RANK": 0, "WORLD_SIZE": 2, "LOCAL_WORLD_SIZE": 2}
                os.environ.update({k: str(v) for k, v in env.items()})
                os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_RUN_ID="chaos")
                log = os.open(Path(spec["out"]) / f"{spec['name']}.log", os.O_WRONLY | os.O_APPEND | os.O_CREAT)
                devnull = os.open(os.devnull, os.O_RDONLY)
                os.dup2(devnull, 0)
                os.dup2(log, 1)
                os.dup2(log, 2)
                try:
                    run(spec)
                    if torch.distributed.is_initialized():
                        torch.distributed.barrier()
                except BaseException:
                    traceback.print_exc()
                    sys.stderr.flush()
                    os._exit(1)
                exit_worker()
            pids.append(pid)
        print(json.dumps(pids), flush=True)
        codes = []
        for pid in pids:
            _, status = os.waitpid(pid, 0)
            codes.append(os.waitstatus_to_exitcode(status))
        print(json.dumps(codes), flush=True)


if __name__ == "__main__":
    serve()
