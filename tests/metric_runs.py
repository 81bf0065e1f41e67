"""Fits that log every kind of ``stability/`` key that has parts, for the key tests (``tests/test_metric_keys.py``)
and the end-to-end logger tests (``tests/test_logger_delivery.py``).

* :func:`fit_gpt_preset`: ``StableTrainer.from_preset("gpt")`` on a tiny language model with two param groups, with
  every per-part figure on: per-module gradient norms, the largest per-module update ratios, the largest attention
  logit per attention module, the LR per param group.
* :func:`fit_two_optimizers`: two optimizers (each key ends in ``/<optimizer>``), one with two param groups, with the
  per-part figures of ``GradientNormMonitor`` and ``WarmupConstantCosineLR`` (``TrainingHealthMonitor`` and
  ``PrecursorMonitor`` take one optimizer).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_stability import GradientNormMonitor, StableTrainer, WarmupConstantCosineLR
from tests.helpers import quiet_trainer
from tests.ledger.test_several_optimizers import TwoOptimizerGAN
from tests.precursors.tiny_lm import TinyLM

#: the part keys each fit must log (a fit that logs none of one kind tests nothing about it)
GPT_PART_PREFIXES = (
    "stability/grad_norm_by_module/",
    "stability/update_ratio_by_module/",
    "stability/attention_logit_max_by_module/",
    "stability/lr_by_group/",
)
TWO_OPTIMIZER_PART_PREFIXES = ("stability/grad_norm_by_module/", "stability/lr_by_group/")


class TwoGroupLM(TinyLM):
    """:class:`TinyLM` with the usual two param groups: weight decay on matrices, none on biases and norms."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        decay = [p for p in self.parameters() if p.dim() >= 2]
        rest = [p for p in self.parameters() if p.dim() < 2]
        return torch.optim.AdamW(
            [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=self.lr
        )

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss)  # the module's own metric, on the same logger rows as the stability ones
        return loss


class TwoGroupGAN(TwoOptimizerGAN):
    """:class:`TwoOptimizerGAN` whose discriminator's SGD has two param groups (its two layers)."""

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        first, _, second = self.disc
        groups = [{"params": first.parameters()}, {"params": second.parameters(), "lr": self.lr_d / 2}]
        return [torch.optim.SGD(groups, lr=self.lr_d), torch.optim.Adam(self.gen.parameters(), lr=self.lr_g)]


def fit_gpt_preset(logger: Any, root: Path, steps: int = 4, every: int = 2) -> pl.Trainer:
    """The "gpt" preset, logging every ``every`` steps, with per-module gradient norms on."""
    trainer = StableTrainer.from_preset(
        "gpt",
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        log_every_n_steps=every,
        logger=logger,
        default_root_dir=root,
        checkpoint=False,
        per_layer=True,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    torch.manual_seed(0)
    trainer.fit(TwoGroupLM())
    return trainer


def fit_two_optimizers(logger: Any, root: Path, steps: int = 4, every: int = 2) -> pl.Trainer:
    """Two optimizers (SGD, Adam), each with per-module gradient norms and its LR per param group."""
    trainer = quiet_trainer(
        max_steps=steps,
        log_every_n_steps=every,
        logger=logger,
        default_root_dir=root,
        callbacks=[GradientNormMonitor(per_layer=True), WarmupConstantCosineLR()],
    )
    trainer.fit(TwoGroupGAN())
    return trainer


def stability_keys(trainer: pl.Trainer, logged: set[str]) -> set[str]:
    """The ``stability/`` keys among ``logged`` (what a logger got) and in ``trainer.callback_metrics``."""
    return {k for k in logged | set(trainer.callback_metrics) if k.startswith("stability/")}


def keys_below_others(keys: set[str]) -> list[tuple[str, str]]:
    """Every pair ``(key, other)`` where ``other`` lies below ``key`` (starts with ``key + "/"``)."""
    return sorted((k, o) for k in keys for o in keys if o.startswith(k + "/"))
