"""Training-health monitoring: loss and gradient spikes, update size, memory; skip, clip or roll back; a report.

* ``responses.py``: the responses to a spike (``Response``), written once; no torch.
* ``spike_stats.py``: pure: the running mean and variance of several signals, z-scores, spike flags.
* ``signals.py``: the update size ``||dθ||/||θ||`` and peak memory, measured on logging steps; the mean over ranks.
* ``rollback.py``: snapshots of weights and optimizer state, restored in place; bounded retries; then back to a
  healthy checkpoint on disk (``restore_checkpoint``, through the strategy).
* ``history.py``: the per-step rows between logging steps and the host series, events and warnings.
* ``report.py``: the stability report (JSON, and a PNG with matplotlib).
* ``callback.py``: :class:`TrainingHealthMonitor`, and its argument checks. Its verdict of each step is data in
  the step ledger (``ledger/verdict.py``).

The names below are imported on first use (PEP 562), so that the presets read ``responses.py`` without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "TrainingDivergedError": "lightning_stability.health.rollback",
    "TrainingHealthMonitor": "lightning_stability.health.callback",
    "load_report": "lightning_stability.health.report",
}
__all__ = ["TrainingDivergedError", "TrainingHealthMonitor", "load_report"]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'lightning_stability.health' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)


if TYPE_CHECKING:
    from lightning_stability.health.callback import TrainingHealthMonitor
    from lightning_stability.health.report import load_report
    from lightning_stability.health.rollback import TrainingDivergedError
