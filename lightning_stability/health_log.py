"""The health monitor's host side: what it records and tells the user.

On logging steps the monitor's device rows (one per optimizer step) and its logging-step metrics (update size,
memory) arrive on the host in the ledger's one transfer; :class:`HealthLog` appends them to the history, names
the spikes in a warning, warns once when the peak memory nears the device's capacity, and at the end of ``fit``
writes the stability report (JSON + PNG).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lightning_stability.health_history import HealthHistory
from lightning_stability.ledger import StepLedger
from lightning_stability.memory import memory_warning
from lightning_stability.spike_stats import NEW_LEVEL_AFTER
from lightning_stability.step_metrics import FlushValues
from lightning_stability.update_size import UpdateSize

_ACTIONS = {
    "warn": "no action (response='warn')",
    "clip": "gradients clipped to ZClip's adaptive threshold (loss spikes: no action)",
    "skip": "those updates were skipped",
    "rollback": "those updates were skipped; rolling back",
}


#: rows without a new-level value after which the next one starts a new level (and gets its own event)
CALM_STEPS = 10


class HealthLog:
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

    # ------------------------------------------------------------------ logging steps (device side: queue)
    def queue_update_size(self, ledger: StepLedger, size: UpdateSize) -> None:
        """Log the update-to-weight ratio (total and the ``top_modules`` largest) once the step is applied."""

        def finish(closed: StepLedger) -> None:
            total, per_module = size.finish()
            closed.log("stability/update_ratio", total)
            k = min(self.top_modules, per_module.numel())
            if k:
                top = torch.topk(torch.nan_to_num(per_module, nan=math.inf), k)
                closed.log("_health/top_values", per_module[top.indices])
                closed.log("_health/top_indices", top.indices)

        ledger.on_close(finish)

    def queue_rows(self, ledger: StepLedger) -> None:
        """The rows since the last logging step ride the ledger's transfer."""
        rows = self.history.pending()
        if rows is not None:
            ledger.log("_health/rows", rows)

    # ------------------------------------------------------------------ logging steps (host side: read)
    def read(self, values: FlushValues) -> dict[str, float]:
        """Take a transfer's rows and metrics; returns the extra metrics to log (per-module update ratios, the
        skip rate)."""
        extra: dict[str, float] = {}
        top_i, top_v = values.get("_health/top_indices"), values.get("_health/top_values")
        if isinstance(top_i, list) and isinstance(top_v, list):
            for i, v in zip(top_i, top_v, strict=True):
                extra[f"stability/update_ratio/{self.names[int(i)]}"] = v
        sparse = {
            key: value
            for key, name in (("update_ratio", "stability/update_ratio"), ("memory_gb", "stability/memory_peak_gb"))
            if isinstance(value := values.get(name), float)
        }
        rows = values.get("_health/rows")
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
        from lightning_stability.report import write_report

        meta = {**meta, "module_names": self.names}
        json_path, png_path = write_report(self.history.series, self.events, directory, meta)
        rank_zero_info(f"stability report: {json_path}" + (f", {png_path}" if png_path else ""))
        return json_path, png_path
