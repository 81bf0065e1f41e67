"""Benchmark: killed N times, nothing lost; and what an atomic save costs (issue 22, items 3 and 5).

**The soak** (``tests/checkpoint/soak.py``, the long form of ``tests/checkpoint/test_soak.py``): two processes
train with ``StableCheckpoint(every_n_train_steps=1)`` under DDP (fp32, ``AtomicCheckpointIO``) and under
``StableFSDPStrategy`` (fp16 with ``LossScaleTuner``, sharded checkpoints); each run is SIGKILLed ``--kills``
times at random moments, every checkpoint on disk is verified after each kill, and each restart uses
``trainer.fit(ckpt_path="last")``. The finished run is compared with an uninterrupted one, bit for bit: weights,
AdamW's state, LR, loss scale, ledger counts, step, epoch, the data of every step. The data is a plain
``DataLoader(shuffle=True)`` (Lightning's ``DistributedSampler``; ``StableCheckpoint`` resumes it mid-epoch). A
control run (``ddp_stream``: the same data as an ``IterableDataset`` without ``state_dict``, which cannot be
fast-forwarded) shows what the comparison catches.

**The cost of a save**, the same model (``TinyGPT`` of tests/distributed/fsdp_common.py, ``--width`` wide, ``--blocks``
blocks, with AdamW's state after one step), each save overwriting the previous one at the same path, the two
ways alternating, median of ``--repeats``:

* one process: Lightning's ``TorchCheckpointIO`` (in place: ``torch.save`` to a temporary file, moved over the
  path, no ``fsync``) against ``AtomicCheckpointIO`` (hidden sibling, ``fsync``, rename);
* two FSDP processes (gloo, sharded): DCP's ``dcp.save`` into the existing directory plus ``meta.pt`` (the
  earlier in-place save) against ``StableFSDPStrategy.save_checkpoint`` (hidden sibling, every rank's shards,
  ``meta.pt`` fsync-ed, the errors gathered, the directory exchanged, the old one deleted).

Run: ``python -m benchmarks.fault_tolerance [--kills 10] [--repeats 7]`` (about 4 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
# per configuration: optimizer steps (enough for the kills), the longest random wait before a kill (seconds)
SOAK = {"ddp": (80, 0.8), "fsdp_fp16": (60, 1.0), "ddp_stream": (40, 0.8)}


def soak_all(kills: int, seed: int) -> list[str]:
    from tests.checkpoint.soak import soak

    lines = []
    for config, (steps, delay) in SOAK.items():
        n = 3 if config == "ddp_stream" else kills
        with tempfile.TemporaryDirectory() as tmp:
            result = soak(Path(tmp), config, kills=n, steps=steps, seed=seed, max_delay=delay)
        lines.append(result.line())
        print(lines[-1], flush=True)
        if config != "ddp_stream" and result.mismatches:
            print("  all differences:", *result.mismatches, sep="\n    ")
    return lines


def checkpoint_of(d: int, layers: int) -> dict[str, Any]:
    from tests.distributed.fsdp_common import VOCAB, TinyGPT

    torch.manual_seed(0)
    model = TinyGPT(d, layers, heads=4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randint(0, VOCAB, (2, 8))).sum().backward()
    optimizer.step()
    return {"state_dict": model.state_dict(), "optimizer_states": [optimizer.state_dict()], "global_step": 1}


def median_pair(first: Any, second: Any, repeats: int) -> tuple[float, float]:
    """Medians of the two callables' times, alternating which one runs first."""
    times: list[list[float]] = [[], []]
    for i in range(repeats + 1):
        order = (0, 1) if i % 2 == 0 else (1, 0)
        for which in order:
            start = time.perf_counter()
            (first, second)[which]()
            if i:  # the first round warms up the directory and caches
                times[which].append(time.perf_counter() - start)
    return statistics.median(times[0]), statistics.median(times[1])


def single_process_cost(d: int, layers: int, repeats: int) -> str:
    from lightning.fabric.plugins import TorchCheckpointIO

    from lightning_stability.checkpoint import AtomicCheckpointIO

    checkpoint = checkpoint_of(d, layers)
    with tempfile.TemporaryDirectory(dir=REPO) as tmp:
        plain, atomic = TorchCheckpointIO(), AtomicCheckpointIO()
        in_place, ours = median_pair(
            lambda: plain.save_checkpoint(checkpoint, Path(tmp) / "plain.ckpt"),
            lambda: atomic.save_checkpoint(checkpoint, Path(tmp) / "atomic.ckpt"),
            repeats,
        )
        size = (Path(tmp) / "atomic.ckpt").stat().st_size
    return (
        f"one process, {size / 2**20:.1f} MB file: TorchCheckpointIO (in place) {in_place * 1e3:.1f} ms, "
        f"AtomicCheckpointIO {ours * 1e3:.1f} ms, ratio {ours / in_place:.2f}"
    )


def fsdp_cost(d: int, layers: int, repeats: int) -> str:
    with tempfile.TemporaryDirectory(dir=REPO) as tmp:
        env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__]
        args = ["--fsdp-save-worker", tmp, "--width", str(d), "--blocks", str(layers), "--repeats", str(repeats)]
        proc = subprocess.run([*cmd, *args], env=env, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(f"the FSDP save worker failed:\n{proc.stderr[-4000:]}")
        result = json.loads((Path(tmp) / "fsdp_cost.json").read_text())
    in_place, ours = result["in_place"], result["ours"]
    return (
        f"two FSDP processes, sharded, {result['mb']:.1f} MB on disk: DCP in place {in_place * 1e3:.1f} ms, "
        f"StableFSDPStrategy {ours * 1e3:.1f} ms, ratio {ours / in_place:.2f}"
    )


def fsdp_save_worker(out: Path, d: int, layers: int, repeats: int) -> None:
    """torchrun worker: one FSDP step, then the two ways of saving its checkpoint, timed with a barrier each."""
    import lightning.pytorch as pl
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from lightning_stability.strategies import StableFSDPStrategy
    from lightning_stability.strategies.fsdp_checkpoint import _MODEL_KEY, _OPTIM_KEY, META_FILE
    from tests.distributed.fsdp_common import TinyGPT, TinyLM
    from tests.helpers import exit_worker

    module = TinyLM(batch_size=4, n=8)
    module.model = TinyGPT(d, layers, heads=4)
    strategy = StableFSDPStrategy()
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, use_distributed_sampler=False,
    )  # fmt: skip
    trainer.fit(module)
    checkpoint = trainer._checkpoint_connector.dump_checkpoint()  # what trainer.save_checkpoint hands the strategy
    in_place_dir, ours_path = out / "in_place.ckpt", out / "ours.ckpt"

    def in_place() -> None:  # the save before issue 22: DCP into the existing directory, then meta.pt
        rest = dict(checkpoint)
        tensors = {_MODEL_KEY: rest.pop(_MODEL_KEY)}
        for i, osd in enumerate(rest.pop("optimizer_states", [])):
            tensors[_OPTIM_KEY.format(i)] = osd
        if dist.get_rank() == 0:
            in_place_dir.mkdir(exist_ok=True)
        dist.barrier()
        dcp.save(tensors, checkpoint_id=in_place_dir)
        if dist.get_rank() == 0:
            torch.save(rest, in_place_dir / META_FILE)
        dist.barrier()

    def ours() -> None:
        strategy.save_checkpoint(checkpoint, ours_path)
        dist.barrier()

    a, b = median_pair(in_place, ours, repeats)
    times = torch.tensor([a, b], dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)  # the slower rank's median
    if dist.get_rank() == 0:
        size = sum(p.stat().st_size for p in ours_path.iterdir())
        result = {"in_place": float(times[0]), "ours": float(times[1]), "mb": size / 2**20}
        (out / "fsdp_cost.json").write_text(json.dumps(result))
    dist.barrier()
    exit_worker()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--skip-soak", action="store_true")
    parser.add_argument("--fsdp-save-worker", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.fsdp_save_worker is not None:
        fsdp_save_worker(args.fsdp_save_worker, args.width, args.blocks, args.repeats)
        return
    seed = random.randrange(2**32) if args.seed is None else args.seed
    started = time.monotonic()
    if not args.skip_soak:
        print(f"soak (seed {seed}):", flush=True)
        soak_all(args.kills, seed)
    print(f"cost of a save (TinyGPT with AdamW's state; median of {args.repeats}):")
    for model in ((128, 2), (args.width, args.blocks)):
        print(f"  d={model[0]}, {model[1]} blocks:")
        print("    " + single_process_cost(*model, args.repeats), flush=True)
        print("    " + fsdp_cost(*model, args.repeats), flush=True)
    print(f"wall time {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
