"""Taking back the checkpoints a crash kept off the healthy list.

``StableCheckpoint`` publishes a checkpoint, then rewrites ``stable_checkpoints.json``: a process killed between
the two leaves a complete, healthy checkpoint that the list does not name, and ``ckpt_path="last"`` would resume
from the older one. So every fit has an identity (a random token), written

* into the list, when the fit starts writing it (:meth:`HealthyCheckpoints.claim`), and
* into each checkpoint ``StableCheckpoint`` saves (``checkpoint[RUN_KEY]``: the fit, the checkpoint's name, its
  global step and its kind in the ring).

At restart, a checkpoint in the directory that verifies, carries the identity the list was last claimed by, its own
name, and a step newer than every listed one, was published by the fit that crashed, in a healthy state (only
healthy states are saved): it goes back on the list. One carrying another identity (another run in the directory,
or a continuation a later fit abandoned by resuming from an older step) never does.

Then :func:`newest_verified` picks what a resume (``ckpt_path="last"``) or a rollback to disk takes: the newest
listed checkpoint that verifies.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, NamedTuple

import torch

from lightning_stability.checkpoint import atomic
from lightning_stability.checkpoint.atomic import CheckpointError
from lightning_stability.checkpoint.ring import FILE_NAME, RING, Entry, HealthyCheckpoints

#: the checkpoint's key for ``{"run", "name", "step", "kind"}`` of a ``StableCheckpoint`` save
RUN_KEY = "lightning_stability_checkpoint"
_META_FILE = "meta.pt"  # the rest of a sharded (DCP) Lightning checkpoint: StableFSDPStrategy's and Lightning's


def new_run_id() -> str:
    """A fresh identity for one fit (every rank must use rank 0's: it is written by rank 0 only)."""
    return secrets.token_hex(8)


def record(run: str, name: str, step: int, kind: str) -> dict[str, Any]:
    """What a ``StableCheckpoint`` save writes under :data:`RUN_KEY`."""
    return {"run": run, "name": name, "step": step, "kind": kind}


def _read_record(path: Path) -> dict[str, Any] | None:
    """The :data:`RUN_KEY` record of the checkpoint at ``path`` (its pickle only: tensors are memory-mapped)."""
    source, mmap = (path / _META_FILE, False) if path.is_dir() else (path, True)
    try:
        data = torch.load(source, map_location="cpu", weights_only=False, mmap=mmap)
    except Exception:  # not a torch checkpoint, or unreadable: not one to take back
        return None
    found = data.get(RUN_KEY) if isinstance(data, dict) else None
    return found if isinstance(found, dict) else None


def check_listed(path: Path, entry: Entry) -> None:
    """Check that the checkpoint at ``path`` is the one the healthy list names: a ``StableCheckpoint`` save records
    its name and step in itself, so a file or directory replaced whole by another one (of another step, or copied
    over it) is refused. Checkpoints without the record (another writer's) pass.

    Raises:
        CheckpointError: it records another name or step; the message names both.
    """
    info = _read_record(path)
    if info is None or (info.get("name") == entry.name and info.get("step") == entry.step):
        return
    raise CheckpointError(
        f"The checkpoint {path} is not the one listed: the healthy list names it {entry.name} of step {entry.step}, "
        f"it holds {info.get('name')} of step {info.get('step')} (replaced by a copy). Fix: restore it, or delete it."
    )


class Verified(NamedTuple):
    """A listed checkpoint that verifies."""

    path: Path  # where the list names it
    step: int  # the global step at the save
    read: Path  # the path to read: ``path``, or the previous checkpoint a crash left moved away


def newest_verified(
    candidates: Iterable[tuple[Path, int]], passed_over: Callable[[Path, int, Exception], None]
) -> Verified | None:
    """The checkpoint a resume or a rollback takes: the first of ``candidates`` (listed healthy checkpoints, newest
    first, as ``(path, global step at the save)``) that is complete, matches every checksum as written
    (:func:`~lightning_stability.checkpoint.atomic.verify_checkpoint`) and holds the name and step its list entry
    gives (:func:`check_listed`). Serves ``ckpt_path="last"`` (``StableCheckpoint``) and the rollback to disk
    (``TrainingHealthMonitor``). Each one passed over goes to ``passed_over(path, step, error)`` first: a
    ``CheckpointError``, or ``FileNotFoundError`` for one gone. ``None``: none verifies."""
    for path, step in candidates:
        try:
            read = _verified(path)
            check_listed(read, Entry(path.name, step, RING))  # only its name and step are read
        except (CheckpointError, FileNotFoundError) as err:
            passed_over(path, step, err)
            continue
        return Verified(path, step, read)
    return None


def _verified(path: Path) -> Path:
    """``verify_checkpoint(path)``, once more if the path moved meanwhile (rank 0 may be putting back a checkpoint
    a crash left moved away, while another rank looks)."""
    try:
        return atomic.verify_checkpoint(path)
    except FileNotFoundError:
        return atomic.verify_checkpoint(path)


def unlisted_newer(listed: HealthyCheckpoints) -> tuple[list[Entry], list[str]]:
    """The checkpoints the fit that last claimed ``listed`` published after its newest entry and a crash kept off
    it: whole (verified), carrying that fit's identity and their own name. Oldest first. Second: why each
    checkpoint written since the list that fails verification was not taken back (unless it records another fit).

    Only checkpoints changed since the list was last written are read (a publish always follows the list's
    previous write). Nothing when the list names no fit (written before identities, or never).
    """
    directory = listed.directory
    if listed.run is None or not listed.path.is_file():
        return [], []
    since = listed.path.stat().st_mtime_ns
    newest = max((e.step for e in listed.entries), default=-1)
    names = {e.name for e in listed.entries}  # listed: checked where ckpt_path="last" is resolved
    found, refused = [], []
    for path in directory.iterdir():
        if atomic.is_sibling(path.name) or path.name in names or path.name == FILE_NAME or path.suffix != ".ckpt":
            continue
        try:
            if path.stat().st_mtime_ns < since:
                continue
            atomic.verify_checkpoint(path)
        except OSError:
            continue
        except CheckpointError as err:
            info = _read_record(path)
            if info is None or info.get("run") == listed.run:
                refused.append(str(err))
            continue
        info = _read_record(path)
        if (
            info is not None
            and info.get("run") == listed.run
            and info.get("name") == path.name
            and isinstance(info.get("step"), int)
            and info["step"] > newest
        ):
            found.append(Entry(path.name, int(info["step"]), str(info.get("kind", "ring"))))
    return sorted(found, key=lambda e: e.step), sorted(refused)
