"""The fp16 scaler's overflow flag of one optimizer step: the flags of every device in one, the same on every rank.

torch's unscale records one flag per device the gradients live on. :func:`combine_flags` makes them one
0-dim flag on the scale's device, and :func:`max_across_ranks` max-reduces it over a process group, so an inf
in one rank's gradient (or one shard) makes every rank skip and back off alike.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


def combine_flags(per_device: dict[torch.device, Tensor], device: torch.device) -> Tensor:
    """One 0-dim flag on ``device``: the largest of ``per_device`` (0 when there are none: a rank without
    gradients still joins the collective)."""
    flags = [f if f.device == device else f.to(device, non_blocking=True) for f in per_device.values()]
    if len(flags) == 1:
        return flags[0]
    return torch.stack(flags).amax() if flags else torch.zeros((), dtype=torch.float32, device=device)


def max_across_ranks(flag: Tensor, group: ProcessGroup | None) -> Tensor:
    """``flag`` max-reduced in place over ``group`` (one 0-dim collective) when more than one rank runs."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return flag
