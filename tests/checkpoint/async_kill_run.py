"""A run with ``StableCheckpoint(async_save=True)`` whose background write can be held open, to be killed with
SIGKILL in the middle of it (tests/checkpoint/test_async_kill.py).

Usage: ``python async_kill_run.py OUT_DIR LAYOUT MAX_STEPS RUN...`` (LAYOUT ``plain``: one process with
``AtomicCheckpointIO``), or under ``torchrun --nproc_per_node 2`` with LAYOUT ``ddp`` (``DDPStrategy`` +
``AtomicCheckpointIO``), ``sharded`` or ``full`` (``StableFSDPStrategy``'s two layouts). Each RUN, in turn, is ``soak``
(resume from ``OUT_DIR/LAYOUT/`` with ``ckpt_path="last"``, save every 2 steps) or ``reference`` (uninterrupted, no
checkpoints). One sequence batch per epoch (8 sequences, in order), so a resume sees the same data whatever step it
resumes at.

With ``LS_TEST_HOLD_WRITE_AT=N`` in the environment, the background write of the save at global step ``N`` writes
its hidden sibling, then touches ``OUT_DIR/held.<rank>`` and sleeps instead of publishing: the test kills the
processes there. With ``LS_TEST_FAIL_WRITE_AT=N``, rank 0's background write of that save raises ``OSError`` at
its end (before the publish); each rank then writes the ``CheckpointError`` it raised to
``OUT_DIR/error.<rank>.json``. Both are a test-only subclass of ``AsyncSaves``; the package's write path has no such
hook.

Writes ``OUT_DIR/pid.<rank>``, ``OUT_DIR/<LAYOUT>.start.json`` (rank 0: the step it resumed at) and, at the end,
``OUT_DIR/<LAYOUT>.<RUN>.<rank>.pt``: this rank's weights and AdamW state (local shards under FSDP).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy

from lightning_stability import AtomicCheckpointIO, CheckpointError, StableCheckpoint
from lightning_stability.checkpoint.async_save import AsyncSaves
from lightning_stability.strategies import StableFSDPStrategy
from tests.distributed.fsdp_common import TinyLM
from tests.helpers import QUIET, exit_worker

EVERY = 2


class HeldSaves(AsyncSaves):
    """Holds the background write of the save at step ``LS_TEST_HOLD_WRITE_AT`` open before its publish."""

    def __init__(self, out: Path) -> None:
        super().__init__()
        self.out = out
        self.hold_at = int(os.environ.get("LS_TEST_HOLD_WRITE_AT", "-1"))
        self.fail_at = int(os.environ.get("LS_TEST_FAIL_WRITE_AT", "-1"))
        self._step = -1

    def start(self, trainer: pl.Trainer, path: Path, kind: str) -> None:
        self._step = trainer.global_step
        super().start(trainer, path, kind)

    def submit(self, write: Callable[[], None], publish: Callable[[], None], partial: Path | None) -> Any:
        step = self._step

        def failing_write() -> None:
            write()
            if step == self.fail_at and os.environ.get("RANK", "0") == "0":  # e.g. the last file's fsync
                raise OSError(28, "No space left on device (test)")

        def held_publish() -> None:
            if step == self.hold_at:
                (self.out / f"held.{os.environ.get('RANK', '0')}").touch()
                time.sleep(600)
            publish()

        return super().submit(failing_write, held_publish, partial)


def local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if hasattr(t, "to_local") else t).detach().clone()


class Start(pl.Callback):
    def __init__(self, out: Path, layout: str) -> None:
        self.out, self.layout = out, layout

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            start = {"global_step": trainer.global_step, "ckpt_path": trainer.ckpt_path}
            (self.out / f"{self.layout}.start.json").write_text(json.dumps(start))


def run(out: Path, layout: str, max_steps: int, kind: str) -> None:
    pl.seed_everything(0, verbose=False)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    module = TinyLM(d=64, batch_size=8 // world, n=8)
    kwargs: dict[str, Any] = {"plugins": [AtomicCheckpointIO()]}
    if layout == "ddp":
        kwargs = {**kwargs, "strategy": DDPStrategy(), "devices": world}
    elif layout in ("sharded", "full"):
        kwargs = {"strategy": StableFSDPStrategy(state_dict_type=layout), "devices": world}
    callbacks: list[pl.Callback] = []
    if kind == "soak":
        checkpoint = StableCheckpoint(dirpath=out / layout, every_n_train_steps=EVERY, keep=2, async_save=True)
        checkpoint._async = HeldSaves(out)
        callbacks = [Start(out, layout), checkpoint]
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=max_steps,
        **QUIET,
        enable_checkpointing=kind == "soak",
        use_distributed_sampler=False,
        callbacks=callbacks,
        **kwargs,
    )
    try:
        trainer.fit(module, ckpt_path="last" if kind == "soak" else None)
    except CheckpointError as err:
        error = {"message": str(err), "global_step": trainer.global_step}
        (out / f"error.{os.environ.get('RANK', '0')}.json").write_text(json.dumps(error))
        return
    optimizer = trainer.optimizers[0]
    state = {
        "params": {name: local(p) for name, p in module.named_parameters()},
        "optimizer": {
            f"{name}.{key}": local(value) if isinstance(value, torch.Tensor) else torch.tensor(value)
            for name, p in module.named_parameters()
            for key, value in optimizer.state.get(p, {}).items()
        },
        "global_step": trainer.global_step,
    }
    torch.save(state, out / f"{layout}.{kind}.{os.environ.get('RANK', '0')}.pt")


if __name__ == "__main__":
    out_dir = Path(sys.argv[1])
    (out_dir / f"pid.{os.environ.get('RANK', '0')}").write_text(str(os.getpid()))
    for kind in sys.argv[4:]:
        run(out_dir, sys.argv[2], int(sys.argv[3]), kind)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    exit_worker()
