"""A checkpoint written by lightning_stability 0.1.0 before the package was regrouped into feature folders
still loads, and resuming from it ends with the weights of the run it was cut from.

``tests/data/all_callbacks_epoch1.ckpt`` holds the state of every callback (the ledger, the gradient-norm
monitor, the LR schedule, the accumulation schedule, the tuned fp16 scaler, the health monitor's statistics)
after epoch 1 of a 2-epoch fp16 run with two overflow steps; ``straight_weights.pt`` the weights at the end of
the same run without the interruption. Both were written by the code of commit 2c84e11.
"""

from __future__ import annotations

from pathlib import Path

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

DATA = Path(__file__).parent / "data"


def test_a_checkpoint_from_before_the_regrouping_resumes_to_the_same_weights(tmp_path: Path) -> None:
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
        ],
    )
    pl.seed_everything(0)
    trainer.fit(TinyModule(n=64, batch_size=8, inf_at_step=[2, 7]), ckpt_path=DATA / "all_callbacks_epoch1.ckpt")
    expected = torch.load(DATA / "straight_weights.pt", weights_only=True)
    got = trainer.lightning_module.state_dict()
    assert expected.keys() == got.keys()
    for key, value in expected.items():
        assert torch.equal(got[key], value), key
    # both overflow steps of the first run are in the restored outcome counts (and none was added since)
    assert StepLedger.of(trainer).record_of().counts.tolist()[1] == 2
