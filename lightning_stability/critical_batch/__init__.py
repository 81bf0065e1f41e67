"""The critical batch: the gradient noise scale measured from a step's own micro-batches, and a batch that follows it.

* ``noise_scale.py``: pure: McCandlish et al.'s two-batch estimator, its moving averages, the ratio and its error.
* ``ramp.py``: pure: when the accumulation factor grows, and the beta2 that keeps its half-life in samples.
* ``callback.py``: :class:`CriticalBatchMonitor` (measures, logs ``stability/critical_batch``) and :class:`BatchRamp`
  (measures, and grows ``GradientAccumulation``'s factor at row 13 of the step table).

A folder of its own rather than a part of ``accumulation/``: the estimator is useful without a ramp, and the ramp
changes more than the accumulation factor (the LR schedule's clock, beta2); it drives ``GradientAccumulation``
through its public ``grow`` only.
"""

from lightning_stability.critical_batch.callback import BatchRamp, CriticalBatchMonitor

__all__ = ["BatchRamp", "CriticalBatchMonitor"]
