"""Per-rank memory of parameters + gradients + optimizer state under StableFSDPStrategy, at world size 1, 2, 4.

Each world size is one ``torchrun`` launch of CPU processes (gloo) that trains a small transformer for
one AdamW step through Lightning, then counts the bytes each rank holds: its parameter shards, its
gradient shards and its optimizer state (moments are sharded; AdamW's per-parameter ``step`` counters
are replicated). The baseline is world size 1, measured in the same run; the report gives each
world size's largest rank against ``total / N`` and against ``total / N + replicated``.

Transient all-gather buffers (freed after each unit's forward/backward) are not counted: this is the
state that persists between steps, the part FSDP shards.

Usage::

    python benchmarks/fsdp_memory.py                 # world sizes 1 2 4, d_model 256, 4 layers
    python benchmarks/fsdp_memory.py --worlds 1 2 --d-model 128
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------- worker (under torchrun)
def _local_bytes(t: Any) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t
    return int(local.numel() * local.element_size())


def worker(out: Path, d_model: int, layers: int) -> None:
    import lightning.pytorch as pl
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.tensor import DTensor
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from lightning_stability.strategies.fsdp import StableFSDPStrategy

    vocab, seq = 512, 32

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(vocab, d_model)
            self.blocks = nn.ModuleList(
                nn.TransformerEncoderLayer(d_model, 4, 4 * d_model, dropout=0.0, batch_first=True)
                for _ in range(layers)
            )
            self.head = nn.Linear(d_model, vocab)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            (x,) = batch
            h = self.embed(x)
            for block in self.blocks:
                h = block(h)
            return nn.functional.cross_entropy(self.head(h).float().flatten(0, 1), x.flatten())

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

        def train_dataloader(self) -> DataLoader:
            data = TensorDataset(torch.randint(0, vocab, (64, seq)))
            return DataLoader(data, batch_size=4, sampler=DistributedSampler(data, shuffle=False))

    class Count(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, *args: Any) -> None:
            params = list(module.parameters())
            optimizer = trainer.optimizers[0]
            states = [v for p in params for v in optimizer.state[p].values() if isinstance(v, torch.Tensor)]
            self.result = {
                "params": sum(_local_bytes(p) for p in params),
                "grads": sum(_local_bytes(p.grad) for p in params if p.grad is not None),
                "optim_sharded": sum(_local_bytes(s) for s in states if isinstance(s, DTensor)),
                "optim_replicated": sum(_local_bytes(s) for s in states if not isinstance(s, DTensor)),
                "numel": sum(p.numel() for p in params),
            }

    torch.manual_seed(0)
    count = Count()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=int(os.environ["LOCAL_WORLD_SIZE"]),
        strategy=StableFSDPStrategy(),
        max_steps=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        use_distributed_sampler=False,
        callbacks=[count],
    )
    trainer.fit(Model())
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(count.result))


# ---------------------------------------------------------------------- driver
def measure(world: int, d_model: int, layers: int) -> list[dict[str, int]]:
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1")
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
            __file__, "--worker", tmp, "--d-model", str(d_model), "--layers", str(layers),
        ]  # fmt: skip
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        if proc.returncode:
            raise RuntimeError(f"world size {world} failed:\n{proc.stderr[-4000:]}")
        return [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(world)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.worker, args.d_model, args.layers)
        return
    worlds = sorted(set(args.worlds) | {1})  # world size 1 is the baseline
    runs = {w: measure(w, args.d_model, args.layers) for w in worlds}
    base = runs[1][0]
    total = base["params"] + base["grads"] + base["optim_sharded"]  # what FSDP shards
    print(f"model: {base['numel']:,} parameters; params+grads+AdamW state at world size 1: {total / 2**20:.2f} MiB")
    print(
        f"{'world':>5} {'max rank MiB':>13} {'total/N MiB':>12} {'replicated KiB':>15} {'ratio':>7} {'ratio+rep':>10}"
    )
    for world in worlds:
        per_rank = [r["params"] + r["grads"] + r["optim_sharded"] + r["optim_replicated"] for r in runs[world]]
        worst = max(per_rank)
        replicated = max(r["optim_replicated"] for r in runs[world])
        ideal = total / world
        print(
            f"{world:>5} {worst / 2**20:>13.3f} {ideal / 2**20:>12.3f} {replicated / 2**10:>15.2f} "
            f"{worst / ideal:>7.3f} {worst / (ideal + replicated):>10.3f}"
        )
    print("ratio = largest rank / (total/N); ratio+rep = largest rank / (total/N + replicated step counters)")


if __name__ == "__main__":
    main()
