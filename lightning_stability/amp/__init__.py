"""fp16 loss scaling: the scale rule, the scaler that runs it, the callback that installs it, fit-start checks.

* ``rule.py``: pure: the loss-scale rule (growth, backoff, hysteresis, floor) as tensor ops and on host
  numbers; :func:`auto_initial_scale`.
* ``state.py``: where a scaler's rule runs (host numbers or device tensors), its running totals, the
  ``init_scale="auto"`` probe.
* ``scaler.py``: :class:`TunedGradScaler`, a torch ``GradScaler`` running that rule, its overflow flag the same
  on every rank; :class:`ScalerSettings`, its settings and their checks (which ``LossScaleTuner`` takes too).
* ``callback.py``: :class:`LossScaleTuner`, which installs the scaler into the precision plugin;
  :class:`FusedClipMixedPrecision`.
* ``diagnostics.py``: fit-start precision checks (:class:`PrecisionDiagnostics`) and
  :func:`check_training_status`.
"""

from lightning_stability.amp.callback import FusedClipMixedPrecision, LossScaleFloorError, LossScaleTuner
from lightning_stability.amp.diagnostics import PrecisionDiagnostics, TrainingStatus, check_training_status
from lightning_stability.amp.rule import ScaleRule, auto_initial_scale, update_scale
from lightning_stability.amp.scaler import ScalerSettings, TunedGradScaler

__all__ = [
    "FusedClipMixedPrecision",
    "LossScaleFloorError",
    "LossScaleTuner",
    "PrecisionDiagnostics",
    "ScaleRule",
    "ScalerSettings",
    "TrainingStatus",
    "TunedGradScaler",
    "auto_initial_scale",
    "check_training_status",
    "update_scale",
]
