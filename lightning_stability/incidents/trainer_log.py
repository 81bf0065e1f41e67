"""The incident log's Lightning adapter: where a Trainer's log is, and one call to record a fault in it."""

from __future__ import annotations

import os
from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_stability import _compat
from lightning_stability.incidents import restarts
from lightning_stability.incidents.log import Incident, append, cut_short, logged, mark_fit, this_host


def log_directory(trainer: pl.Trainer) -> Path | None:
    """Where ``trainer``'s incident log goes: beside its checkpoints (the directory of its ``ModelCheckpoint``, a
    ``StableCheckpoint`` included), else in its ``default_root_dir``; ``None`` for a remote directory."""
    found = trainer.checkpoint_callback
    directory = (
        _compat.model_checkpoint_dir(found, trainer) if isinstance(found, ModelCheckpoint) else trainer.default_root_dir
    )
    return None if "://" in str(directory) else Path(os.path.abspath(directory))


def record(
    trainer: pl.Trainer,
    kind: str,
    action: str,
    lost: str = "",
    detail: str = "",
    step: int | None = None,
    unless_logged: bool = False,
) -> None:
    """Append one incident to ``trainer``'s log (see :mod:`~lightning_stability.incidents.log`). Call it on every
    rank, for a fault every rank handles alike (the callbacks decide alike): rank 0 writes it, naming in ``detail``
    the rank and host it concerns. ``unless_logged``: not when the log holds the same one (a fault from before the
    checkpoint a fit resumed, which the killed run may have recorded already; this reads rank 0's file). Host
    only: no device sync."""
    if not trainer.is_global_zero:
        return
    directory = log_directory(trainer)
    if directory is None:
        return
    attempt = restarts.attempt(os.environ)
    incident = Incident(
        kind=kind,
        step=trainer.global_step if step is None else int(step),
        action=action,
        lost=lost,
        detail=detail,
        rank=trainer.global_rank,
        host=this_host(),
        attempt=attempt.describe() if attempt is not None else "",
    )
    if not (unless_logged and logged(directory, incident)):
        append(directory, incident)


def fit_started(trainer: pl.Trainer) -> None:
    """At the start of a fit, rank 0: a ``restart`` incident when the previous fit in this log was cut short (killed,
    crashed: it never reached :func:`fit_ended`) or this is a restart by torchrun or SLURM, whether it resumes a
    checkpoint or starts from step 0 (none saved yet, or none verifies); then this fit is marked running."""
    directory = log_directory(trainer)
    if directory is None or not trainer.is_global_zero:
        return
    previous = cut_short(directory)
    attempt = restarts.attempt(os.environ)
    if previous is not None or (attempt is not None and attempt.is_restart):
        step = trainer.global_step
        why = "the previous run ended without finishing its fit (killed or crashed)" if previous else "restarted"
        if trainer.ckpt_path:
            action = f"resumed from {Path(trainer.ckpt_path).name} (step {step})"
            lost = f"the steps the previous run trained after step {step}, if any"
        else:
            action, lost = f"started from step {step}: no checkpoint resumed", "every step the previous run trained"
        detail = why + (f" ({attempt.describe()})" if attempt is not None else "")
        record(trainer, "restart", action, lost=lost, detail=detail)
    mark_fit(directory, running=True, step=trainer.global_step)


def fit_ended(trainer: pl.Trainer) -> None:
    """At the clean end of a fit (also a stop at a signal), rank 0: the fit is marked ended."""
    directory = log_directory(trainer)
    if directory is not None and trainer.is_global_zero:
        mark_fit(directory, running=False, step=trainer.global_step)
