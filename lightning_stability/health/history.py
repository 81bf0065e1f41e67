"""The health monitor's per-step series, and what it records and tells the user from them.

Every optimizer step writes one row of device values (loss, gradient norm, clip threshold, spike flags, LR,
loss scale, outcome) into a small device buffer (:class:`HealthHistory`), indexed by a host counter: no sync. On
a logging step the filled rows and the logging-step metrics (update size, memory) ride the ledger's one batched
transfer to the host. There :class:`HealthReporter` appends them to the host series (which checkpoints keep), names
the spikes in a warning, warns once when the peak memory nears the device's capacity, and at the end of ``fit``
writes the stability report (JSON + PNG).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor

from lightning_stability.health.signals import UpdateSize, memory_warning
from lightning_stability.health.spike_stats import NEW_LEVEL_AFTER
from lightning_stability.ledger.callback import LedgerCallback
from lightning_stability.ledger.metrics import FlushValues

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
        """Write a row: ``parts`` fill every column but the outcome in order (no ``parts``: a row of NaN); returns
        its index for :meth:`set_outcome`."""
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


_ACTIONS = {
    "warn": "no action (response='warn')",
    "clip": "gradients clipped to ZClip's adaptive threshold (loss spikes: no action)",
    "skip": "those updates were skipped",
    "rollback": "those updates were skipped (a spike that outlasts its skipped update rolls back)",
}


#: rows without a new-level value after which the next one starts a new level (and gets its own event)
CALM_STEPS = 10


class HealthReporter:
    """The history of every step, the events (spikes, rollbacks), the warnings and the report.

    Args:
        response: the monitor's response to a spike (named in the warnings).
        spike_z: its spike threshold (named in the warnings).
        memory_warn_fraction: warn when the peak memory passes this share of the capacity.
        top_modules: per-module update ratios logged on logging steps (the largest ones).
    """

    def __init__(self, response: str, spike_z: float, memory_warn_fraction: float, top_modules: int) -> None:
        self.response, self.spike_z = response, spike_z
        self.memory_warn_fraction, self.top_modules = memory_warn_fraction, top_modules
        self.history = HealthHistory()
        self.events: list[dict[str, Any]] = []
        self.names: list[str] = []  # module names, for the per-module update ratios
        self.capacity: float | None = None
        self._memory_warned = False

    # ------------------------------------------------------------------ logging steps (device side: send)
    def log_update_size(self, monitor: LedgerCallback, size: UpdateSize) -> None:
        """Log the update-to-weight ratio (total and the ``top_modules`` largest), right after the update."""
        total, per_module = size.finish()
        monitor.record_metric("stability/update_ratio", total)
        k = min(self.top_modules, per_module.numel())
        if k:
            top = torch.topk(torch.nan_to_num(per_module, nan=math.inf), k)
            monitor.to_host("top_values", per_module[top.indices])
            monitor.to_host("top_indices", top.indices)

    def send_rows(self, monitor: LedgerCallback) -> None:
        """The rows since the last logging step ride the step's one transfer."""
        rows = self.history.pending()
        if rows is not None:
            monitor.to_host("rows", rows)

    # ------------------------------------------------------------------ logging steps (host side: read)
    def read(self, values: FlushValues) -> dict[str, float]:
        """Take a transfer's rows and metrics; returns the extra metrics to log (per-module update ratios, the
        skip rate)."""
        extra: dict[str, float] = {}
        top_i, top_v = values.get("top_indices"), values.get("top_values")
        if isinstance(top_i, list) and isinstance(top_v, list):
            for i, v in zip(top_i, top_v, strict=True):
                extra[f"stability/update_ratio/{self.names[int(i)]}"] = v
        sparse = {
            key: value
            for key, name in (("update_ratio", "stability/update_ratio"), ("memory_gb", "stability/memory_peak_gb"))
            if isinstance(value := values.get(name), float)
        }
        rows = values.get("rows")
        extra.update(self.take_rows(rows if isinstance(rows, list) else [], sparse))
        self.check_memory(sparse.get("memory_gb"))
        return extra

    def take_rows(self, rows: list[float], sparse: dict[str, float]) -> dict[str, float]:
        """Append the transferred rows to the history and warn about their spikes; returns the skip rate."""
        taken = self.history.take(rows, sparse)
        self._note_new_levels(taken)
        spikes = [int(row["step"]) for row in taken if row["loss_spike"] == 1 or row["grad_spike"] == 1]
        if spikes:
            action = _ACTIONS[self.response]
            self.events.extend({"step": step, "kind": "spike", "detail": action} for step in spikes)
            rank_zero_warn(
                f"TrainingHealthMonitor: a loss or gradient-norm spike (more than {self.spike_z:g} standard "
                f"deviations above its running mean) at step(s) {spikes}: {action}.",
                category=UserWarning,
            )
        return {"stability/skip_rate": sum(row["outcome"] != 0 for row in taken) / len(taken)} if taken else {}

    def _note_new_levels(self, taken: list[dict[str, float]]) -> None:
        """An event and a warning where a signal's values start to count as a new level (flag 2 in the history):
        at a 2 after at least :data:`CALM_STEPS` rows without one (a level's values may dip under the threshold
        for a few steps: still the same level)."""
        for column, signal in (("loss_spike", "loss"), ("grad_spike", "gradient norm")):
            series = self.history.series[column]  # the taken rows are its tail
            before = series[: len(series) - len(taken)][-CALM_STEPS:]
            calm = CALM_STEPS if 2.0 not in before else before[::-1].index(2.0)
            for row in taken:
                if row[column] != 2:
                    calm += 1
                    continue
                if calm >= CALM_STEPS:
                    step = int(row["step"])
                    detail = (
                        f"the {signal} stayed above its spike threshold (more than {NEW_LEVEL_AFTER} steps net): a "
                        "new level, "
                        "taken into the statistics, no longer treated as spikes"
                    )
                    self.events.append({"step": step, "kind": "new_level", "detail": detail})
                    rank_zero_warn(f"TrainingHealthMonitor: at step {step}, {detail}.", category=UserWarning)
                calm = 0

    def check_memory(self, peak: float | None) -> None:
        if peak is None or self._memory_warned:
            return
        message = memory_warning(peak, self.capacity, self.memory_warn_fraction)
        if message:
            self._memory_warned = True
            rank_zero_warn(message, category=UserWarning)

    # ------------------------------------------------------------------ end of fit
    def write_report(self, directory: str | Path, meta: dict[str, Any]) -> tuple[Path, Path | None]:
        """Write ``stability_report.json`` (and ``.png`` with matplotlib) into ``directory``."""
        from lightning_stability.health.report import write_report

        meta = {**meta, "module_names": self.names}
        json_path, png_path = write_report(self.history.series, self.events, directory, meta)
        rank_zero_info(f"stability report: {json_path}" + (f", {png_path}" if png_path else ""))
        return json_path, png_path
