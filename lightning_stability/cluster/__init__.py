"""The cheap checks of a sick cluster (issue 22, item 4): stragglers, replicas that silently diverged, and the
process-group watchdog settings a long run wants.

* :class:`ClusterHealthMonitor` (``callback.py``): each rank's step time and min / median / max over ranks on
  logging steps, naming the slowest rank; the weight-hash check across data-parallel replicas every N steps.
* ``stragglers.py`` (pure): :class:`StepTimer` (host clock at the step boundaries), the figures, the warning.
* ``weight_hash.py``: which ranks must hold equal weights (:func:`replica_layout`), the device fingerprint, the
  ranks that disagree.
* ``watchdog.py`` (pure): :func:`watchdog_settings` / :func:`watchdog_environment`, the timeout and NCCL
  variables, set only where the user has not.
"""

from lightning_stability.cluster.callback import ClusterHealthMonitor
from lightning_stability.cluster.stragglers import StepTimer, StragglerFigures, straggler_figures
from lightning_stability.cluster.watchdog import (
    WATCHDOG_TIMEOUT,
    WatchdogSettings,
    watchdog_environment,
    watchdog_settings,
)
from lightning_stability.cluster.weight_hash import (
    ReplicaLayout,
    disagreeing_replicas,
    replica_groups,
    replica_layout,
    weight_fingerprint,
)

__all__ = [
    "WATCHDOG_TIMEOUT",
    "ClusterHealthMonitor",
    "ReplicaLayout",
    "StepTimer",
    "StragglerFigures",
    "WatchdogSettings",
    "disagreeing_replicas",
    "replica_groups",
    "replica_layout",
    "straggler_figures",
    "watchdog_environment",
    "watchdog_settings",
    "weight_fingerprint",
]
