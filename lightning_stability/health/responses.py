"""The responses of ``TrainingHealthMonitor`` to a spike, written once: the monitor, the presets and
``StableTrainer`` take them from here. No torch: the presets (pure data) check a response without importing it."""

from __future__ import annotations

from typing import Literal, get_args

Response = Literal["warn", "clip", "skip", "rollback"]
#: every response, in the order of the documentation (mildest first)
RESPONSES: tuple[Response, ...] = get_args(Response)
