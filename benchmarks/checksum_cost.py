"""Benchmark: what recording a checkpoint's checksums costs a save (issue 41).

The same save with and without its checksums, alternating in one run, median of ``--repeats``, on a checkpoint of
``--mb`` MB (float32 tensors of 4 MB, the shape of a model's weights and AdamW's state), each save published over
the previous one at the same path:

* **one process, synchronous**: ``AtomicCheckpointIO``'s write (``atomic.save_file``: ``torch.save`` into the
  hidden sibling, ``fsync``, rename) with ``seal=False`` against ``seal=True`` (``checksums.seal``: the file's
  CRC-32 from the CRC-32s torch computed of its records as it wrote them and the bytes between them, appended as
  the zip comment);
* **one process, asynchronous**: ``StableCheckpoint(async_save=True)``'s two parts, as ``AsyncSaves.start`` runs
  them: the blocking part (the copy into host buffers, ``AsyncSaves.stage``, and handing the write to the thread)
  and the background part (``torch_save_durably`` by path, with ``seal=False`` or ``True``, then ``fsync``; the
  publish);
* **two processes (gloo), sharded DCP**, each rank writing half of the tensors: synchronous, what
  ``StableFSDPStrategy.save_checkpoint`` runs (``fsdp_checkpoint.save``: every rank's shards, then each rank the
  CRC-32s of the shards it wrote (from their tensors' records, as for one file), one all-gather, rank 0 writes
  ``meta.pt`` with the table, sealed; the publish) against the same without the checksums, the gather and the
  seal; asynchronous, ``dcp.async_save`` with the host-copy stager (the blocking part) and the background write as
  ``StableFSDPStrategy.save_checkpoint_async`` runs it, with and without the checksums. Times are the slower
  rank's.

Run: ``python -m benchmarks.checksum_cost [--mb 64,256] [--repeats 7]`` (about a minute on 2 cores).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_stability.checkpoint import atomic, checksums
from lightning_stability.checkpoint.async_save import AsyncSaves
from lightning_stability.strategies import fsdp_checkpoint as ckpt

TENSOR = 1 << 20  # float32 elements per tensor: 4 MB


def checkpoint(mb: int, rank: int = 0, world: int = 1) -> dict[str, Any]:
    count = max(mb // 4 // world, 1)
    g = torch.Generator().manual_seed(rank)
    weights = {f"r{rank}.w{i}": torch.randn(TENSOR, generator=g) for i in range(count)}
    return {"state_dict": weights, "optimizer_states": [], "global_step": 7, "loops": {"fit": list(range(100))}}


def median_ms(times: list[float]) -> float:
    return 1000 * statistics.median(times)


def alternate(repeats: int, arms: dict[str, Callable[[], Any]]) -> dict[str, list[Any]]:
    """Run each arm once as a warm-up, then ``repeats`` rounds of every arm in turn; each arm's results."""
    for run in arms.values():
        run()
    results: dict[str, list[Any]] = {name: [] for name in arms}
    for _ in range(repeats):
        for name, run in arms.items():
            results[name].append(run())
    return results


# ---------------------------------------------------------------------- one process
def one_process(mb: int, repeats: int, directory: Path) -> list[str]:
    state = checkpoint(mb)
    target = directory / "one.ckpt"

    def sync(seal: bool) -> Callable[[], float]:
        def run() -> float:
            start = time.perf_counter()
            atomic.save_file(target, lambda f: torch.save(state, f), seal=seal)
            return time.perf_counter() - start

        return run

    saves = AsyncSaves()

    def background(seal: bool) -> Callable[[], tuple[float, float]]:
        def run() -> tuple[float, float]:
            start = time.perf_counter()
            staged = saves.stage(state)
            partial = atomic.partial_path(target, f"{atomic.new_token()}.pt")
            future = saves.submit(
                lambda: atomic.torch_save_durably(partial, staged, seal=seal),
                lambda: atomic.publish(partial, target),
                partial,
            )
            blocked = time.perf_counter() - start
            future.result()
            return blocked, time.perf_counter() - start

        return run

    t = alternate(repeats, {"plain": sync(False), "sealed": sync(True)})
    a = alternate(repeats, {"plain": background(False), "sealed": background(True)})
    saves.close()
    assert atomic.verify(target) == (target, True)
    size = target.stat().st_size / 1e6
    plain, sealed = median_ms(t["plain"]), median_ms(t["sealed"])
    blocked = {k: median_ms([b for b, _ in v]) for k, v in a.items()}
    total = {k: median_ms([w for _, w in v]) for k, v in a.items()}
    return [
        f"  one process, {size:.1f} MB file:",
        f"    synchronous save: without checksum {plain:.1f} ms, with {sealed:.1f} ms, ratio {sealed / plain:.2f}",
        f"    async_save, the step blocked: without {blocked['plain']:.1f} ms, with {blocked['sealed']:.1f} ms, "
        f"ratio {blocked['sealed'] / blocked['plain']:.2f}; the background write: without {total['plain']:.1f} ms, "
        f"with {total['sealed']:.1f} ms, ratio {total['sealed'] / total['plain']:.2f}",
    ]


# ---------------------------------------------------------------------- two processes, sharded
def _sharded_worker(rank: int, world: int, mb: int, repeats: int, directory: str, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import torch.distributed.checkpoint as dcp

    state = checkpoint(mb, rank, world)
    target = Path(directory) / "sharded.ckpt"
    zero = rank == 0

    def fresh_partial() -> Path:
        token = [atomic.new_token() if zero else ""]
        dist.broadcast_object_list(token)
        partial = atomic.partial_path(target, token[0])
        if zero:
            partial.mkdir()
        dist.barrier()
        return partial

    def publish(partial: Path) -> None:
        dist.barrier()
        if zero:
            atomic.publish(partial, target)
        dist.barrier()

    def sync(sealed: bool) -> Callable[[], float]:
        def run() -> float:
            partial = fresh_partial()
            start = time.perf_counter()
            if sealed:
                ckpt.save(state, partial, full=False, is_global_zero=zero)
            else:  # the same without the checksums: shards, then meta.pt
                tensors, rest = ckpt.split_sharded(state)
                dcp.save(tensors, checkpoint_id=partial)
                if zero:
                    atomic.write_durably(partial / ckpt.META_FILE, lambda f: torch.save(rest, f))
            publish(partial)
            return time.perf_counter() - start

        return run

    saves = AsyncSaves()
    group = dist.new_group(backend="gloo")

    def background(sealed: bool) -> Callable[[], tuple[float, float]]:
        def run() -> tuple[float, float]:
            partial = fresh_partial()
            start = time.perf_counter()
            tensors, rest = ckpt.split_sharded(state)
            meta = saves._copy.copy(rest, "meta") if zero else None
            shards = dcp.async_save(tensors, checkpoint_id=partial, process_group=group, async_stager=saves.stager())
            blocked = time.perf_counter() - start
            getattr(shards, "upload_completion", shards).result()
            if sealed:
                files = ckpt.gather_checksums(partial, group)
                if meta is not None:
                    ckpt.write_meta(meta, partial, files)
            elif meta is not None:
                atomic.write_durably(partial / ckpt.META_FILE, lambda f: torch.save(meta, f))
            publish(partial)
            return blocked, time.perf_counter() - start

        return run

    t = alternate(repeats, {"plain": sync(False), "sealed": sync(True)})
    a = alternate(repeats, {"plain": background(False), "sealed": background(True)})
    if zero:
        assert atomic.verify(target) == (target, True)
    results = [None] * world
    dist.all_gather_object(results, (t, a))
    if zero:
        torch.save(results, out)
    dist.destroy_process_group()


def sharded(mb: int, repeats: int, directory: Path) -> list[str]:
    out = directory / "sharded.pt"
    port = 29500 + os.getpid() % 1000
    mp.spawn(_sharded_worker, args=(2, mb, repeats, str(directory), port, str(out)), nprocs=2)
    results = torch.load(out, weights_only=False)
    slowest = {  # per round, the slower rank
        arm: [max(rank[0][arm][i] for rank in results) for i in range(repeats)] for arm in ("plain", "sealed")
    }
    blocked = {arm: [max(r[1][arm][i][0] for r in results) for i in range(repeats)] for arm in ("plain", "sealed")}
    total = {arm: [max(r[1][arm][i][1] for r in results) for i in range(repeats)] for arm in ("plain", "sealed")}
    size = sum(p.stat().st_size for p in (directory / "sharded.ckpt").iterdir()) / 1e6
    plain, sealed = median_ms(slowest["plain"]), median_ms(slowest["sealed"])
    b = {k: median_ms(v) for k, v in blocked.items()}
    w = {k: median_ms(v) for k, v in total.items()}
    return [
        f"  two processes (gloo), sharded DCP, {size:.1f} MB on disk:",
        f"    synchronous save: without checksums {plain:.1f} ms, with {sealed:.1f} ms, ratio {sealed / plain:.2f}",
        f"    async, the step blocked: without {b['plain']:.1f} ms, with {b['sealed']:.1f} ms, ratio "
        f"{b['sealed'] / b['plain']:.2f}; the background write: without {w['plain']:.1f} ms, with "
        f"{w['sealed']:.1f} ms, ratio {w['sealed'] / w['plain']:.2f}",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", default="64,256", help="checkpoint sizes in MB, comma-separated")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"the cost of checksums on a save ({checksums.ALGORITHM}; median of {args.repeats}, alternating):")
    for mb in (int(m) for m in args.mb.split(",")):
        with tempfile.TemporaryDirectory(dir=Path.cwd()) as tmp:
            for line in one_process(mb, args.repeats, Path(tmp)) + sharded(mb, args.repeats, Path(tmp)):
                print(line, flush=True)


if __name__ == "__main__":
    main()
