"""Replay a flagged step and tell a bad batch from a bad chip (``StepReplay``).

* ``callback.py``: :class:`StepReplay`, the Lightning adapter: when to replay, what each attribution does, the
  quarantine and the failing-device stop.
* ``rerun.py``: what a replay needs, kept as the micro-batches come, and the replay itself.
* ``attribute.py``: the attribution, a pure function of the runs' comparisons.
* ``quarantine.py``: the manifest of quarantined samples.
* ``inject.py``: faults to rehearse with (:class:`BitFlip`, :class:`PoisonedSamples`).
"""

from lightning_stability.replay.attribute import Attribution, Cause
from lightning_stability.replay.callback import FailingDeviceError, StepReplay
from lightning_stability.replay.inject import BitFlip, PoisonedSamples
from lightning_stability.replay.quarantine import Quarantine, read_quarantine

__all__ = [
    "Attribution",
    "BitFlip",
    "Cause",
    "FailingDeviceError",
    "PoisonedSamples",
    "Quarantine",
    "StepReplay",
    "read_quarantine",
]
