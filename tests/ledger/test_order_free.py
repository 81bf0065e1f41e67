"""What a step does does not depend on the order of the Trainer's callbacks: the ``gpt`` preset's callbacks, and the
clip / update-clip pair whose order used to matter, in their order, reversed and shuffled."""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import Tensor

from lightning_stability import (
    GradientNormMonitor,
    LRBackoff,
    PrecursorMonitor,
    StableTrainer,
    StepLedger,
    TrainingHealthMonitor,
    WarmupConstantCosineLR,
)
from tests.helpers import quiet_trainer
from tests.precursors.tiny_lm import TinyLM

ORDERS = ("as given", "reversed", "shuffled")


def _reorder(trainer: pl.Trainer, order: str) -> list[str]:
    callbacks = list(trainer.callbacks)  # type: ignore[attr-defined]
    if order == "reversed":
        callbacks.reverse()
    elif order == "shuffled":
        random.Random(3).shuffle(callbacks)
    trainer.callbacks[:] = callbacks  # type: ignore[attr-defined]
    return [type(cb).__name__ for cb in callbacks]


def _result(trainer: pl.Trainer, model: pl.LightningModule) -> dict[str, Any]:
    """The weights, every stability metric, the health events and the ledger's counts after the fit. The peak memory
    is left out: on a CPU it is the process's, which grows with every fit the test makes."""
    metrics = {
        k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("stability/") and "memory" not in k
    }
    monitor = next((cb for cb in trainer.callbacks if isinstance(cb, TrainingHealthMonitor)), None)  # type: ignore[attr-defined]
    record = StepLedger.of(trainer).record_of()
    return {
        "weights": {k: v.clone() for k, v in model.state_dict().items()},
        "metrics": metrics,
        "events": [] if monitor is None else [_untimed(e) for e in monitor.events],
        "counts": record.counts.tolist(),
    }


def _untimed(event: dict[str, Any]) -> dict[str, Any]:
    """An event without the wall-clock time a replay took."""
    event = {k: v for k, v in event.items() if k != "seconds"}
    event["detail"] = re.sub(r" \([0-9.]+ s\)", "", str(event.get("detail", "")))
    return event


def _same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["weights"].keys() == b["weights"].keys()
    for key, value in a["weights"].items():
        assert torch.equal(value, b["weights"][key]), key
    assert a["metrics"] == b["metrics"]
    assert a["events"] == b["events"]
    assert a["counts"] == b["counts"]


def _fit_gpt_preset(root: Path, order: str) -> tuple[list[str], dict[str, Any]]:
    trainer = StableTrainer.from_preset(
        "gpt",
        accelerator="cpu",
        devices=1,
        precision="32-true",
        replay=True,
        per_layer=True,
        max_steps=12,
        log_every_n_steps=2,
        logger=False,
        default_root_dir=root,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    names = _reorder(trainer, order)
    torch.manual_seed(0)
    model = TinyLM(lr=3e-2, batches=12)
    model.spikes = {5: float("nan")}  # a step the health monitor flags and StepReplay replays
    trainer.fit(model)
    return names, _result(trainer, model)


def test_the_gpt_presets_callbacks_in_any_order(tmp_path: Path) -> None:
    runs = {order: _fit_gpt_preset(tmp_path / order.replace(" ", "_"), order) for order in ORDERS}
    names = {order: run[0] for order, run in runs.items()}
    assert len({tuple(n) for n in names.values()}) == 3, names  # three different orders
    assert len(names["as given"]) >= 5, names["as given"]
    reference = runs["as given"][1]
    assert reference["events"], "the non-finite step 5 left no event: the runs test nothing about events"
    assert reference["counts"], reference
    for order in ORDERS[1:]:
        _same(reference, runs[order][1])


class _ClippedLM(TinyLM):
    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        return super().training_step(batch, batch_idx) * 5.0  # gradients large enough for max_norm to clip


@pytest.mark.parametrize("order", ORDERS[1:])
def test_the_update_clip_reads_the_clipped_gradients_in_any_order(order: str) -> None:
    """PrecursorMonitor's update clipping reads the gradients the update uses (after GradientNormMonitor's clip and
    Lightning's), wherever it stands in the list."""

    def fit(order: str) -> dict[str, Any]:
        callbacks: list[pl.Callback] = [
            PrecursorMonitor(update_clip=0.5, reset_moments=True, lr_backoff=LRBackoff(threshold=1e-3)),
            GradientNormMonitor(max_norm=0.05),
            TrainingHealthMonitor(response="skip"),
            WarmupConstantCosineLR(warmup=0.1),
        ]
        trainer = quiet_trainer(max_steps=8, callbacks=callbacks, log_every_n_steps=2)
        _reorder(trainer, order)
        torch.manual_seed(0)
        model = _ClippedLM(lr=3e-2)
        trainer.fit(model)
        return _result(trainer, model)

    reference = fit("as given")
    assert reference["metrics"]["stability/grad_norm"] > 0.05  # the clip acted
    _same(reference, fit(order))
