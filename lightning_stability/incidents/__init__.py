"""One incident log per run: every fault the callbacks handle, beside the checkpoints, across restarts.

``lightning-stability incidents DIR`` prints it; the stability report carries it.
"""

from lightning_stability.incidents.log import KINDS, Incident, format_incidents, read_incidents
from lightning_stability.incidents.trainer_log import fit_ended, fit_started, log_directory, record

__all__ = [
    "KINDS",
    "Incident",
    "fit_ended",
    "fit_started",
    "format_incidents",
    "log_directory",
    "read_incidents",
    "record",
]
