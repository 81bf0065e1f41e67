"""Save now where ``trainer.fit(model, ckpt_path="last")`` finds it: the one protocol of every save made outside a
checkpoint schedule (``PreemptionCheckpoint`` at a signal, ``StepReplay`` before it stops on a failing device).

A :data:`SaveNow` is called on every rank at a step boundary; it saves the state of that step, waits until the
checkpoint is published and returns its path, or ``None`` when it saved nothing (the caller may try again at a
later boundary). Who saves:

* a composing callback hands its units its own (``StableCheckpoint``: a healthy save onto its list);
* a checkpoint callback that has one as its ``save_now`` method (:class:`SavesNow`: ``StableCheckpoint``) serves
  any other callback, found by :func:`save_now`;
* otherwise :func:`save_last`: the ``last`` checkpoint of the Trainer's ``ModelCheckpoint``, which Lightning
  resolves ``"last"`` to.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Protocol, runtime_checkable

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_stability import _compat

#: every rank, at a step boundary: save this step's state where ``ckpt_path="last"`` finds it and wait until it is
#: published; the checkpoint's path, or ``None`` when nothing was saved
SaveNow = Callable[[pl.Trainer], "str | None"]


@runtime_checkable
class SavesNow(Protocol):
    """A checkpoint callback with a save of its own for callers outside its schedule (``StableCheckpoint``)."""

    def save_now(self, trainer: pl.Trainer) -> str | None: ...


def save_now(trainer: pl.Trainer) -> str | None:
    """The Trainer's save now: that of its first checkpoint callback with one (:class:`SavesNow`), else
    :func:`save_last`; every rank calls it. The checkpoint's path, or ``None`` when nothing was saved."""
    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, SavesNow):
            return callback.save_now(trainer)
    return save_last(trainer)


def save_last(trainer: pl.Trainer) -> str | None:
    """Every rank: this step's state as the ``last`` checkpoint of the Trainer's first ``ModelCheckpoint``
    (``None`` without one), recorded as that callback's own save of this step."""
    checkpoint = model_checkpoint(trainer)
    if checkpoint is None:
        return None
    path = last_path(checkpoint, trainer)
    # as ModelCheckpoint does before its own save of last (it is part of its state): after the resume it
    # writes its last.ckpt there again, not beside it as last-v1.ckpt
    checkpoint.last_model_path = path
    trainer.save_checkpoint(path)  # every rank: a collective; the strategy writes it
    # recorded as the ModelCheckpoint's own save: one that has not saved in this fit writes last.ckpt again
    # when the fit ends, after the epoch loop has moved on, and its restart would train the wrong samples
    _compat.record_model_checkpoint_save(checkpoint, trainer, path)
    return path


def model_checkpoint(trainer: pl.Trainer) -> ModelCheckpoint | None:
    """The Trainer's first ``ModelCheckpoint``, or ``None``."""
    return next((cb for cb in trainer.checkpoint_callbacks if isinstance(cb, ModelCheckpoint)), None)


def last_path(checkpoint: ModelCheckpoint, trainer: pl.Trainer) -> str:
    """Where ``checkpoint`` writes its ``last`` checkpoint now (its ``CHECKPOINT_NAME_LAST``, formatted)."""
    metrics = {
        **trainer.callback_metrics,
        "epoch": torch.tensor(trainer.current_epoch),
        "step": torch.tensor(trainer.global_step),
    }
    name = checkpoint.format_checkpoint_name(metrics, filename=checkpoint.CHECKPOINT_NAME_LAST)
    directory = _compat.model_checkpoint_dir(checkpoint, trainer)
    return name if os.path.dirname(name) else os.path.join(directory, name)
