"""Per-step series of the health monitor, kept on the device between logging steps and moved in their transfer.

Every optimizer step writes one row of device values (loss, gradient norm, clip threshold, spike flags, LR,
loss scale, outcome) into a small device buffer, indexed by a host counter: no sync. On a logging step the
filled rows ride the ledger's one batched transfer and are appended to host series, which the stability
report draws and checkpoints keep.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

#: the device columns of a row, in order
COLUMNS = ("loss", "grad_norm", "clip_threshold", "loss_spike", "grad_spike", "lr", "loss_scale", "outcome")
#: series filled on logging steps only (NaN elsewhere)
SPARSE = ("update_ratio", "memory_gb")


class HealthHistory:
    """Rows of the steps since the last logging step on the device; every earlier step as host series."""

    def __init__(self) -> None:
        self.series: dict[str, list[float]] = {"step": [], **{k: [] for k in COLUMNS + SPARSE}}
        self._buf: Tensor | None = None
        self._labels: list[int] = []
        self._host: list[dict[str, float]] = []  # per pending row: values known on the host (a float LR)

    def _buffer(self, device: torch.device) -> Tensor:
        if self._buf is None or self._buf.device != device or len(self._labels) >= self._buf.shape[0]:
            rows = 64 if self._buf is None else 2 * self._buf.shape[0]
            new = torch.full((rows, len(COLUMNS)), math.nan, dtype=torch.float32, device=device)
            if self._buf is not None and self._labels:
                new[: len(self._labels)] = self._buf[: len(self._labels)].to(device)
            self._buf = new
        return self._buf

    def add(self, label: int, parts: list[Tensor], host: dict[str, float], device: torch.device) -> int:
        """Write a row: ``parts`` fill every column but the outcome in order, in one kernel (or none: a row of
        NaN); returns its index for :meth:`set_outcome`."""
        buf = self._buffer(device)
        index = len(self._labels)
        row = buf[index]  # a host index: no sync
        if parts:
            torch.cat(parts, out=row[: len(COLUMNS) - 1])
        else:
            row.fill_(math.nan)
        self._labels.append(label)
        self._host.append(host)
        return index

    def set_outcome(self, index: int, outcome: Tensor | int) -> None:
        assert self._buf is not None
        cell = self._buf[index, COLUMNS.index("outcome")]
        if isinstance(outcome, Tensor):
            cell.copy_(outcome)
        else:
            cell.fill_(float(outcome))

    def pending(self) -> Tensor | None:
        """The rows since the last :meth:`take`, flattened (a view: queue it for the transfer)."""
        if self._buf is None or not self._labels:
            return None
        return self._buf[: len(self._labels)].reshape(-1)

    def take(self, flat: list[float], sparse: dict[str, float] | None = None) -> list[dict[str, float]]:
        """Append the transferred rows (``flat``) to the host series; ``sparse`` values go to the last row."""
        width = len(COLUMNS)
        rows = []
        for i, label in enumerate(self._labels):
            row = dict(zip(COLUMNS, flat[i * width : (i + 1) * width], strict=True))
            row.update(self._host[i])
            row["step"] = float(label)
            for key in SPARSE:
                row[key] = (sparse or {}).get(key, math.nan) if i == len(self._labels) - 1 else math.nan
            for key in self.series:
                self.series[key].append(row.get(key, math.nan))
            rows.append(row)
        self._labels, self._host = [], []
        return rows

    def pending_on_host(self) -> list[float]:
        """The pending rows, flattened, as host values (HOST SYNC: end of training only)."""
        flat = self.pending()
        return [] if flat is None else flat.cpu().tolist()

    def state_dict(self) -> dict[str, Any]:
        """The host series and the rows not yet moved to the host (a sync: checkpoints only). Nothing is taken
        from the pending rows: the next logging step still reads them, as in a run that was never saved."""
        return {
            "series": {k: torch.tensor(v, dtype=torch.float64) for k, v in self.series.items()},
            "pending": {
                "labels": list(self._labels),
                "host": [dict(h) for h in self._host],
                "rows": self.pending_on_host(),
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        series = state.get("series", {})
        for key in self.series:
            value = series.get(key)
            self.series[key] = value.tolist() if value is not None else [math.nan] * len(series.get("step", []))
        pending = state.get("pending", {})
        self._labels, self._host = list(pending.get("labels", [])), [dict(h) for h in pending.get("host", [])]
        rows = pending.get("rows", [])
        self._buf = None
        if self._labels:
            # moved to the device by the first `add` (``_buffer`` copies the rows it holds)
            buf = torch.full((max(64, 2 * len(self._labels)), len(COLUMNS)), math.nan, dtype=torch.float32)
            buf[: len(self._labels)] = torch.tensor(rows, dtype=torch.float32).reshape(len(self._labels), len(COLUMNS))
            self._buf = buf
