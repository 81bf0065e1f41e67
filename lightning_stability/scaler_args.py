"""The argument checks of TunedGradScaler, also run by LossScaleTuner at construction."""

from __future__ import annotations

import math

from lightning_stability.errors import check_positive_int, config_error
from lightning_stability.scaling import ScaleRule


def _check_init_scale(init_scale: object, min_scale: object) -> None:
    if init_scale == "auto":
        return
    if isinstance(init_scale, bool) or not isinstance(init_scale, (int, float)) or not math.isfinite(init_scale):
        raise config_error("init_scale", init_scale, "is not a number or 'auto'", "pass e.g. 2.0**16, 32768 or 'auto'")
    if init_scale <= 0:
        raise config_error("init_scale", init_scale, "must be > 0", "pass e.g. 2.0**16, 32768 or 'auto'")
    if isinstance(min_scale, (int, float)) and init_scale < min_scale:
        raise config_error(
            "init_scale", init_scale, f"is below min_scale={min_scale}", "raise init_scale, or lower min_scale"
        )


def _check_headroom(auto_headroom: object) -> None:
    if (
        isinstance(auto_headroom, bool)
        or not isinstance(auto_headroom, (int, float))
        or not math.isfinite(auto_headroom)
        or auto_headroom < 1
    ):
        raise config_error("auto_headroom", auto_headroom, "must be a finite number >= 1", "pass e.g. 8.0")


def check_scaler_arguments(
    init_scale: object,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    hysteresis: int,
    min_scale: float | None,
    consecutive_hysteresis: bool,
    overflow_window: object,
    auto_headroom: object,
) -> None:
    """Every argument check of :class:`TunedGradScaler`, also run by ``LossScaleTuner`` at construction."""
    ScaleRule(growth_factor, backoff_factor, growth_interval, hysteresis, min_scale, consecutive_hysteresis)
    _check_init_scale(init_scale, min_scale)
    check_positive_int("overflow_window", overflow_window, "1000")
    _check_headroom(auto_headroom)
