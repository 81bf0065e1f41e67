"""Values across data-parallel ranks: their mean (every rank decides from the same numbers), and the replica
check: gather each rank's gradient norm and name a rank that disagrees (``GradientNormMonitor(check_replicas=True)``),
a cheap detector of a faulty device."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor


def mean_over_ranks(values: Tensor) -> Tensor:
    """The mean over ranks (one all-reduce; ``values`` itself when not distributed): every rank then decides from
    the same numbers."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
        values = values / dist.get_world_size()
    return values


def gather_from_ranks(value: Tensor) -> Tensor:
    """Every rank's ``value`` (0-dim), gathered into a vector on every rank: one small all-gather."""
    world = dist.get_world_size()
    out = torch.empty(world, dtype=torch.float32, device=value.device)
    dist.all_gather_into_tensor(out, value.detach().to(torch.float32).reshape(1))
    return out


def warn_disagreeing_replicas(norms: list[float], step: int, rel_tol: float = 1e-5) -> None:
    """Warn, naming the ranks, when data-parallel replicas measured different gradient norms.

    Replicas hold identical gradients after the all-reduce (and sharded norms are reduced across the mesh),
    so every rank measures the same global norm. A rank that differs computed or received other gradients:
    a faulty device (silent data corruption) or a hook that changed one rank's gradients. Its weights will
    drift from the others'. The reference is the value a strict majority of ranks agree on, or else rank 0's.
    """

    def same(a: float, b: float) -> bool:
        return a == b or (math.isfinite(a) and math.isfinite(b) and abs(a - b) <= rel_tol * max(abs(a), abs(b)))

    majority = [v for v in norms if sum(same(v, w) for w in norms) * 2 > len(norms)]
    reference, source = (majority[0], "most ranks") if majority else (norms[0], "rank 0 (no majority)")
    bad = [rank for rank, v in enumerate(norms) if not same(v, reference)]
    if bad:
        shown = ", ".join(f"rank {r}: {norms[r]:.6g}" for r in bad)
        rank_zero_warn(
            f"Gradient norms disagree across data-parallel replicas at optimizer step {step}: {source} measured "
            f"{reference:.6g}, but {shown}. Replicas hold the same all-reduced gradients, so the rank(s) named "
            "computed or received different gradients: a faulty device (silent data corruption) or a hook that "
            "edits one rank's gradients. Their weights will drift apart. Fix: check that device (rerun the step "
            "there, run a GPU memory test) or the hook.",
            category=RuntimeWarning,
        )
