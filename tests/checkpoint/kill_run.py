"""A training run that saves every step, made to be killed with SIGKILL (tests/checkpoint/test_kill.py).

Usage: ``python kill_run.py OUT_DIR plain:MAX_STEPS`` (one process, ``AtomicCheckpointIO``) or
``torchrun --nproc_per_node 2 kill_run.py OUT_DIR sharded:MAX_STEPS full:MAX_STEPS`` (``StableFSDPStrategy``,
each layout's run after the other in the same processes). ``broken:PATH`` resumes from a broken checkpoint
and records the ``CheckpointError`` each rank raised in ``OUT_DIR/broken.<rank>.json``.

Each run resumes with ``trainer.fit(ckpt_path="last")`` from ``OUT_DIR/<layout>/`` (where
``ModelCheckpoint(save_last=True, every_n_train_steps=1)`` saves ``last.ckpt`` and the top-1 checkpoint at every
step), and writes:

* ``OUT_DIR/pid.<rank>``: the process id, for the test to kill;
* ``OUT_DIR/<layout>.start.json`` (rank 0): the step it resumed at and the path Lightning resolved "last" to;
* ``OUT_DIR/<layout>.progress`` (rank 0): one line per step of this run whose checkpoints were saved;
* ``checkpoint["param_sum"]``: the float64 sum of every weight, so a checkpoint mixing two steps shows.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_stability.checkpoint import AtomicCheckpointIO, CheckpointError
from lightning_stability.strategies import StableFSDPStrategy
from tests.distributed.fsdp_common import TinyLM
from tests.helpers import QUIET, exit_worker


def param_sum(module: torch.nn.Module) -> float:
    """The sum of every weight in float64 (every rank must call under FSDP)."""
    local = torch.zeros((), dtype=torch.float64)
    for p in module.parameters():
        local += (p.to_local() if hasattr(p, "to_local") else p).detach().double().sum()
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(local)
    return float(local)


class Progress(pl.Callback):
    def __init__(self, out: Path, layout: str) -> None:
        self.out, self.layout = out, layout
        self.start = 0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.start = trainer.global_step
        if trainer.is_global_zero:
            start = {"global_step": trainer.global_step, "ckpt_path": trainer.ckpt_path}
            (self.out / f"{self.layout}.start.json").write_text(json.dumps(start))

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        # the checkpoints of the previous step are saved by now (ModelCheckpoint runs last in each batch end)
        if trainer.is_global_zero and trainer.global_step > self.start:
            with open(self.out / f"{self.layout}.progress", "a") as f:
                f.write(f"{trainer.global_step}\n")

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: Any) -> None:
        checkpoint["param_sum"] = param_sum(pl_module)


def run(out: Path, layout: str, max_steps: int) -> None:
    pl.seed_everything(0, verbose=False)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    # d=128: ~0.5M weights, ~6 MB per checkpoint with AdamW's state, so a random moment is likely inside a save
    module = TinyLM(d=128, batch_size=8 // world, n=800)
    kwargs: dict[str, Any] = {"plugins": [AtomicCheckpointIO()]}
    if layout != "plain":
        kwargs = {"strategy": StableFSDPStrategy(state_dict_type=layout), "devices": world}
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=max_steps,
        **QUIET,
        use_distributed_sampler=False,
        callbacks=[
            Progress(out, layout),
            ModelCheckpoint(dirpath=out / layout, save_last=True, every_n_train_steps=1),
        ],
        **kwargs,
    )
    trainer.fit(module, ckpt_path="last")


def load_broken(path: Path) -> str | None:
    """Resume from a broken checkpoint: the message of the CheckpointError every rank must raise."""
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=int(os.environ.get("WORLD_SIZE", "1")),
        strategy=StableFSDPStrategy(),
        max_steps=1,
        **QUIET,
        enable_checkpointing=False,
    )
    try:
        trainer.fit(TinyLM(d=128), ckpt_path=path)
    except CheckpointError as err:
        return str(err)
    return None


def main() -> None:
    out = Path(sys.argv[1])
    rank = os.environ.get("RANK", "0")
    (out / f"pid.{rank}").write_text(str(os.getpid()))
    errors: dict[str, str | None] = {}
    for layout, value in (arg.split(":", 1) for arg in sys.argv[2:]):
        if layout == "broken":
            errors[value] = load_broken(Path(value))
        else:
            run(out, layout, int(value))
    if errors:
        (out / f"broken.{rank}.json").write_text(json.dumps(errors))


if __name__ == "__main__":
    main()
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    exit_worker()
