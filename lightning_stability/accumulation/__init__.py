"""Gradient accumulation keyed to applied optimizer updates.

* ``schedule.py``: pure: the accumulation schedule (parse, factor at an update count, LR scale, run length).
* ``batchnorm.py``: BatchNorm under accumulation: find, warn, convert.
* ``adascale.py``: FairScale's AdaScale gain, applied to the update it was measured for.
* ``callback.py``: :class:`GradientAccumulation`, its conflict checks, the LR it writes, the guard around
  Lightning's tuner searches.
"""

from lightning_stability.accumulation.callback import GradientAccumulation

__all__ = ["GradientAccumulation"]
