"""The fp16 scaler's running totals: overflow steps and floor hits, and from them the overflow rate.

:class:`OverflowCounts` keeps ``[overflow steps, floor hits]`` after each of the last ``window`` updates, and
before the first of them, in a ring of ``window + 1`` rows on the device: the totals after update ``u`` are
in row ``u % (window + 1)``. :func:`~lightning_stability.scaling.update_scale_` writes each new row from the
previous one, so the totals are one row (no op to read them) and the rate over the last ``window`` updates is
the difference of two rows. float32 counts are exact up to 2**24.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


class OverflowCounts:
    """The ring of running totals (see the module docstring); host rows until :meth:`place`."""

    def __init__(self, window: int, rows: list[list[float]] | None = None) -> None:
        self.window = window
        self._host = rows if rows is not None else [[0.0, 0.0] for _ in range(window + 1)]
        self._ring: Tensor | None = None
        self._rows: tuple[Tensor, ...] = ()

    def place(self, device: torch.device) -> None:
        """Move the ring to ``device`` (from its host rows)."""
        self._ring = torch.tensor(self.host_rows(), dtype=torch.float32, device=device)
        self._rows = self._ring.unbind(0)  # a view per row, made once

    def row(self, updates: int) -> Tensor:
        """``[overflow steps, floor hits]`` after update number ``updates`` (one of the last ``window``)."""
        index = updates % (self.window + 1)
        if self._ring is None:
            return torch.tensor(self._host[index], dtype=torch.float32)
        return self._rows[index]

    def rate(self, updates: int) -> Tensor:
        """Share of the last ``min(updates, window)`` updates that overflowed (0-dim tensor)."""
        covered = min(updates, self.window)
        return (self.row(updates)[0] - self.row(updates - covered)[0]) / max(1, covered)

    def host_rows(self) -> list[list[float]]:
        """The rows as host values (a sync when on a device: checkpoints and pickling only)."""
        return self._ring.tolist() if self._ring is not None else [list(r) for r in self._host]

    @classmethod
    def from_state(cls, state_dict: dict[str, Any], window: int, updates: int) -> OverflowCounts:
        """The ring saved in a scaler's state dict, or rebuilt from the totals (and overflow flags) of an older one."""
        rows = window + 1
        counts = state_dict.get("overflow_counts")
        if counts is not None and len(counts) == rows:
            return cls(window, [[float(v) for v in row] for row in counts])
        overflows, floor_hits = float(state_dict.get("overflow_steps", 0)), float(state_dict.get("floor_hits", 0))
        ring = [[0.0, 0.0] for _ in range(rows)]
        # an earlier version kept one 0/1 flag per update, update u in slot u % window
        flags = state_dict.get("overflow_flags") or []
        covered = min(updates, window)
        for back in range(covered + 1):
            ring[(updates - back) % rows] = [overflows, floor_hits]
            if back < covered and len(flags) == window:
                overflows -= float(flags[(updates - 1 - back) % window] != 0)
        return cls(window, ring)

    def __getstate__(self) -> dict[str, Any]:
        return {"window": self.window, "_host": self.host_rows(), "_ring": None, "_rows": ()}
