"""The argument checks of ``TrainingHealthMonitor``: each bad value is named, with the fix."""

from __future__ import annotations

from typing import Any

from lightning_stability.errors import check_positive_int, config_error

RESPONSES = ("warn", "clip", "skip", "rollback")


def check_health_arguments(
    response: Any,
    spike_z: Any,
    clip_z: Any,
    alpha: Any,
    warmup_steps: Any,
    snapshot_every: Any,
    skip_batches: Any,
    max_rollbacks: Any,
    memory_warn_fraction: Any,
    top_modules: Any,
) -> None:
    """Raise ``StabilityConfigError`` for the first bad argument."""
    if response not in RESPONSES:
        raise config_error("response", response, "is not a response", f"pass one of {', '.join(RESPONSES)}")
    for name, value in (("spike_z", spike_z), ("clip_z", clip_z)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise config_error(name, value, "must be a number > 0", "pass e.g. 6.0 (spikes) or 2.5 (clip)")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 < alpha < 1:
        raise config_error("alpha", alpha, "must be in (0, 1)", "pass e.g. 0.97 (ZClip's default)")
    for name, value in (("warmup_steps", warmup_steps), ("snapshot_every", snapshot_every)):
        check_positive_int(name, value, "25 or 100")
    if warmup_steps < 2:
        # one value has no spread: every later value would score as a spike, and "skip" would skip them all
        raise config_error(
            "warmup_steps", warmup_steps, "must be >= 2 (a standard deviation needs two values)", "pass e.g. 25"
        )
    for name, value in (
        ("skip_batches", skip_batches),
        ("max_rollbacks", max_rollbacks),
        ("top_modules", top_modules),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise config_error(name, value, "must be an int >= 0", "pass e.g. 200, 3 or 5")
    if not 0 < memory_warn_fraction <= 1:
        raise config_error("memory_warn_fraction", memory_warn_fraction, "must be in (0, 1]", "pass e.g. 0.9")
