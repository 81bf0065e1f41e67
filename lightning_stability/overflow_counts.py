"""The fp16 scaler's running totals: overflow steps and floor hits, and from them the overflow rate.

:class:`OverflowCounts` keeps ``[overflow steps, floor hits]`` after each of the last ``window`` updates, and
before the first of them, in a ring of ``window + 1`` rows: the totals after update ``u`` are in row
``u % (window + 1)``, so the rate over the last ``window`` updates is the difference of two rows. The ring
lives on the host while the scaler decides on the host (:attr:`OverflowCounts.on_host`), and on the device
after :meth:`~OverflowCounts.to_device`, where :func:`~lightning_stability.scaling.update_scale_` writes each
new row from the previous one (no op to read the totals). float32 counts are exact up to 2**24.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


class OverflowCounts:
    """The ring of running totals (see the module docstring)."""

    def __init__(self, window: int, rows: list[list[float]] | None = None) -> None:
        self.window = window
        self._host = rows if rows is not None else [[0.0, 0.0] for _ in range(window + 1)]
        self.on_host = True  # the host rows are the truth; the device ring is stale until `to_device`
        self._ring: Tensor | None = None
        self._rows: tuple[Tensor, ...] = ()

    def place(self, device: torch.device) -> None:
        """Allocate the device ring on ``device`` (filled from the host rows)."""
        self._ring = torch.tensor(self._host, dtype=torch.float32, device=device)
        self._rows = self._ring.unbind(0)  # a view per row, made once

    def to_device(self) -> None:
        """Make the device ring the truth from now on (the host rows are copied there without a sync)."""
        if not self.on_host:
            return
        self.on_host = False
        if self._ring is None:
            return
        rows = torch.tensor(self._host, dtype=torch.float32)
        if self._ring.device.type == "cuda":
            rows = rows.pin_memory()  # a pinned source: the copy does not wait for the device
        self._ring.copy_(rows, non_blocking=True)

    def to_host(self, flat: list[float]) -> None:
        """Make the host rows the truth again, from the device ring's values (``flat``, row after row)."""
        self._host = [[flat[2 * i], flat[2 * i + 1]] for i in range(self.window + 1)]
        self.on_host = True

    def ring(self) -> Tensor:
        """The device ring (placed)."""
        assert self._ring is not None
        return self._ring

    def row(self, updates: int) -> Tensor:
        """``[overflow steps, floor hits]`` after update number ``updates`` (one of the last ``window``)."""
        index = updates % (self.window + 1)
        if self.on_host or self._ring is None:
            return torch.tensor(self._host[index], dtype=torch.float32)
        return self._rows[index]

    def host_row(self, updates: int) -> list[float]:
        """:meth:`row` as host numbers (on the host only)."""
        return self._host[updates % (self.window + 1)]

    def advance_host(self, updates: int, overflow: bool, floor_hit: bool) -> None:
        """Write the row after update ``updates + 1`` from the one before it (on the host)."""
        overflows, floor_hits = self._host[updates % (self.window + 1)]
        self._host[(updates + 1) % (self.window + 1)] = [overflows + overflow, floor_hits + floor_hit]

    def rate(self, updates: int) -> Tensor | float:
        """Share of the last ``min(updates, window)`` updates that overflowed (a float on the host, else a
        0-dim tensor)."""
        covered = min(updates, self.window)
        if self.on_host:
            return (self.host_row(updates)[0] - self.host_row(updates - covered)[0]) / max(1, covered)
        return (self.row(updates)[0] - self.row(updates - covered)[0]) / max(1, covered)

    def host_rows(self) -> list[list[float]]:
        """The rows as host values (a sync when on a device: checkpoints and pickling only)."""
        if self.on_host or self._ring is None:
            return [list(r) for r in self._host]
        return self._ring.tolist()

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
        return {"window": self.window, "_host": self.host_rows(), "on_host": True, "_ring": None, "_rows": ()}
