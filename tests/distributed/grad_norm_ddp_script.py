"""Run under torchrun (2 CPU processes, gloo): only rank 1 sees an inf loss at step 3."""

from __future__ import annotations

import json
import os
import sys
import warnings
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_stability import GradientNormMonitor, StepLedger
from tests.helpers import TinyModule, quiet_trainer

out_dir, optimizer = sys.argv[1], sys.argv[2]
warnings.simplefilter("ignore")


class Record(pl.Callback):
    def __init__(self) -> None:
        self.before: list[list[torch.Tensor]] = []
        self.after: list[list[torch.Tensor]] = []
        self.state_before: list[list[torch.Tensor]] = []
        self.state_after: list[list[torch.Tensor]] = []
        self.outcomes: list[int] = []
        self.norms: list[float] = []

    def _state(self, trainer: pl.Trainer) -> list[torch.Tensor]:
        opt = trainer.optimizers[0]
        return [v.clone() for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.before.append([p.detach().clone() for p in pl_module.parameters()])
        self.state_before.append(self._state(trainer))

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, opt: Any) -> None:
        self.norms.append(StepLedger.of(trainer).record["grad_norm"].item())

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        ledger = StepLedger.of(trainer)
        ledger.close_step()
        self.outcomes.append(int(ledger.outcome))
        self.after.append([p.detach().clone() for p in pl_module.parameters()])
        self.state_after.append(self._state(trainer))


record = Record()
trainer = quiet_trainer(
    max_steps=6,
    accelerator="cpu",
    devices=2,
    strategy="ddp",
    callbacks=[GradientNormMonitor(max_norm=1.0), record],
)
pl.seed_everything(0)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    trainer.fit(TinyModule(optimizer=optimizer, inf_at_step=3, inf_rank=1))
bad = 3
result = {
    "outcomes": record.outcomes,
    "norms": [n if n == n and abs(n) != float("inf") else str(n) for n in record.norms],
    "bad_step_weights_unchanged": all(
        torch.equal(a, b) for a, b in zip(record.before[bad], record.after[bad], strict=True)
    ),
    "bad_step_state_unchanged": all(
        torch.equal(a, b) for a, b in zip(record.state_before[bad], record.state_after[bad], strict=True)
    ),
    "other_steps_changed": all(not torch.equal(record.before[s][0], record.after[s][0]) for s in range(6) if s != bad),
    "final_weights": [p.detach().flatten().tolist() for p in trainer.lightning_module.parameters()],
    "applied": StepLedger.of(trainer).applied_steps.item(),
    "nonfinite_warnings": sum("Non-finite gradient norm" in str(w.message) for w in caught),
}
with open(os.path.join(out_dir, f"rank{trainer.global_rank}.json"), "w") as f:
    json.dump(result, f)
