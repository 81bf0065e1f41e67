"""A 2-process run saving a healthy checkpoint at every step, made to be killed with SIGKILL and resumed with
``ckpt_path="last"`` (tests/checkpoint/test_soak.py, benchmarks/fault_tolerance.py).

Usage: ``torchrun --nproc_per_node 2 soak_run.py OUT_DIR CONFIG STEPS RUN...``, or ``soak_run.py serve`` (a fork
server, see :func:`serve`: what tests/checkpoint/soak.py runs), where CONFIG is

* ``ddp``: Lightning's ``DDPStrategy`` (gloo), fp32, ``AtomicCheckpointIO``, ``GradientNormMonitor(max_norm=1)``
  skipping a non-finite gradient (a NaN put into rank 1's gradient at ``FAULT_STEPS``);
* ``ddp_stream``: ``ddp`` reading the same data as a stream (an ``IterableDataset`` without ``state_dict``: the
  control, which ``StableCheckpoint`` says it cannot resume mid-epoch);
* ``fsdp_fp16``: ``StableFSDPStrategy(mixed_precision=True)`` (fp16 compute with a loss scaler on the CPU, as in
  tests/distributed/fsdp_fp16_run.py), sharded checkpoints, ``LossScaleTuner`` (an inf in rank 1's gradient shard
  at ``FAULT_STEPS``: overflow, skipped step, backoff; growth every 4 clean steps) and ``GradientNormMonitor``;

and each RUN one of ``soak`` (resume from ``OUT_DIR/CONFIG/ckpts`` with ``trainer.fit(ckpt_path="last")``, save
with ``StableCheckpoint(every_n_train_steps=1, async_save=True)``: each write in the background, the next save
waiting for it) and train to ``STEPS`` optimizer steps) or ``reference`` (the same run
uninterrupted, no checkpoints). Both schedule the LR with ``WarmupConstantCosineLR`` on the applied-update count.

Data: ``SEQS`` sequences, ``EPOCH_STEPS`` steps per epoch, in a plain ``DataLoader(shuffle=True)``: Lightning puts
in its shuffling ``DistributedSampler`` (a new order each epoch), and ``StableCheckpoint`` resumes it mid-epoch at
the batch after the checkpoint's (checkpoint/loader_state.py).

Writes:

* ``OUT_DIR/pid.<rank>``: the process id, for the killer;
* ``OUT_DIR/<CONFIG>.start.json`` (rank 0): the step a soak run resumed at and the checkpoint path Lightning used;
* ``OUT_DIR/<CONFIG>.progress`` (rank 0): one line per step of this launch that began after a saved step;
* ``OUT_DIR/<CONFIG>.<run>.data.<rank>``: ``step crc32-of-the-batch`` per step trained (a killed step repeats);
* ``OUT_DIR/<CONFIG>.<run>.<rank>.pt`` at the end: this rank's parameters and optimizer state (local shards under
  FSDP), LR, loss scale, the ledger's counts, the global step and epoch.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
import traceback
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from lightning_stability import (
    AtomicCheckpointIO,
    GradientNormMonitor,
    LossScaleTuner,
    StableCheckpoint,
    WarmupConstantCosineLR,
)
from lightning_stability.ledger.step_ledger import StepLedger
from lightning_stability.strategies import StableFSDPStrategy
from tests.distributed.fsdp_common import TinyLM, token_data
from tests.helpers import QUIET, exit_worker

SEQS = 64  # global batch 8: 8 steps per epoch, so the run crosses two epoch ends
EPOCH_STEPS = SEQS // 8
FAULT_STEPS = (5, 13)  # rank 1's gradient holds a non-finite value in the step that starts at these global steps
CONFIGS = ("ddp", "fsdp_fp16", "ddp_stream")


class Stream(IterableDataset):
    """The data in order, this rank's share, as a stream (the control: no index sampler, no ``state_dict``)."""

    def __init__(self, data: TensorDataset) -> None:
        self.data = data

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        return (self.data[i] for i in range(rank, len(self.data), world))


class SoakLM(TinyLM):
    def __init__(self, data_log: Path, stream: bool = False) -> None:
        # d=128: ~0.5M weights, ~6 MB per checkpoint with AdamW's state: a random moment is often inside a save
        super().__init__(d=128, batch_size=8 // int(os.environ["WORLD_SIZE"]), n=SEQS)
        self.data_log = data_log
        self.stream = stream

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        with open(self.data_log, "a") as f:
            f.write(f"{self.global_step} {zlib.crc32(batch[0].numpy().tobytes())}\n")
        return super().training_step(batch, batch_idx)

    def on_after_backward(self) -> None:
        if self.global_step in FAULT_STEPS and self.global_rank == 1:
            grad = self.model.head.weight.grad
            local = grad.to_local() if hasattr(grad, "to_local") else grad
            local.view(-1)[0] = float("nan") if self.trainer.precision == "32-true" else float("inf")

    def train_dataloader(self) -> DataLoader:
        if self.stream:
            return DataLoader(Stream(token_data(self.n)), self.batch_size)
        return DataLoader(token_data(self.n), self.batch_size, shuffle=True)


class Progress(pl.Callback):
    def __init__(self, out: Path, config: str) -> None:
        self.out, self.config = out, config
        self.start = 0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.start = trainer.global_step
        if trainer.is_global_zero:
            start = {"global_step": trainer.global_step, "ckpt_path": trainer.ckpt_path, "time": time.time()}
            (self.out / f"{self.config}.start.json").write_text(json.dumps(start))

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        # the checkpoint of the previous step is saved by now (StableCheckpoint runs last in each batch end)
        if trainer.is_global_zero and trainer.global_step > self.start:
            with open(self.out / f"{self.config}.progress", "a") as f:
                f.write(f"{trainer.global_step}\n")


def _local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if hasattr(t, "to_local") else t).detach().clone()


def final_state(trainer: pl.Trainer, module: pl.LightningModule) -> dict[str, Any]:
    optimizer = trainer.optimizers[0]
    opt: dict[str, torch.Tensor] = {}
    for name, p in module.named_parameters():
        for key, value in optimizer.state.get(p, {}).items():
            opt[f"{name}.{key}"] = _local(value) if isinstance(value, torch.Tensor) else torch.tensor(value)
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    record = StepLedger.of(trainer).record_of()
    return {
        "params": {name: _local(p) for name, p in module.named_parameters()},
        "optimizer": opt,
        "lr": optimizer.param_groups[0]["lr"],
        "scale": None if scaler is None else float(scaler.get_scale()),
        "scaler_state": None if scaler is None else scaler.state_dict(),
        "ledger": {"steps": record.steps, "counts": record.counts.tolist()},
        "global_step": trainer.global_step,
        "epoch": trainer.current_epoch,
    }


def run(out: Path, config: str, steps: int, kind: str) -> None:
    pl.seed_everything(0, verbose=False)
    rank = int(os.environ["RANK"])
    module = SoakLM(out / f"{config}.{kind}.data.{rank}", stream=config == "ddp_stream")
    callbacks: list[pl.Callback] = [
        GradientNormMonitor(max_norm=1.0),
        WarmupConstantCosineLR(warmup=0.2, decay=0.5, min_lr_ratio=0.1, total_steps=steps),
    ]
    kwargs: dict[str, Any]
    if config.startswith("ddp"):
        kwargs = {"strategy": DDPStrategy(), "plugins": [AtomicCheckpointIO()]}
    else:
        kwargs = {"strategy": StableFSDPStrategy(mixed_precision=True)}
        callbacks.append(LossScaleTuner(init_scale=2.0**10, growth_interval=4, hysteresis=1, fit_start_checks=False))
    if kind == "soak":
        callbacks.insert(0, Progress(out, config))
        checkpoint = StableCheckpoint(dirpath=out / config / "ckpts", every_n_train_steps=1, keep=2, async_save=True)
        callbacks.append(checkpoint)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        max_steps=steps,
        **QUIET,
        enable_checkpointing=kind == "soak",
        log_every_n_steps=5,
        callbacks=callbacks,
        **kwargs,
    )
    trainer.fit(module, ckpt_path="last" if kind == "soak" else None)
    torch.save(final_state(trainer, module), out / f"{config}.{kind}.{rank}.pt")


def work(out: Path, config: str, steps: int, runs: list[str]) -> None:
    assert config in CONFIGS, config
    (out / f"pid.{os.environ['RANK']}").write_text(str(os.getpid()))
    for kind in runs:
        run(out, config, steps, kind)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve() -> None:
    """The fork server: for each line ``OUT_DIR CONFIG STEPS RUN...`` on stdin, fork the two ranks (with the
    environment torchrun gives its workers), print their pids as a JSON list, wait for both, print their exit
    statuses (a SIGKILLed one: -9). Importing torch and Lightning once here, not at every restart, saves ~15 s
    per launch on a 2-core machine."""
    import torch.distributed.checkpoint
    import torch.distributed.fsdp  # noqa: F401 (imported once, before forking)

    for line in sys.stdin:
        out, config, steps, *runs = line.split()
        port = _free_port()
        pids = []
        for rank in range(2):
            pid = os.fork()
            if pid == 0:  # the worker
                env = {"RANK": rank, "LOCAL_RANK": rank, "GROUP_RANK": 0, "WORLD_SIZE": 2, "LOCAL_WORLD_SIZE": 2}
                os.environ.update({k: str(v) for k, v in env.items()})
                os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_RUN_ID="soak")
                log = os.open(Path(out) / f"{config}.log", os.O_WRONLY | os.O_APPEND | os.O_CREAT)
                devnull = os.open(os.devnull, os.O_RDONLY)
                os.dup2(devnull, 0)
                os.dup2(log, 1)
                os.dup2(log, 2)
                try:
                    work(Path(out), config, int(steps), runs)
                except BaseException:
                    traceback.print_exc()
                    sys.stderr.flush()
                    os._exit(1)
                exit_worker()
            pids.append(pid)
        report_exits(pids)


def report_exits(pids: list[int]) -> None:
    """For the fork server's driver: the launch's pids, then, once they ended, their exit statuses (a JSON line
    each on stdout)."""
    print(json.dumps(pids), flush=True)
    codes = []
    for pid in pids:
        _, status = os.waitpid(pid, 0)
        codes.append(os.waitstatus_to_exitcode(status))
    print(json.dumps(codes), flush=True)


if __name__ == "__main__":
    if sys.argv[1:] == ["serve"]:
        serve()
    else:  # under torchrun: soak_run.py OUT_DIR CONFIG STEPS RUN...
        work(Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4:])
        exit_worker()
