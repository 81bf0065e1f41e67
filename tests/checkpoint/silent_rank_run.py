"""A two-process run whose rank 1 is SIGKILLed while rank 0 alone writes (tests/checkpoint/test_silent_rank_kill.py).

Usage: ``torchrun --nproc_per_node 2 silent_rank_run.py OUT_DIR STRATEGY KIND...`` (each KIND in turn). STRATEGY ``ddp``
(``AtomicCheckpointIO``: rank 0 writes every checkpoint file, rank 1 none) or ``fsdp`` (``StableFSDPStrategy``,
sharded: every rank writes its shards, then rank 0 alone writes ``meta.pt``). KIND:

* ``reference``: ``resume_run.py``'s model and plain shuffled loader, 20 steps uninterrupted,
  ``StableCheckpoint(every_n_train_steps=1)`` into ``OUT_DIR/<STRATEGY>-reference/``;
* ``kill``: the same into ``OUT_DIR/<STRATEGY>-kill/``. At the save of global step :data:`KILL_AT`, rank 0 stops
  inside its write (its hidden file open, ``torch.save`` pickling the checkpoint, ``meta.pt`` under ``fsdp``) and
  writes ``OUT_DIR/writing``; rank 1 (a thread started at fit start) sees it and SIGKILLs itself with
  ``os.kill``; rank 0 goes on with its write once rank 1 is dead (``OUT_DIR/wrote``). What follows is
  Lightning's and torchrun's: the test measures it;
* ``resume``: a fresh run with ``ckpt_path="last"`` in ``OUT_DIR/<STRATEGY>-kill/``, to 20 steps.

A run that ends writes ``OUT_DIR/<STRATEGY>.<KIND>.<rank>.pt``: the data of each step, the parameters and AdamW's
state (this rank's shards under FSDP), as ``resume_run.py`` does.
"""

from __future__ import annotations

import collections
import os
import random
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch

from lightning_stability import AtomicCheckpointIO, StableCheckpoint
from lightning_stability.strategies import StableFSDPStrategy
from tests.checkpoint.resume_run import STEPS, DropoutLM, final_state
from tests.helpers import QUIET, finish_worker

KILL_AT = 11  # the global step of the save during which rank 1 is killed (mid-epoch: 8 steps an epoch)


def alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie, killed and not yet reaped by torchrun, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


class PauseInWrite:
    """Put in the checkpoint rank 0 writes: pickled inside ``torch.save``, it says so and waits for rank 1's
    death; it loads as an empty ``OrderedDict`` (which ``torch.load(weights_only=True)`` allows)."""

    def __init__(self, out: Path, victim: int) -> None:
        self.out, self.victim = out, victim

    def __reduce__(self) -> tuple[Any, ...]:
        (self.out / "writing").write_text(str(os.getpid()))
        deadline = time.monotonic() + 60
        while alive(self.victim) and time.monotonic() < deadline:
            time.sleep(0.005)
        (self.out / "wrote").write_text(f"rank 1 alive: {alive(self.victim)}")
        return (collections.OrderedDict, ())


class KillSilentRank(pl.Callback):
    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        (self.out / f"pid.{trainer.global_rank}").write_text(str(os.getpid()))
        if trainer.global_rank == 1:
            threading.Thread(target=self._die_when_rank_0_writes, daemon=True).start()

    def _die_when_rank_0_writes(self) -> None:
        while not (self.out / "writing").exists():
            time.sleep(0.002)
        os.kill(os.getpid(), signal.SIGKILL)

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: Any) -> None:
        if trainer.global_step == KILL_AT and trainer.global_rank == 0:
            checkpoint["silent_rank_pause"] = PauseInWrite(self.out, int((self.out / "pid.1").read_text()))


def run(out: Path, strategy: str, kind: str) -> None:
    pl.seed_everything(0, verbose=False)
    random.seed(0)
    np.random.seed(0)
    module = DropoutLM("shuffle")
    directory = out / f"{strategy}-{'reference' if kind == 'reference' else 'kill'}"
    callbacks: list[pl.Callback] = [StableCheckpoint(dirpath=directory, every_n_train_steps=1, keep=3)]
    if kind == "kill":
        callbacks.append(KillSilentRank(out))
    if strategy == "ddp":
        kwargs: dict[str, Any] = {"strategy": "ddp", "plugins": [AtomicCheckpointIO()]}
    else:
        kwargs = {"strategy": StableFSDPStrategy()}
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        max_steps=STEPS,
        callbacks=callbacks,
        **QUIET,
        **kwargs,
    )
    trainer.fit(module, ckpt_path="last" if kind == "resume" else None)
    torch.save(final_state(module, trainer), out / f"{strategy}.{kind}.{trainer.global_rank}.pt")


def main() -> None:
    out, strategy = Path(sys.argv[1]), sys.argv[2]
    for kind in sys.argv[3:]:
        run(out, strategy, kind)
    finish_worker(out)


if __name__ == "__main__":
    main()
