"""The ranks of a run: how many, which one, and values made alike on every rank.

Every package asks here, so that "is this run distributed" has one answer: ``torch.distributed`` is available and
its default process group exists. Without one (a single process, or a torch built without distributed) the run
has one rank, rank 0, and every reduction returns its input unchanged, with no collective.

* :func:`is_distributed`, :func:`world_size`, :func:`rank`;
* on device tensors, one all-reduce each, no host read (safe inside the step): :func:`any_rank` and
  :func:`all_ranks` (a flag true on any / on every rank), :func:`max_` and :func:`min_` (in place),
  :func:`mean` (a new tensor), :func:`gather` (every rank's tensor, stacked);
* on host objects (pickled; a host read, for decisions outside the step): :func:`gather_objects`.

Each reduction is a collective: every rank of ``group`` calls it at the same point, with tensors of the same shape
and dtype. ``group``: the process group to reduce over (``None``: the default group).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor


def is_distributed() -> bool:
    """Whether ``torch.distributed`` is available and its default process group exists."""
    return dist.is_available() and dist.is_initialized()


def world_size(group: Any = None) -> int:
    """The number of ranks in ``group`` (the default group: all of them); 1 when not distributed."""
    return dist.get_world_size(group) if is_distributed() else 1


def rank(group: Any = None) -> int:
    """This process's rank in ``group`` (the default group: its global rank); 0 when not distributed."""
    return dist.get_rank(group) if is_distributed() else 0


def _reduce_(values: Tensor, op: Any, group: Any) -> Tensor:
    if world_size(group) > 1:
        dist.all_reduce(values, op=op, group=group)
    return values


def any_rank(flag: Tensor, group: Any = None) -> Tensor:
    """A bool tensor, true on every rank when ``flag`` (bool or number, any shape) is true (non-zero) on any; a
    max over ranks. ``flag`` itself when there is one rank."""
    if world_size(group) < 2:
        return flag
    return _reduce_(flag.to(torch.float32), dist.ReduceOp.MAX, group) > 0


def all_ranks(flag: Tensor, group: Any = None) -> Tensor:
    """A bool tensor, true on every rank when ``flag`` (bool or number, any shape) is true (non-zero) on every
    rank; a min over ranks. ``flag`` itself when there is one rank."""
    if world_size(group) < 2:
        return flag
    return _reduce_((flag != 0).to(torch.float32), dist.ReduceOp.MIN, group) > 0


def max_(values: Tensor, group: Any = None) -> Tensor:
    """``values`` max-reduced over ranks in place, and returned."""
    return _reduce_(values, dist.ReduceOp.MAX, group)


def min_(values: Tensor, group: Any = None) -> Tensor:
    """``values`` min-reduced over ranks in place, and returned."""
    return _reduce_(values, dist.ReduceOp.MIN, group)


def mean(values: Tensor, group: Any = None) -> Tensor:
    """The mean of ``values`` over ranks (their sum, then divided by the world size), a new tensor; ``values``
    itself when there is one rank. ``values`` is left as it is."""
    count = world_size(group)
    if count < 2:
        return values
    total = values.clone()
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    return total / count


def gather(value: Tensor, group: Any = None) -> Tensor:
    """Every rank's ``value``, stacked in rank order: shape ``(world_size, *value.shape)``, ``value``'s dtype, on
    every rank (one all-gather). One rank: ``value`` with a leading dim of 1."""
    count = world_size(group)
    if count < 2:
        return value.reshape(1, *value.shape)
    out = torch.empty(count * value.numel(), dtype=value.dtype, device=value.device)
    dist.all_gather_into_tensor(out, value.contiguous().reshape(-1), group=group)
    return out.view(count, *value.shape)


def gather_objects(local: Any, group: Any = None) -> list[Any]:
    """Every rank's ``local`` (any picklable object), on every rank, in rank order (one ``all_gather_object``).
    One rank: ``[local]``."""
    count = world_size(group)
    if count < 2:
        return [local]
    out: list[Any] = [None] * count
    dist.all_gather_object(out, local, group=group)
    return out
