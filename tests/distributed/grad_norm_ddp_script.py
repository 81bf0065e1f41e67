"""Run under torchrun (2 CPU processes, gloo): only rank 1 goes wrong at step 3.

Faults (third argument): ``loss`` — an inf loss, spread to every rank by DDP's gradient all-reduce;
``after_allreduce`` — rank 1's gradients turn inf inside ``on_before_optimizer_step``, after the all-reduce,
so nothing spreads them; ``replica`` — rank 1's gradients are doubled there (finite): a silently faulty device.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins import MixedPrecision

from lightning_stability import GradientNormMonitor, StepLedger
from tests.helpers import TinyModule, exit_worker, quiet_trainer

out_dir, optimizer = sys.argv[1], sys.argv[2]
fault = sys.argv[3] if len(sys.argv) > 3 else "loss"
precision = sys.argv[4] if len(sys.argv) > 4 else "32-true"
warnings.simplefilter("ignore")
BAD = 3


class CorruptRank1(pl.Callback):
    """Edits rank 1's gradients at step BAD, after DDP's all-reduce (as a faulty device or a hook would)."""

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, opt: Any) -> None:
        if trainer.global_step == BAD and trainer.global_rank == 1:
            for p in pl_module.parameters():
                p.grad.mul_(float("inf") if fault == "after_allreduce" else 2.0)


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
        self.norms.append(StepLedger.of(trainer).step.grad_norm.item())

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        ledger = StepLedger.of(trainer)
        ledger.close_step()
        self.outcomes.append(int(ledger.outcome))
        self.after.append([p.detach().clone() for p in pl_module.parameters()])
        self.state_after.append(self._state(trainer))


record = Record()
callbacks: list[pl.Callback] = [] if fault == "loss" else [CorruptRank1()]
trainer = quiet_trainer(
    max_steps=6,
    accelerator="cpu",
    devices=2,
    strategy="ddp",
    # fp16 on CPU needs an explicit scaler plugin (Lightning turns precision="16-mixed" on CPU into bf16)
    **(
        {"plugins": [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=256.0))]}
        if precision == "16-mixed"
        else {"precision": precision}
    ),
    callbacks=[
        *callbacks,
        GradientNormMonitor(max_norm=1.0, check_replicas=fault == "replica", log_every_n_steps=1),
        record,
    ],
)
pl.seed_everything(0)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    trainer.fit(TinyModule(optimizer=optimizer, inf_at_step=BAD if fault == "loss" else None, inf_rank=1))
bad = BAD
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
    "applied": int(StepLedger.of(trainer).record_of().applied_steps),
    "nonfinite_warnings": sum("Non-finite gradient norm" in str(w.message) for w in caught),
    "replica_warnings": [str(w.message) for w in caught if "disagree across data-parallel replicas" in str(w.message)],
}
with open(os.path.join(out_dir, f"rank{trainer.global_rank}.json"), "w") as f:
    json.dump(result, f)
exit_worker()
