"""Training-health monitoring: loss and gradient spikes, update size, memory; skip, clip or roll back; a report.

* ``spike_stats.py``: pure: the running mean and variance of several signals, z-scores, spike flags.
* ``signals.py``: the update size ``||dθ||/||θ||`` and peak memory, measured on logging steps; the mean over ranks.
* ``rollback.py``: snapshots of weights and optimizer state, restored in place; bounded retries; then back to a
  healthy checkpoint on disk (``restore_checkpoint``, through the strategy).
* ``history.py``: the per-step rows between logging steps and the host series, events and warnings.
* ``report.py``: the stability report (JSON, and a PNG with matplotlib).
* ``callback.py``: :class:`TrainingHealthMonitor`, and its argument checks.
"""

from lightning_stability.health.callback import TrainingHealthMonitor
from lightning_stability.health.report import load_report
from lightning_stability.health.rollback import TrainingDivergedError

__all__ = ["TrainingDivergedError", "TrainingHealthMonitor", "load_report"]
