"""Lightning's progress bars with the gradient norm, LR, loss scale and skipped steps beside the loss."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ProgressBar, RichProgressBar, TQDMProgressBar
from lightning.pytorch.callbacks.progress.rich_progress import RichProgressBarTheme

from lightning_stability.errors import check_bool, check_instance, check_int
from lightning_stability.ledger.step_ledger import StepLedger

#: ``stability/`` metric -> its label in the bar (shown once a callback has logged it)
SHOWN = {
    "stability/grad_norm": "grad_norm",
    "stability/lr": "lr",
    "stability/loss_scale": "loss_scale",
    "stability/skipped_steps": "skipped",
}


class _StabilityMetrics(ProgressBar):
    """Adds the ``stability/`` metrics of :data:`SHOWN` to a progress bar's items.

    It shows the values last logged (on Lightning's logging steps, ``log_every_n_steps``), which the step
    ledger already holds as host numbers: the bar adds no host-device synchronisation. With several optimizers
    each one's metric has its own label (``grad_norm/<optimizer>``).
    """

    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        items = super().get_metrics(trainer, pl_module)
        ledger = StepLedger.of(trainer)
        several = len(trainer.optimizers) > 1
        for key, label in SHOWN.items():
            for name, value in ledger.published.items():
                # `key/<optimizer>` with several optimizers; other suffixes are per-module metrics
                suffix = name[len(key) + 1 :] if several and name.startswith(key + "/") else None
                if name == key or (suffix and "/" not in suffix):
                    # as text: the bars' own number format (3 decimals in Rich) would show a small LR as 0.000
                    items[label + name[len(key) :]] = f"{int(value)}" if label == "skipped" else f"{value:.3g}"
        return items


class StabilityProgressBar(_StabilityMetrics, TQDMProgressBar):
    """Lightning's TQDM progress bar with the stability metrics; its arguments are ``TQDMProgressBar``'s."""

    def __init__(self, refresh_rate: int = 1, process_position: int = 0, leave: bool = False) -> None:
        check_int("refresh_rate", refresh_rate, 0, "1 (0: off)")
        check_int("process_position", process_position, 0, "0")
        check_bool("leave", leave)
        super().__init__(refresh_rate=refresh_rate, process_position=process_position, leave=leave)


class StabilityRichProgressBar(_StabilityMetrics, RichProgressBar):
    """Lightning's Rich progress bar with the stability metrics (needs ``rich``); its arguments are
    ``RichProgressBar``'s."""

    def __init__(
        self,
        refresh_rate: int = 100,
        leave: bool = False,
        theme: RichProgressBarTheme | None = None,
        console_kwargs: dict[str, Any] | None = None,
    ) -> None:
        check_int("refresh_rate", refresh_rate, 0, "100 (0: off)")
        check_bool("leave", leave)
        if theme is not None:
            check_instance("theme", theme, RichProgressBarTheme, "a RichProgressBarTheme", "RichProgressBarTheme()")
        if console_kwargs is not None:
            check_instance("console_kwargs", console_kwargs, dict, "a dict of rich Console arguments", "{}")
        super().__init__(
            refresh_rate=refresh_rate,
            leave=leave,
            theme=theme if theme is not None else RichProgressBarTheme(),
            console_kwargs=console_kwargs,
        )


def stability_progress_bar() -> ProgressBar:
    """The bar Lightning would pick by default (Rich when ``rich`` is installed, else TQDM), with the metrics."""
    try:
        return StabilityRichProgressBar()
    except ModuleNotFoundError:
        return StabilityProgressBar()
