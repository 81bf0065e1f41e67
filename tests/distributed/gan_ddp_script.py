"""Run under torchrun (2 CPU processes, gloo): a two-optimizer GAN under fp16 with every callback that serves
several optimizers; the discriminator's loss turns NaN at one batch on every rank."""

from __future__ import annotations

import json
import os
import sys
import warnings

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins import MixedPrecision

from lightning_stability import GradientNormMonitor, LossScaleTuner, StepLedger, WarmupConstantCosineLR
from tests.helpers import exit_worker, quiet_trainer
from tests.ledger.test_several_optimizers import TwoOptimizerGAN

warnings.simplefilter("ignore")
out_dir = sys.argv[1]
trainer = quiet_trainer(
    max_epochs=1,
    devices=2,
    strategy="ddp_find_unused_parameters_true",  # a GAN's step uses only one network's parameters per loss
    log_every_n_steps=2,
    plugins=[MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=256.0))],
    callbacks=[
        GradientNormMonitor(max_norm=1.0, check_replicas=True),
        WarmupConstantCosineLR(),
        LossScaleTuner(init_scale=256.0),
    ],
)
pl.seed_everything(0)
trainer.fit(TwoOptimizerGAN(nan_d_at=(3,)))
ledger = StepLedger.of(trainer)
result = {
    "counts": [ledger.record_of(opt).counts.tolist() for opt in trainer.optimizers],
    "lrs": [opt.param_groups[0]["lr"] for opt in trainer.optimizers],
    "weights": [p.detach().flatten().tolist() for p in trainer.lightning_module.parameters()],
}
with open(os.path.join(out_dir, f"rank{trainer.global_rank}.json"), "w") as f:
    json.dump(result, f)
exit_worker()
