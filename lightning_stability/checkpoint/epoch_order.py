"""An epoch's global sample order, rebuilt from a checkpoint and dealt out to any number of processes: what lets a
run resume mid-epoch on another world size with the same global batch.

Under DDP and FSDP Lightning gives each training loader a ``DistributedSampler``: its epoch order is one
permutation of the dataset drawn from ``seed + epoch`` (padded or cut to a multiple of the world size ``W``),
and rank ``r`` takes the positions ``r, r + W, r + 2W, ...``. With ``B`` samples per rank and batch, the ``j``-th
batch of every rank together is ``order[j*G:(j+1)*G]``, ``G = W * B``. One process (its loader's own
``RandomSampler`` or ``SequentialSampler``) batches its order the same way with ``G = B``. So a global batch is a
slice of one list whatever the world size: after ``k`` batches the epoch has consumed ``order[:k*G]``, and
``W'`` processes with ``B' = G / W'`` go on exactly by dealing ``order[k*G:]`` as a ``DistributedSampler`` would
(:func:`deal`). Each global batch holds the same samples; only the sum over them is reduced in another order.

:func:`describe` records the order of the epoch a sampler is in (a few numbers, and for a ``RandomSampler`` the
RNG states it drew its permutation from), :func:`rebuild` draws it again on any process.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import BatchSampler, DistributedSampler, RandomSampler, SequentialSampler

from lightning_stability.checkpoint import rng


def describe(batch_sampler: Any, start: dict[str, Any] | None) -> dict[str, Any] | None:
    """The recipe of the current epoch's global order of ``batch_sampler`` (a loader's ``BatchSampler``), ``start``
    being the RNG states its iteration began with (``ReplayableSampler.start``); ``None`` when the order cannot be
    rebuilt elsewhere: another batch sampler, a sampler other than torch's ``DistributedSampler``,
    ``RandomSampler`` (without replacement, one pass) and ``SequentialSampler``."""
    if type(batch_sampler) is not BatchSampler:
        return None
    sampler: Any = batch_sampler.sampler
    kind = type(sampler)
    if kind is DistributedSampler:
        return {
            "kind": "distributed",
            "size": len(sampler.dataset),
            "replicas": sampler.num_replicas,
            "seed": sampler.seed,
            "shuffle": sampler.shuffle,
            "epoch": sampler.epoch,
            "drop_last": sampler.drop_last,
        }
    if kind is SequentialSampler:
        return {"kind": "sequential", "size": len(sampler.data_source)}
    if kind is RandomSampler and start is not None:
        size = len(sampler.data_source)
        if sampler.replacement or sampler.num_samples != size:
            return None
        return {"kind": "random", "size": size, "start": start, "generator": sampler.generator is not None}
    return None


def rebuild(recipe: dict[str, Any]) -> list[int]:
    """The global order :func:`describe` recorded (this process's RNG states are left as they were)."""
    size = int(recipe["size"])
    if recipe["kind"] == "sequential":
        return list(range(size))
    if recipe["kind"] == "distributed":
        world = int(recipe["replicas"])
        shares = []
        for rank in range(world):  # torch's own sampler, so that its padding and shuffling are what ran
            sampler: DistributedSampler[int] = DistributedSampler(
                range(size),  # type: ignore[arg-type]
                num_replicas=world,
                rank=rank,
                shuffle=bool(recipe["shuffle"]),
                seed=int(recipe["seed"]),
                drop_last=bool(recipe["drop_last"]),
            )
            sampler.set_epoch(int(recipe["epoch"]))
            shares.append(list(sampler))
        return [shares[p % world][p // world] for p in range(world * len(shares[0]))]
    start = recipe["start"]
    generator = None
    if recipe["generator"]:
        generator = torch.Generator()
        generator.set_state(start["generators"][-1])  # the RandomSampler's own (a BatchSampler has none)
    outside = rng.capture()
    try:
        rng.restore(start["global"])  # without a generator, RandomSampler seeds itself from torch's global one
        return list(RandomSampler(range(size), generator=generator))
    finally:
        rng.restore(outside)


def deal(order: list[int], start: int, rank: int, world: int, batch_size: int, drop_last: bool) -> list[list[int]]:
    """Rank ``rank``'s batches of ``order[start:]`` among ``world`` processes, as a ``DistributedSampler`` and a
    ``BatchSampler(batch_size, drop_last)`` deal: the positions ``start + rank``, ``start + rank + world``, ...
    (``start`` is a multiple of ``world``), ``batch_size`` at a time."""
    mine = order[start + rank :: world]
    batches = [mine[i : i + batch_size] for i in range(0, len(mine), batch_size)]
    if drop_last and batches and len(batches[-1]) < batch_size:
        batches.pop()
    return batches
