"""Runs for tests/checkpoint/test_loader_resume.py: an uninterrupted run, and the same run interrupted mid-epoch
(stopped, SIGKILLed or signalled) and resumed with ``trainer.fit(ckpt_path="last")``, with a plain ``DataLoader``.

Usage: ``resume_run.py OUT_DIR STRATEGY LOADER RUN...`` (one process, or under torchrun), STRATEGY ``single``,
``ddp``, ``fsdp`` (``StableFSDPStrategy``) or ``preset`` (``StableTrainer.from_preset("gpt")``, one process, its own
``StableCheckpoint``), LOADER one of :data:`LOADERS`, and each RUN one of

* ``reference``: 20 optimizer steps, uninterrupted, ``StableCheckpoint(every_n_train_steps=1)`` saving into
  ``OUT_DIR/<STRATEGY>-<LOADER>-<RUN>/`` (as every run does);
* ``stop``: the same, stopped (``trainer.should_stop``) at step ``STOP_AT`` (mid-epoch: 8 batches per epoch);
* ``kill``: the same, SIGKILLed by itself when step ``STOP_AT + 1`` starts (its step-``STOP_AT`` checkpoint saved);
* ``sigterm`` / ``sigusr1``: the same, rank 1 (or the only rank) sends itself the signal when step ``STOP_AT``
  starts: ``StableCheckpoint`` saves at an agreed boundary and stops;
* ``resume-<how>``: resume the run interrupted by ``<how>`` with ``ckpt_path="last"`` and train to 20 steps;
* ``resume-restart``: under ``torchrun --max-restarts=1``, one script for the first attempt and the restart: always
  ``ckpt_path="last"`` (nothing there at first: a fresh start); rank 1 SIGKILLs itself when step ``STOP_AT + 1``
  starts in the first attempt (``TORCHELASTIC_RESTART_COUNT=0``), torchrun restarts the group, which resumes.

``RESUME_STOP_AT=<step>`` moves the interruption; ``RESUME_RELOAD=1`` makes Lightning build the loader anew each
epoch; ``RESUME_ACCUMULATE=<n>`` accumulates ``n`` batches per step; ``RESUME_BATCH``
sets the global batch size; ``RESUME_CALLBACK=lightning`` saves with
Lightning's ``ModelCheckpoint(save_last=True)`` instead (the control), ``RESUME_CALLBACK=exact`` with it and
``ExactResume`` (``RESUME_CKPT=<file name>`` resumes from that file of the run's directory, not "last"),
``RESUME_CALLBACK=preempt`` with ``ModelCheckpoint(every_n_train_steps=5, save_last=True)``, ``ExactResume`` and
``PreemptionCheckpoint`` (which alone saves at a signal).

The model has dropout and draws from torch's, NumPy's and Python's generators in each step, so a resume that does
not restore them trains differently. Every run writes ``OUT_DIR/<STRATEGY>-<LOADER>.<RUN>.<rank>.pt``: the data of
each step trained (``{step: sample indices}``), the parameters and AdamW's state (this rank's shards under FSDP),
and the messages the callback logged.
"""

from __future__ import annotations

import os
import random
import signal
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.nn import functional as F
from torch.utils.data import BatchSampler, DataLoader, Dataset, IterableDataset, Sampler

from lightning_stability import ExactResume, PreemptionCheckpoint, StableCheckpoint, StableTrainer
from lightning_stability.strategies import StableFSDPStrategy
from tests.distributed.fsdp_common import VOCAB, TinyLM, token_data
from tests.helpers import QUIET, finish_worker

N, BATCH, STEPS = 64, 8, 20  # 8 batches per epoch (global)
STOP_AT = int(os.environ.get("RESUME_STOP_AT", "11"))  # mid-epoch in the second epoch unless told
LOADERS = ("shuffle", "shuffle_generator", "sequential", "batch_sampler", "workers", "workers_augment", "iterable")


class Indexed(Dataset):
    """token_data with each sample's index, so each step's data is known exactly; with ``augment``, a random
    number drawn in ``__getitem__`` (in a loader's worker process: the worker's generator) that scales the loss."""

    def __init__(self, augment: bool = False) -> None:
        self.data = token_data(N)
        self.augment = augment

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor]:
        x, y = self.data[i]
        return x, y, i, torch.rand(()) if self.augment else torch.zeros(())


class Stream(IterableDataset):
    def __iter__(self):  # type: ignore[no-untyped-def]
        data = Indexed()
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        return (data[i] for i in range(rank, N, world))


class EpochBatches(Sampler[list[int]]):
    """A user's own batch sampler: deterministic, a new order each epoch (set_epoch), this rank's share."""

    def __init__(self, batch_size: int) -> None:
        self.batch_size, self.epoch = batch_size, 0
        self.rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        self.world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return N // (self.batch_size * self.world)

    def __iter__(self):  # type: ignore[no-untyped-def]
        order = torch.randperm(N, generator=torch.Generator().manual_seed(100 + self.epoch)).tolist()
        mine = order[self.rank :: self.world]
        return iter(BatchSampler(mine, self.batch_size, drop_last=True))


class DropoutLM(TinyLM):
    def __init__(self, loader: str) -> None:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        super().__init__(d=16, batch_size=int(os.environ.get("RESUME_BATCH", BATCH)) // world, n=N)
        self.loader = loader
        self.seen: dict[int, list[int]] = {}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, index, augment = batch
        self.seen[self.global_step] = index.tolist()
        logits = F.dropout(self(x), p=0.3, training=True)  # torch's generator
        loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), y.reshape(-1))
        loss = loss * (1.0 + 0.1 * augment.mean())
        return loss * (1.0 + 0.1 * random.random() + 0.1 * float(np.random.rand()))  # Python's and NumPy's

    def train_dataloader(self) -> DataLoader:
        data = Indexed()
        if self.loader == "shuffle":
            return DataLoader(data, batch_size=self.batch_size, shuffle=True)
        if self.loader == "shuffle_generator":
            return DataLoader(data, self.batch_size, shuffle=True, generator=torch.Generator().manual_seed(7))
        if self.loader == "sequential":
            return DataLoader(data, batch_size=self.batch_size)
        if self.loader == "batch_sampler":
            return DataLoader(data, batch_sampler=EpochBatches(self.batch_size))
        if self.loader == "workers":
            return DataLoader(data, batch_size=self.batch_size, shuffle=True, num_workers=2)
        if self.loader == "workers_augment":
            return DataLoader(Indexed(augment=True), batch_size=self.batch_size, shuffle=True, num_workers=2)
        return DataLoader(Stream(), batch_size=self.batch_size)


class Interrupt(pl.Callback):
    def __init__(self, how: str) -> None:
        self.how = how

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Other random draws on each rank (Lightning seeded them alike), so that a rank given another's RNG states
        at a resume trains differently; before the resume's restore, which runs later in this hook."""
        if trainer.world_size > 1:
            torch.manual_seed(1000 + trainer.global_rank)
            random.seed(1000 + trainer.global_rank)
            np.random.seed(1000 + trainer.global_rank)

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        step = trainer.global_step
        if self.how == "kill" and step == STOP_AT + 1:
            os.kill(os.getpid(), signal.SIGKILL)
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0"
        if self.how == "resume-restart" and first_attempt and step == STOP_AT + 1 and trainer.global_rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        if self.how in ("sigterm", "sigusr1") and step == STOP_AT and trainer.global_rank == trainer.world_size - 1:
            os.kill(os.getpid(), signal.SIGTERM if self.how == "sigterm" else signal.SIGUSR1)

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if self.how == "stop" and trainer.global_step == STOP_AT:
            trainer.should_stop = True


def _local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if hasattr(t, "to_local") else t).detach().clone()


def final_state(module: Any, trainer: pl.Trainer, tensor: Any = _local) -> dict[str, Any]:
    """What the tests compare at the end of a run: the samples seen, the weights and optimizer state (each tensor
    through ``tensor``: this rank's shard by default), the step."""
    optimizer = trainer.optimizers[0]
    return {
        "seen": module.seen,
        "params": {n: tensor(p) for n, p in module.named_parameters()},
        "optimizer": {
            f"{n}.{k}": tensor(v) if isinstance(v, torch.Tensor) else torch.tensor(v)
            for n, p in module.named_parameters()
            for k, v in optimizer.state.get(p, {}).items()
        },
        "global_step": trainer.global_step,
    }


def run(out: Path, strategy: str, loader: str, kind: str) -> None:
    pl.seed_everything(0, verbose=False)
    random.seed(0)
    np.random.seed(0)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    module = DropoutLM(loader)
    directory = out / f"{strategy}-{loader}-{kind.removeprefix('resume-')}"
    saver: pl.Callback = StableCheckpoint(dirpath=directory, every_n_train_steps=1, keep=2)
    chosen = os.environ.get("RESUME_CALLBACK")
    if chosen in ("lightning", "exact"):  # Lightning's own (the control), and with ExactResume
        saver = ModelCheckpoint(dirpath=directory, every_n_train_steps=1, save_last=True)
    callbacks = [Interrupt(kind), saver, *([ExactResume()] if chosen == "exact" else [])]
    if chosen == "preempt":  # the signal's save is PreemptionCheckpoint's alone: ModelCheckpoint saves every 5 steps
        saver = ModelCheckpoint(dirpath=directory, every_n_train_steps=5, save_last=True)
        callbacks = [Interrupt(kind), saver, ExactResume(), PreemptionCheckpoint()]
    ckpt_path: str | None = "last" if kind.startswith("resume") else None
    if ckpt_path and os.environ.get("RESUME_CKPT"):
        ckpt_path = str(directory / os.environ["RESUME_CKPT"])
    kwargs: dict[str, Any] = {"devices": world}
    if strategy == "preset":  # StableTrainer.from_preset attaches its own StableCheckpoint in <root>/checkpoints
        trainer: pl.Trainer = StableTrainer.from_preset(
            "gpt",
            accelerator="cpu",
            max_steps=STEPS,
            **QUIET,
            default_root_dir=directory,
            callbacks=[Interrupt(kind)],
        )
    elif strategy == "fsdp":
        kwargs["strategy"] = StableFSDPStrategy()
    elif strategy == "ddp":
        kwargs["strategy"] = "ddp"
    if strategy != "preset":
        trainer = pl.Trainer(
            accelerator="cpu",
            reload_dataloaders_every_n_epochs=int(os.environ.get("RESUME_RELOAD", "0")),
            accumulate_grad_batches=int(os.environ.get("RESUME_ACCUMULATE", "1")),
            max_steps=STEPS,
            **QUIET,
            callbacks=callbacks,
            **kwargs,
        )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, ckpt_path=ckpt_path)
    rank = trainer.global_rank
    torch.save(
        {
            **final_state(module, trainer),
            "warnings": [
                str(w.message)
                for w in caught
                if any(n in str(w.message) for n in ("StableCheckpoint", "ExactResume", "PreemptionCheckpoint"))
            ],
            "lightning_warnings": [str(w.message) for w in caught],
            "restart_count": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "-1")),
        },
        out / f"{strategy}-{loader}.{kind}.{rank}.pt",
    )


def main() -> None:
    out, strategy, loader = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    for kind in sys.argv[4:]:
        run(out, strategy, loader, kind)
    finish_worker(out)


if __name__ == "__main__":
    main()
