"""Run under torchrun (2 CPU processes, gloo, DDP): rank 1 turns slow and its weights get corrupted.

Rank 1 sleeps ``SLEEP`` s in its training step from global step ``SLOW_FROM`` on (a straggler); after its
``CORRUPT_AFTER``-th update one bit of one of its weights is flipped (silent data corruption: no error, no NaN).
Logs every 2 optimizer steps, checks the weight hash every 3, for 12 steps. Afterwards, the replica layouts
of a few ``DTensor`` placements on this 2-rank world.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
import warnings
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import Logger
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from lightning_stability import ClusterHealthMonitor
from lightning_stability.cluster import replica_layout
from tests.helpers import StepSyncCounter, SyncCounter, TinyModule, exit_worker, quiet_trainer

out_dir = sys.argv[1]
SLOW_FROM, SLEEP, CORRUPT_AFTER = 6, 0.4, 4


class SlowRank1(TinyModule):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.global_rank == 1 and self.global_step >= SLOW_FROM:
            time.sleep(SLEEP)
        return super().training_step(batch, batch_idx)


class PackageSyncCounter(SyncCounter):
    """Counts only the host syncs made from inside ``lightning_stability`` (Adam's and Lightning's own are not
    the package's): what the package adds, without a second, bare run."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        before = self.count
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if self.count != before and not any("/lightning_stability/" in f.filename for f in traceback.extract_stack()):
            self.count = before
        return out


class CorruptRank1(pl.Callback):
    """Flips bit 12 of one weight of rank 1 after its CORRUPT_AFTER-th update, as a faulty device might."""

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if trainer.global_rank == 1 and trainer.global_step == CORRUPT_AFTER:
            with torch.no_grad():
                bits = next(pl_module.parameters()).view(-1).view(torch.int32)
                bits[0] ^= 1 << 12


class Capture(Logger):
    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[int, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "capture"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.rows.append((int(step or 0), {k: float(v) for k, v in metrics.items() if k.startswith("stability/")}))


logger = Capture()
counter = PackageSyncCounter()
boundaries = StepSyncCounter(counter)
trainer = quiet_trainer(
    max_steps=12,
    devices=2,
    strategy="ddp",
    logger=logger,
    log_every_n_steps=2,
    callbacks=[
        boundaries,
        CorruptRank1(),
        ClusterHealthMonitor(straggler_factor=1.5, weight_hash_every=3, straggler_min_gap_s=0.1),
    ],
)
pl.seed_everything(0)
with warnings.catch_warnings(record=True) as caught, counter:
    warnings.simplefilter("always")
    trainer.fit(SlowRank1(n=12 * 8))

rank = trainer.global_rank
mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
hsdp = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
full = torch.ones(4, 2)


def layout(params: list[torch.Tensor], data_parallel: bool = False) -> Any:
    found = replica_layout(params, 2, data_parallel)
    return found if isinstance(found, str) else list(found.groups)


result = {
    "rows": logger.rows,
    "syncs_per_step": boundaries.per_step,
    "straggler_warnings": [str(w.message) for w in caught if str(w.message).startswith("Straggler")],
    "hash_warnings": [str(w.message) for w in caught if "Weights differ across" in str(w.message)],
    "final_weights": [p.detach().flatten().tolist() for p in trainer.lightning_module.parameters()],
    "layouts": {
        "ddp": layout(list(trainer.lightning_module.parameters()), data_parallel=True),
        "plain_not_ddp": layout([full]),
        "fully_sharded": layout([distribute_tensor(full, mesh, [Shard(0)])]),
        "replicated": layout([distribute_tensor(full, mesh, [Replicate()])]),
        "hybrid": layout([distribute_tensor(full, hsdp, [Replicate(), Shard(0)])]),
        "two_meshes": layout(
            [distribute_tensor(full, mesh, [Replicate()]), distribute_tensor(full, hsdp, [Replicate(), Shard(0)])]
        ),
    },
}
with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
    json.dump(result, f)
exit_worker()
