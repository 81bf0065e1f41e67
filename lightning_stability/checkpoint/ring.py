"""The record of the healthy checkpoints in one directory: ``stable_checkpoints.json``, rewritten atomically.

``StableCheckpoint`` lists there every checkpoint it published (each taken in a healthy state) with its step,
and takes each one off the list before it deletes it. So the list names only complete healthy checkpoints, and
a crash between a save and the list's update leaves a checkpoint unlisted, never a listed one missing. A resume
with ``ckpt_path="last"`` reads the list, not the file names: checkpoints of other writers in the directory
(a plain ``ModelCheckpoint``, Lightning's ``hpc_ckpt``) are never taken for healthy ones.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from lightning_stability.checkpoint import atomic

FILE_NAME = "stable_checkpoints.json"
RING, BEST, LAST = "ring", "best", "last"  # the newest `keep` / ModelCheckpoint's top-k by monitor / save_last


@dataclass
class Entry:
    name: str  # the checkpoint's file or directory name in the directory
    step: int  # trainer.global_step when it was saved
    kind: str  # RING, BEST or LAST


class HealthyCheckpoints:
    """The list of one directory's healthy checkpoints, oldest first (every rank holds it; rank 0 writes it)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.entries: list[Entry] = []
        self.run: str | None = None  # the fit that writes the list now (see checkpoint/recover.py)

    @property
    def path(self) -> Path:
        return self.directory / FILE_NAME

    def load(self) -> HealthyCheckpoints:
        """Read the list from disk (an empty list when there is none, or it cannot be read)."""
        try:
            data = json.loads(self.path.read_text())
            self.entries = [Entry(str(e["name"]), int(e["step"]), str(e["kind"])) for e in data["checkpoints"]]
            self.run = str(data["run"]) if data.get("run") else None
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            self.entries, self.run = [], None
        return self

    def claim(self, run: str, write: bool) -> None:
        """Record that the fit ``run`` writes the list from now on (its checkpoints carry the same id)."""
        if self.run != run:
            self.run = run
            if write:
                self._write()

    def add(self, name: str, step: int, kind: str, write: bool) -> None:
        """Record a published checkpoint (replacing an entry of the same name: ``last.ckpt`` is rewritten)."""
        self.entries = [e for e in self.entries if e.name != name] + [Entry(name, step, kind)]
        if write:
            self._write()

    def drop(self, name: str, write: bool) -> None:
        """Take a checkpoint off the list (before it is deleted)."""
        self.entries = [e for e in self.entries if e.name != name]
        if write:
            self._write()

    def forget_after(self, step: int, write: bool) -> list[Entry]:
        """Take the checkpoints saved after ``step`` off the list (in one write); returns them."""
        gone = [e for e in self.entries if e.step > step]
        if gone:
            self.entries = [e for e in self.entries if e.step <= step]
            if write:
                self._write()
        return gone

    def ring(self) -> list[str]:
        """The names of the ring's checkpoints, oldest first."""
        return [e.name for e in self.entries if e.kind == RING]

    def newest_first(self) -> list[Entry]:
        """Every entry, the highest step first (the later written first among equal steps)."""
        order = sorted(enumerate(self.entries), key=lambda pair: (pair[1].step, pair[0]), reverse=True)
        return [entry for _, entry in order]

    def _write(self) -> None:
        data = {"version": 1, "run": self.run, "checkpoints": [asdict(e) for e in self.entries]}
        text = json.dumps(data, indent=1).encode()
        atomic.save_file(self.path, lambda f: f.write(text))
