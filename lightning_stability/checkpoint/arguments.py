"""The checks of ``StableCheckpoint``'s arguments that it shares with Lightning's ``ModelCheckpoint``: a bad one
gets this package's error naming it, before Lightning's own (which raises ``MisconfigurationException`` for some
and accepts others of the wrong type until the first save)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from lightning_stability.checkpoint.preemption import check_signals
from lightning_stability.errors import check_bool, check_instance, check_int, check_path, config_error

MODES = ("min", "max")


def check_model_checkpoint_arguments(
    *,
    dirpath: Any,
    filename: Any,
    monitor: Any,
    verbose: Any,
    save_last: Any,
    save_top_k: Any,
    signals: Any,
    mode: Any,
    auto_insert_metric_name: Any,
    every_n_train_steps: Any,
    train_time_interval: Any,
    every_n_epochs: Any,
    save_on_train_epoch_end: Any,
    enable_version_counter: Any,
) -> None:
    """Raise ``StabilityConfigError`` for the first bad argument."""
    if dirpath is not None:
        check_path("dirpath", dirpath)
    for name, text in (("filename", filename), ("monitor", monitor)):
        if text is not None:
            check_instance(name, text, str, "a str or None", "'val_loss'" if name == "monitor" else "'{step}'")
    for name, flag in (
        ("verbose", verbose),
        ("auto_insert_metric_name", auto_insert_metric_name),
        ("enable_version_counter", enable_version_counter),
    ):
        check_bool(name, flag)
    if not (save_last is None or isinstance(save_last, bool) or save_last == "link"):
        raise config_error("save_last", save_last, "is not a save_last mode", "pass True, False, 'link' or None")
    check_int("save_top_k", save_top_k, -1, "1 (-1: every checkpoint)")
    if signals is not None:
        check_signals(signals)
    if mode not in MODES:
        raise config_error("mode", mode, "is not a mode", "pass 'min' or 'max'")
    for name, count in (("every_n_train_steps", every_n_train_steps), ("every_n_epochs", every_n_epochs)):
        if count is not None:
            check_int(name, count, 0, f"{name}=100")
    if train_time_interval is not None:
        check_instance(
            "train_time_interval", train_time_interval, timedelta, "a timedelta or None", "timedelta(hours=1)"
        )
    if save_on_train_epoch_end is not None:
        check_bool("save_on_train_epoch_end", save_on_train_epoch_end)
