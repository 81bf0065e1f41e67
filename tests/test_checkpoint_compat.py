"""A checkpoint written by lightning_stability 0.1.0 before the package was regrouped into feature folders
still loads, and resuming from it ends where the uninterrupted run ends.

``tests/data/all_callbacks_epoch1.ckpt`` holds the state of every callback (the ledger, the gradient-norm
monitor, the LR schedule, the accumulation schedule, the tuned fp16 scaler, the health monitor's statistics)
after epoch 1 of a 2-epoch fp16 run with two overflow steps, written by the code of commit 2c84e11.

The uninterrupted run it is compared with is computed here, on the machine the test runs on. The fixture's
weights came from another machine's CPU kernels (AVX-512 there, perhaps AVX2 or ARM here), whose float32
sums round differently in the last bits, so the weights are compared to a tolerance: relative 1e-4 is
~1000x the float32 rounding of one step, far below what a lost or wrong piece of callback state does (a
missed LR warmup step, a loss scale off by 2x, a skipped step applied: each moves the weights by > 1e-2,
checked below by resuming without the callbacks' state). Everything discrete is compared exactly: the
outcome counts, the loss scale and the LR of every step after the resume.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins import MixedPrecision

from lightning_stability import (
    GradientAccumulation,
    GradientNormMonitor,
    LossScaleTuner,
    StepLedger,
    TrainingHealthMonitor,
    WarmupConstantCosineLR,
)
from tests.helpers import TinyModule, quiet_trainer

FIXTURE = Path(__file__).parent / "data" / "all_callbacks_epoch1.ckpt"
RTOL, ATOL = 1e-4, 1e-6


class _LRs(pl.Callback):
    def __init__(self) -> None:
        self.lrs: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])


def _fit(tmp_path: Path, ckpt_path: Path | None) -> tuple[pl.Trainer, list[float]]:
    lrs = _LRs()
    trainer = quiet_trainer(
        default_root_dir=tmp_path,
        max_epochs=2,
        log_every_n_steps=2,
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))],
        callbacks=[
            GradientNormMonitor(max_norm=1.0),
            WarmupConstantCosineLR(warmup=0.3, decay=0.5),
            GradientAccumulation(steps={0: 1, 4: 2}, lr_scaling="none"),
            LossScaleTuner(init_scale=2.0**8, hysteresis=2, growth_interval=3),
            TrainingHealthMonitor(response="skip", warmup_steps=3),
            lrs,
        ],
    )
    pl.seed_everything(0)
    trainer.fit(TinyModule(n=64, batch_size=8, inf_at_step=[2, 7]), ckpt_path=ckpt_path)
    return trainer, lrs.lrs


def _weights(trainer: pl.Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.lightning_module.state_dict().items()}


def test_a_checkpoint_from_before_the_regrouping_resumes_to_the_uninterrupted_run(tmp_path: Path) -> None:
    straight, straight_lrs = _fit(tmp_path / "straight", None)
    resumed, resumed_lrs = _fit(tmp_path / "resumed", FIXTURE)

    # discrete state: exact
    assert resumed.global_step == straight.global_step
    assert StepLedger.of(resumed).record_of().counts.tolist() == StepLedger.of(straight).record_of().counts.tolist()
    assert StepLedger.of(resumed).record_of().counts.tolist()[1] == 2  # both overflow steps, none added since
    assert resumed_lrs == straight_lrs[-len(resumed_lrs) :]
    assert len(resumed_lrs) > 0
    scale = [cb.scaler.get_scale() for cb in (straight.callbacks + resumed.callbacks) if isinstance(cb, LossScaleTuner)]
    assert scale[0] == scale[1]

    # weights: to float32 rounding across CPUs (see the module docstring)
    got, expected = _weights(resumed), _weights(straight)
    assert got.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=RTOL, atol=ATOL, msg=key)


def test_the_tolerance_catches_a_resume_that_lost_the_callbacks_state(tmp_path: Path) -> None:
    """The same fixture resumed with its callbacks' state dropped ends outside the tolerance: the check above
    can fail."""
    straight, _ = _fit(tmp_path / "straight", None)
    checkpoint = torch.load(FIXTURE, weights_only=False)
    checkpoint["callbacks"] = {}
    checkpoint.pop("lightning_stability", None)
    stripped = tmp_path / "stripped.ckpt"
    torch.save(checkpoint, stripped)
    resumed, _ = _fit(tmp_path / "resumed", stripped)
    got, expected = _weights(resumed), _weights(straight)
    assert any(not torch.allclose(got[k], expected[k], rtol=RTOL, atol=ATOL) for k in expected)
