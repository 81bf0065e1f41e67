"""torchrun script (2 CPU processes, gloo): RouterHealthMonitor under DDP on a tiny Mixtral.

Usage: ``torchrun ... router_ddp_run.py OUT_DIR [actions|fault]`` (``actions``: the monitor's actions on,
:data:`ACTIONS`; ``fault``: the same, with ``GradientNormMonitor`` skipping non-finite steps, and rank 1 alone
routing with logits of +inf in its first layer at batch :data:`FAULT_AT`). ``STEPS`` steps logging every ``EVERY``,
each rank on half of the global batch of ``GLOBAL_BATCH`` sequences (``MoELM`` deals them in order); each rank writes
``OUT_DIR/rank{R}.json`` with what its monitor recorded, by batch, its open window's state, its balancing bias, its
routers' weights, its skipped steps and (``fault``) its bias and routers after each batch.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import Callback

from tests.helpers import exit_worker, quiet_trainer
from tests.moe.moe_lm import MoELM

STEPS, EVERY, BATCHES, GLOBAL_BATCH, WORLD = 5, 2, 5, 4, 2
#: every action on, each large enough to act in 5 steps
ACTIONS: dict[str, Any] = dict(z_loss=0.5, logit_clip=0.3, balance_bias=0.05)
#: the batch at which rank 1 routes with logits of +inf (``fault``)
FAULT_AT = 2


class InfiniteLogits:
    """A forward hook on a router: at batch ``at`` of a training forward, its logits all +inf and its routing weights
    NaN, as an overflow in the router would make them (a fault of one rank: its loss NaN, its logit max +inf)."""

    def __init__(self, at: int) -> None:
        self.at, self.batch = at, -1

    def __call__(self, module: Any, args: Any, output: Any) -> Any:
        if self.batch != self.at or not module.training:
            return None
        return (output[0] + float("inf"), output[1] * float("nan"), *output[2:])


class StateByBatch(Callback):
    """The monitor's balancing bias and the routers' weights at the end of each batch (host reads: a test only)."""

    def __init__(self, monitor: Any, into: list[dict[str, Any]]) -> None:
        self.monitor, self.into = monitor, into

    def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        from tests.moe.moe_lm import gates

        routers = {name: gate.weight.tolist() for name, gate in gates(pl_module).items()}
        self.into.append({"bias": self.monitor.bias_values(), "routers": routers})


def fit(devices: int, actions: bool = False, fault: bool = False, **trainer: Any) -> dict[str, Any]:

    from lightning_stability import GradientNormMonitor
    from lightning_stability.ledger import StepLedger
    from tests.moe.moe_lm import gates
    from tests.moe.test_router_health import Logged

    monitor = Logged(log_every_n_steps=EVERY, **(ACTIONS if actions or fault else {}))
    module = MoELM("mixtral", batches=BATCHES, batch_size=GLOBAL_BATCH // devices)
    by_batch: list[dict[str, Any]] = []
    callbacks: list[Any] = [monitor]
    if fault:
        callbacks += [GradientNormMonitor(), StateByBatch(monitor, by_batch)]
        if os.environ.get("RANK") == "1":
            inf = InfiniteLogits(FAULT_AT)
            next(iter(gates(module).values())).register_forward_hook(inf)  # after the bias's, before the counts'
            module.on_train_batch_start = lambda batch, batch_idx: setattr(inf, "batch", batch_idx)  # type: ignore
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer_ = quiet_trainer(max_steps=STEPS, devices=devices, callbacks=callbacks, **trainer)
        trainer_.fit(module)
    routers = {name: gate.weight.tolist() for name, gate in gates(module).items()}
    skipped = int(StepLedger.of(trainer_).record_of(trainer_.optimizers[0]).skipped_steps)
    return {
        "logged": monitor.logged,
        "state": monitor.state_dict(),
        "bias": monitor.bias_values(),
        "routers": routers,
        "skipped": skipped,
        "by_batch": by_batch,
    }


def main() -> None:
    out = Path(sys.argv[1])
    warnings.simplefilter("ignore")
    mode = sys.argv[2:]
    result = fit(WORLD, actions=mode == ["actions"], fault=mode == ["fault"], strategy="ddp")
    (out / f"rank{os.environ['RANK']}.json").write_text(json.dumps(result))
    exit_worker()


if __name__ == "__main__":
    main()
