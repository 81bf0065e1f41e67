"""Checkpoints that a crash cannot half-write, and loads that name what is missing.

* ``atomic.py``: pure file-system work: the hidden sibling, ``fsync``, publish by rename (a directory swapped in
  with ``renameat2(RENAME_EXCHANGE)``, or two renames and a record to recover from), removal, the clean-up of
  what a crash left, and the checks of a file or a sharded directory: complete, and its checksums as written
  (:class:`CheckpointError`).
* ``io.py``: :class:`AtomicCheckpointIO`, the ``CheckpointIO`` for single-device and DDP runs.
* ``callback.py``: :class:`StableCheckpoint`, a ``ModelCheckpoint`` that saves only healthy states, keeps the
  newest ``keep``, resolves ``ckpt_path="last"`` to the newest that verifies, and saves and stops on a signal.
* ``async_save.py``: ``StableCheckpoint(async_save=True)``: the state copied to host memory in the step, the write,
  ``fsync`` and publish in a background thread, one save in flight, listed once every rank agrees it succeeded.
* ``checksums.py``: a CRC-32 of every file of a checkpoint, taken as it is written and checked on load.
* ``survey.py``: every checkpoint of a directory, verified (``lightning-stability verify DIR``).
* ``ring.py``: ``stable_checkpoints.json``, the list of a directory's healthy checkpoints.
* ``recover.py``: each fit's identity; the checkpoints a crash kept off the list, taken back at restart; the newest
  listed one that verifies (``ckpt_path="last"``, a rollback to disk).
* ``exact_resume.py``: :class:`ExactResume`, the callback for exact mid-epoch resume, alone next to Lightning's
  ``ModelCheckpoint`` or inside ``StableCheckpoint``; ``loader_state.py`` and ``rng.py`` do the work: a plain
  ``DataLoader``'s sampler replayed and fast-forwarded, and every rank's RNG states, in each checkpoint.
* ``preemption_checkpoint.py``: :class:`PreemptionCheckpoint`, save and stop on a signal at one agreed step
  boundary, alone (as the ``ModelCheckpoint``'s ``last.ckpt``) or inside ``StableCheckpoint`` (its healthy save);
  ``preemption.py``: the signal handlers, and how every rank agrees on a signal at a step boundary.
* ``units.py``: a callback made of units (``StableCheckpoint``: a ``PreemptionCheckpoint``, an ``ExactResume``):
  each hook runs the owner's body, then each unit's; ``save_now.py``: the save-now protocol, one save where
  ``ckpt_path="last"`` finds it, that a composer hands its units and any callback finds on the Trainer.

``StableFSDPStrategy`` (``strategies/fsdp.py``) uses ``atomic`` for both of its layouts.
"""

from lightning_stability.checkpoint.atomic import CheckpointError, clean_directory, verify_checkpoint
from lightning_stability.checkpoint.callback import StableCheckpoint
from lightning_stability.checkpoint.exact_resume import ExactResume
from lightning_stability.checkpoint.io import AtomicCheckpointIO
from lightning_stability.checkpoint.preemption_checkpoint import PreemptionCheckpoint

__all__ = [
    "AtomicCheckpointIO",
    "CheckpointError",
    "ExactResume",
    "PreemptionCheckpoint",
    "StableCheckpoint",
    "clean_directory",
    "verify_checkpoint",
]
