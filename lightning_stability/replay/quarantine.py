"""The samples a run will not train on again: a manifest of the sample indices of the batches a replay found bad.

A :class:`Quarantine` is the same on every rank (each rank's bad samples are gathered before they are added). It
is saved in every checkpoint (``StepReplay``'s state), so a resumed run keeps it, and written by rank 0 as a JSON
file for people: ``lightning-stability quarantine FILE`` lists it (a manifest or a checkpoint). The training
loader's sampler leaves the quarantined indices out of every batch it yields from then on
(:class:`~lightning_stability.checkpoint.loader_state.ReplayableSampler`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lightning_stability.checkpoint import atomic
from lightning_stability.errors import check_path, config_error

#: the manifest's format
VERSION = 1
_FIX = "pass the quarantine.json that StepReplay wrote, or a checkpoint of its run"


class Quarantine:
    """The quarantined sample indices and why each is there.

    Attributes:
        indices: the quarantined dataset indices (the set the sampler leaves out; changed in place).
        entries: one record per quarantined batch: ``{"step", "epoch", "rank", "batch_idx", "indices", "cause"}``.
    """

    def __init__(self) -> None:
        self.indices: set[int] = set()
        self.entries: list[dict[str, Any]] = []

    def add(self, indices: list[int], **where: Any) -> int:
        """Quarantine ``indices``, recorded with ``where`` (step, epoch, rank, batch_idx, cause); returns how many
        were new."""
        new = [i for i in dict.fromkeys(int(i) for i in indices) if i not in self.indices]
        self.indices.update(new)
        self.entries.append({**where, "indices": sorted(int(i) for i in indices)})
        return len(new)

    def state_dict(self) -> dict[str, Any]:
        return {"version": VERSION, "entries": [dict(e) for e in self.entries]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.entries = [dict(e) for e in state.get("entries", [])]
        self.indices.clear()  # in place: the sampler holds this set
        for entry in self.entries:
            self.indices.update(int(i) for i in entry.get("indices", []))

    def write(self, path: Path) -> None:
        """Write the manifest to ``path`` as JSON, atomically and durably (``checkpoint/atomic.py``: a reader never
        sees half a file)."""
        body = json.dumps({**self.state_dict(), "indices": sorted(self.indices)}, indent=1) + "\n"
        atomic.save_file(path, lambda f: f.write(body.encode()))


def read_quarantine(path: str | Path) -> list[dict[str, Any]]:
    """The quarantine entries in ``path``: a JSON manifest written by ``StepReplay``, or a checkpoint of a run with
    ``StepReplay`` (its callback state). Raises ``StabilityConfigError`` naming the path when it is neither."""
    check_path("path", path, "'lightning_logs/quarantine.json'")
    path = Path(path)
    if not path.is_file():
        raise config_error(
            "path", str(path), "is no such file", "pass a quarantine manifest (quarantine.json) or a checkpoint"
        )
    if path.suffix == ".json":
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise config_error("path", str(path), f"is not a quarantine manifest ({err})", _FIX) from err
        if not isinstance(data, dict) or "entries" not in data:
            raise config_error("path", str(path), "is not a quarantine manifest (no 'entries')", _FIX)
        return [dict(e) for e in data["entries"]]
    import torch

    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:  # not a torch file: what torch raises depends on the bytes
        raise config_error("path", str(path), f"is neither a manifest nor a checkpoint ({err})", _FIX) from err
    states = checkpoint.get("callbacks", {}) if isinstance(checkpoint, dict) else {}
    for key, state in states.items():
        if str(key).startswith("StepReplay") and isinstance(state, dict):
            return [dict(e) for e in state.get("quarantine", {}).get("entries", [])]
    raise config_error("path", str(path), "holds no StepReplay state (not saved by a run with StepReplay)", _FIX)
