"""torchrun script (2 CPU processes, gloo): RouterHealthMonitor under DDP on a tiny Mixtral.

Usage: ``torchrun ... router_ddp_run.py OUT_DIR [actions]`` (``actions``: the monitor's actions on,
:data:`ACTIONS`). ``STEPS`` steps logging every ``EVERY``, each rank on half of the global batch of ``GLOBAL_BATCH``
sequences (``MoELM`` deals them in order); each rank writes ``OUT_DIR/rank{R}.json`` with what its monitor recorded,
by batch, its open window's state, its balancing bias and its routers' weights.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

from tests.helpers import exit_worker, quiet_trainer
from tests.moe.moe_lm import MoELM

STEPS, EVERY, BATCHES, GLOBAL_BATCH, WORLD = 5, 2, 5, 4, 2
#: every action on, each large enough to act in 5 steps
ACTIONS: dict[str, Any] = dict(z_loss=0.5, logit_clip=0.3, balance_bias=0.05)


def fit(devices: int, actions: bool = False, **trainer: Any) -> dict[str, Any]:
    from tests.moe.moe_lm import gates
    from tests.moe.test_router_health import Logged

    monitor = Logged(log_every_n_steps=EVERY, **(ACTIONS if actions else {}))
    module = MoELM("mixtral", batches=BATCHES, batch_size=GLOBAL_BATCH // devices)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quiet_trainer(max_steps=STEPS, devices=devices, callbacks=[monitor], **trainer).fit(module)
    routers = {name: gate.weight.tolist() for name, gate in gates(module).items()}
    return {"logged": monitor.logged, "state": monitor.state_dict(), "bias": monitor.bias_values(), "routers": routers}


def main() -> None:
    out = Path(sys.argv[1])
    warnings.simplefilter("ignore")
    result = fit(WORLD, actions=sys.argv[2:] == ["actions"], strategy="ddp")
    (out / f"rank{os.environ['RANK']}.json").write_text(json.dumps(result))
    exit_worker()


if __name__ == "__main__":
    main()
