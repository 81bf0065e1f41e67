"""benchmarks.lr_sensitivity: its --quick run end to end, and its argument checks."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from benchmarks import lr_sensitivity
from lightning_stability import WarmupConstantCosineSchedule, get_preset
from tests.helpers import QUIET


def test_the_grid_is_six_log_spaced_lrs_from_1e_3_to_3e_1() -> None:
    assert len(lr_sensitivity.LRS) == 6
    assert lr_sensitivity.LRS[0] == 1e-3 and lr_sensitivity.LRS[-1] == 0.3
    ratios = [b / a for a, b in zip(lr_sensitivity.LRS, lr_sensitivity.LRS[1:], strict=False)]
    assert max(ratios) / min(ratios) < 1.01


@pytest.mark.usefixtures("restore_process_settings")
def test_the_quick_run_prints_every_arm(capsys: pytest.CaptureFixture[str]) -> None:
    figures = lr_sensitivity.main(["--quick"])
    out = capsys.readouterr().out
    assert set(figures) == set(lr_sensitivity.ARMS)
    for name, s in figures.items():
        assert f"\n{name} " in out
        assert set(s["per_lr"]) == {1e-3, 0.3} and all(len(v) == 1 for v in s["per_lr"].values())
        assert s["sensitivity"] >= 0 and 0 <= s["skipped"] <= 1 and 0 <= s["spike_score"] <= 1
        assert math.isfinite(s["initial"]) and s["best"] <= s["initial"]
    assert "held-out bigram loss" in out


def test_the_bigram_loss_is_that_of_counted_character_pairs() -> None:
    """A text that alternates two of three characters: 500 pairs 0->1 and 499 pairs 1->0, each count plus one."""
    corpus = lr_sensitivity.Corpus(torch.tensor([0, 1] * 500), 3, 0.0, 0.0)
    batch = torch.tensor([[0, 1, 0, 1, 0]])  # two pairs of each kind
    expected = -(math.log(501 / 503) + math.log(500 / 502)) / 2
    assert abs(lr_sensitivity.bigram_loss(corpus, batch) - expected) < 1e-6


def test_bad_arguments_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        lr_sensitivity.main(["--lrs", "1e-2,fast"])
    assert "--lrs must be numbers" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        lr_sensitivity.main(["--arms", "bare,magic"])
    assert "unknown arm(s) ['magic']" in capsys.readouterr().err


def test_gpt2_init_draws_every_weight_from_n_0_002_and_zeroes_the_biases() -> None:
    torch.manual_seed(0)
    model = lr_sensitivity.PreLNLM(vocab=50, width=32, layers=2, context=16, lr=1e-3, init="gpt2")
    weights = [p for n, p in model.named_parameters() if p.dim() > 1 and n != "pos"]
    assert abs(float(torch.cat([w.flatten() for w in weights]).std()) - 0.02) < 1e-3
    assert all(not p.any() for n, p in model.named_parameters() if n.endswith("bias"))
    torch.manual_seed(0)
    default = lr_sensitivity.PreLNLM(vocab=50, width=32, layers=2, context=16, lr=1e-3)
    assert float(default.embed.weight.std()) > 0.5  # torch's N(0, 1) embedding: what --init gpt2 changes


class _LRs(pl.Callback):
    """The LR each optimizer step applies."""

    def __init__(self) -> None:
        self.lrs: list[float] = []

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self.lrs.append(optimizer.param_groups[0]["lr"])


def test_the_careful_arm_clips_with_lightning_and_warms_up_with_the_presets_shape(tmp_path: Path) -> None:
    steps, lr = 40, 1e-2
    corpus = lr_sensitivity.load_corpus()
    torch.manual_seed(0)
    model = lr_sensitivity.PreLNLM(corpus.vocab, 16, 1, 8, lr, schedule_steps=steps)
    data = DataLoader(lr_sensitivity.CorpusWindows(corpus, steps * 2, 8, 0), batch_size=2)
    seen = _LRs()
    common: dict[str, Any] = dict(
        accelerator="cpu",
        max_steps=steps,
        enable_checkpointing=False,
        default_root_dir=tmp_path,
        callbacks=[seen],
        **QUIET,
    )
    trainer = lr_sensitivity.ARMS["careful"](common)
    trainer.fit(model, data)
    gpt = get_preset("gpt")
    assert trainer.gradient_clip_val == gpt.max_norm and not any(
        type(cb).__module__.startswith("lightning_stability") for cb in trainer.callbacks
    )
    shape = WarmupConstantCosineSchedule(warmup=gpt.warmup, decay=gpt.decay, min_lr_ratio=gpt.min_lr_ratio)
    assert seen.lrs == pytest.approx([lr * shape(n, steps) for n in range(steps)])
    assert "careful" in lr_sensitivity.OWN_SCHEDULE and seen.lrs[0] < seen.lrs[5] == pytest.approx(lr)
