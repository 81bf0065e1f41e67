"""Benchmark: killed N times, nothing lost; what an atomic save costs; how long an async one blocks the step.

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

**The step blocked by a save** (issue 31, item 3): a real Trainer trains the same model (``--width``, ``--blocks``)
for ``--blocked-steps`` steps with ``StableCheckpoint(every_n_train_steps=5)``, once with ``async_save=False`` and
once with ``async_save=True``, ``--rounds`` times each in alternating order, in one process (``AtomicCheckpointIO``)
and in two FSDP processes (sharded). Per save, the host time of ``StableCheckpoint._save_checkpoint`` (synchronous:
the whole write; asynchronous: waiting for the previous write, building the checkpoint, copying it to host memory);
the first save of each run (which allocates the copy's buffers) is left out; the median over runs of each run's
median, the slower rank's. Also printed: the mean time of ``StableCheckpoint.on_train_batch_end`` on the other steps
(an asynchronous save is polled there, and a background write competes with training for the CPU) and each fit's
wall time.

The soak saves with ``async_save=True`` (``soak_run.py``).

Run: ``python -m benchmarks.fault_tolerance [--kills 10] [--repeats 7] [--rounds 2]`` (about 4 minutes on 2
cores).
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


class _TimedCheckpoint:
    """Mixed into ``StableCheckpoint``: the host time of each save (``_save_checkpoint``: the whole write when
    synchronous; waiting for the previous write, building the checkpoint and copying it when asynchronous) and of
    the other steps' ``on_train_batch_end`` (where an asynchronous save is polled)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[call-arg]
        self.save_times: list[float] = []
        self.other_steps: list[float] = []

    def _save_checkpoint(self, trainer: Any, filepath: str) -> None:
        start = time.perf_counter()
        super()._save_checkpoint(trainer, filepath)  # type: ignore[misc]
        self.save_times.append(time.perf_counter() - start)

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        saves = len(self.save_times)
        start = time.perf_counter()
        super().on_train_batch_end(trainer, *args)  # type: ignore[misc]
        if len(self.save_times) == saves:
            self.other_steps.append(time.perf_counter() - start)


def blocked_worker(out: Path, layout: str, d: int, layers: int, steps: int, every: int, rounds: int) -> None:
    """One process (``plain``) or a torchrun worker (``sharded``): the same run saving synchronously and
    asynchronously, ``rounds`` times each, alternating; writes the blocked times (rank 0, the slower rank's)."""
    import lightning.pytorch as pl
    import torch.distributed as dist

    from lightning_stability import AtomicCheckpointIO, StableCheckpoint
    from lightning_stability.strategies import StableFSDPStrategy
    from tests.distributed.fsdp_common import TinyGPT, TinyLM

    timed = type("TimedStableCheckpoint", (_TimedCheckpoint, StableCheckpoint), {})
    results: dict[str, dict[str, list[float]]] = {"sync": {"save": [], "other": [], "fit": []}}
    results["async"] = {"save": [], "other": [], "fit": []}
    size = 0.0
    for i in range(2 * rounds):
        mode = ("sync", "async")[(i + i // 2) % 2]  # sync, async, async, sync, ...: neither always first
        pl.seed_everything(0, verbose=False)
        world = int(os.environ.get("WORLD_SIZE", "1"))
        module = TinyLM(batch_size=8 // world, n=8 * steps)
        module.model = TinyGPT(d, layers, heads=4)
        directory = out / f"{mode}{i}"
        callback = timed(dirpath=directory, every_n_train_steps=every, keep=1, async_save=mode == "async")
        kwargs: dict[str, Any] = {"plugins": [AtomicCheckpointIO()]}
        if layout == "sharded":
            kwargs = {"strategy": StableFSDPStrategy(), "devices": world}
        trainer = pl.Trainer(
            accelerator="cpu", max_steps=steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
            use_distributed_sampler=False, callbacks=[callback], **kwargs,
        )  # fmt: skip
        start = time.perf_counter()
        trainer.fit(module)
        fit_s = time.perf_counter() - start
        # the first save of a run allocates the copy's buffers: left out like any warm-up
        times = torch.tensor(
            [statistics.median(callback.save_times[1:]), statistics.mean(callback.other_steps), fit_s],
            dtype=torch.float64,
        )
        if dist.is_initialized():
            dist.all_reduce(times, op=dist.ReduceOp.MAX)
        for key, value in zip(("save", "other", "fit"), times.tolist(), strict=True):
            results[mode][key].append(value)
        newest = sorted(directory.glob("*.ckpt"))[-1]
        size = (sum(p.stat().st_size for p in newest.iterdir()) if newest.is_dir() else newest.stat().st_size) / 2**20
    if not dist.is_initialized() or dist.get_rank() == 0:
        (out / f"blocked_{layout}.json").write_text(json.dumps({"results": results, "mb": size}))


def blocked_time(layout: str, d: int, layers: int, steps: int, every: int, rounds: int) -> str:
    """How long the step is blocked per save, async against sync, the same model in the same run."""
    with tempfile.TemporaryDirectory(dir=REPO) as tmp:
        args = [layout, tmp, str(d), str(layers), str(steps), str(every), str(rounds)]
        env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1")
        cmd = [sys.executable, __file__, "--blocked-worker", *args]
        if layout == "sharded":
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *cmd[1:]]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            raise RuntimeError(f"the blocked-time worker failed:\n{proc.stderr[-4000:]}")
        data = json.loads((Path(tmp) / f"blocked_{layout}.json").read_text())
    r, mb = data["results"], data["mb"]
    sync, asyn = statistics.median(r["sync"]["save"]), statistics.median(r["async"]["save"])
    where = "one process, AtomicCheckpointIO" if layout == "plain" else "two FSDP processes, sharded"
    return (
        f"{where}, {mb:.1f} MB checkpoint, a save every {every} steps: the step blocked per save {sync * 1e3:.1f} ms "
        f"synchronous, {asyn * 1e3:.1f} ms with async_save, ratio {asyn / sync:.3f}; StableCheckpoint's "
        "on_train_batch_end on the other steps "
        f"{statistics.median(r['sync']['other']) * 1e3:.2f} / {statistics.median(r['async']['other']) * 1e3:.2f} ms; "
        f"fit of {steps} steps {statistics.median(r['sync']['fit']):.2f} s / "
        f"{statistics.median(r['async']['fit']):.2f} s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--skip-soak", action="store_true")
    parser.add_argument("--blocked-steps", type=int, default=31, help="steps of each blocked-time run")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each way in the blocked-time measurement")
    parser.add_argument("--skip-cost", action="store_true", help="only the soak and the blocked time")
    parser.add_argument("--fsdp-save-worker", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--blocked-worker", nargs=7, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.blocked_worker is not None:
        layout, out, *numbers = args.blocked_worker
        blocked_worker(Path(out), layout, *(int(n) for n in numbers))
        if torch.distributed.is_initialized():
            from tests.helpers import exit_worker

            torch.distributed.barrier()
            exit_worker()
        return
    if args.fsdp_save_worker is not None:
        fsdp_save_worker(args.fsdp_save_worker, args.width, args.blocks, args.repeats)
        return
    seed = random.randrange(2**32) if args.seed is None else args.seed
    started = time.monotonic()
    if not args.skip_soak:
        print(f"soak (seed {seed}):", flush=True)
        soak_all(args.kills, seed)
    if not args.skip_cost:
        print(f"cost of a save (TinyGPT with AdamW's state; median of {args.repeats}):")
        for model in ((128, 2), (args.width, args.blocks)):
            print(f"  d={model[0]}, {model[1]} blocks:")
            print("    " + single_process_cost(*model, args.repeats), flush=True)
            print("    " + fsdp_cost(*model, args.repeats), flush=True)
    print(f"the step blocked by a save, async_save=True against False (TinyGPT d={args.width}, {args.blocks} blocks):")
    for layout in ("plain", "sharded"):
        print("  " + blocked_time(layout, args.width, args.blocks, args.blocked_steps, 5, args.rounds), flush=True)
    print(f"wall time {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
