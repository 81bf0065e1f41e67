"""Every checkpoint in a directory, verified: what ``lightning-stability verify DIR`` prints.

A checkpoint is a ``*.ckpt`` or ``*.pt`` file, a sharded (``torch.distributed.checkpoint``) directory, or a name
on the directory's healthy list (``stable_checkpoints.json``, which ``StableCheckpoint`` writes: only states
saved healthy are listed). Each is checked with :func:`~lightning_stability.checkpoint.verify_checkpoint`
(completeness, then the checksums recorded when it was written) and, when listed, against its list entry.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_stability import _compat
from lightning_stability.checkpoint import atomic, recover
from lightning_stability.checkpoint.atomic import CheckpointError
from lightning_stability.checkpoint.ring import FILE_NAME, HealthyCheckpoints

VERIFIED, COMPLETE, FAILED = "verified", "complete", "FAILED"  # checksums match / none recorded / refused


@dataclass
class Found:
    """One checkpoint of a directory."""

    name: str
    step: int | None  # global step at the save (the list's, else the checkpoint's own), None if unreadable
    listed: bool  # on the healthy list: saved in a healthy state by StableCheckpoint
    status: str  # VERIFIED (checksums match), COMPLETE (no checksums recorded: whole, content unchecked), FAILED
    detail: str = ""  # why it FAILED


def survey(directory: Path) -> list[Found]:
    """Verify every checkpoint in ``directory``, oldest step first (unknown steps last, then by name)."""
    listed = HealthyCheckpoints(directory).load()
    entries = {e.name: e for e in listed.entries}
    names = {p.name for p in directory.iterdir() if _is_checkpoint(p)} | set(entries)
    found = []
    for name in names:
        path, entry = directory / name, entries.get(name)
        step = entry.step if entry is not None else None
        try:
            resolved, checked = atomic.verify(path)
            if entry is not None:
                recover.check_listed(resolved, entry)
            else:
                step = _step_of(resolved)
        except (CheckpointError, FileNotFoundError) as err:
            found.append(Found(name, step, entry is not None, FAILED, str(err)))
            continue
        found.append(Found(name, step, entry is not None, VERIFIED if checked else COMPLETE))
    return sorted(found, key=lambda f: (f.step is None, f.step or 0, f.name))


def _is_checkpoint(path: Path) -> bool:
    if atomic.is_sibling(path.name) or path.name == FILE_NAME:
        return False
    if path.is_dir():  # a sharded one, even with its .metadata lost
        return (path / _compat.DCP_METADATA_FILE).is_file() or any(path.glob("*.distcp"))
    return path.suffix in (".ckpt", ".pt")


def _step_of(path: Path) -> int | None:
    """The ``global_step`` a Lightning checkpoint records (its pickle only; tensors are memory-mapped)."""
    import torch

    source, mmap = (path / "meta.pt", False) if path.is_dir() else (path, True)
    try:
        data: Any = torch.load(source, map_location="cpu", weights_only=False, mmap=mmap)
    except Exception:
        return None
    step = data.get("global_step") if isinstance(data, dict) else None
    return step if isinstance(step, int) else None
