"""BatchNorm under gradient accumulation: find the layers, warn, or convert them (GroupNorm, SyncBatchNorm).

Under accumulation a BatchNorm layer normalises with the statistics of one micro-batch, not of the
accumulated batch, and its running averages move once per micro-batch. This module finds such layers and
replaces them; it takes no Lightning objects: the caller says how many ranks and which device.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from lightning_stability import _compat
from lightning_stability.errors import config_error

__all__ = [
    "BATCHNORM_MODES",
    "accumulation_warning",
    "batchnorm_modules",
    "check_sync_batchnorm",
    "convert_to_group_norm",
    "convert_to_sync_batchnorm",
    "groups_for",
    "handle_batchnorm",
]

#: The ``batchnorm`` choices of GradientAccumulation.
BATCHNORM_MODES = ("warn", "ignore", "group_norm", "sync_batchnorm")


def groups_for(channels: int, max_groups: int = 32) -> int:
    """The largest divisor of ``channels`` that is at most ``max_groups``: GroupNorm's group count."""
    return max(g for g in range(1, min(max_groups, channels) + 1) if channels % g == 0)


def batchnorm_modules(module: nn.Module) -> list[str]:
    """Qualified names of every BatchNorm layer below ``module``."""
    return [name for name, m in module.named_modules() if _compat.is_batchnorm(m)]


def convert_to_group_norm(module: nn.Module) -> None:
    """Replace every BatchNorm{1,2,3}d below ``module`` by a GroupNorm with the same channels and affine."""
    for name, child in module.named_children():
        if _compat.is_batchnorm(child):
            gn = nn.GroupNorm(groups_for(child.num_features), child.num_features, eps=child.eps, affine=child.affine)
            if child.affine:
                gn = gn.to(device=child.weight.device, dtype=child.weight.dtype)
                gn.weight.data.copy_(child.weight.data)
                gn.bias.data.copy_(child.bias.data)
            setattr(module, name, gn)
        else:
            convert_to_group_norm(child)


def check_sync_batchnorm(world_size: int, device_type: str) -> None:
    """Raise a ``StabilityConfigError`` unless torch's SyncBatchNorm can run: several ranks, on GPUs."""
    if world_size < 2:
        raise config_error(
            "batchnorm",
            "sync_batchnorm",
            f"needs DDP with several processes (world_size={world_size})",
            "use batchnorm='group_norm', or run with devices >= 2",
        )
    if device_type not in ("cuda", "hpu", "xpu", _compat.privateuse1_backend_name()):
        # torch's SyncBatchNorm raises in its first forward on any other device
        raise config_error(
            "batchnorm",
            "sync_batchnorm",
            f"needs GPUs, but this run trains on {device_type!r} (torch's SyncBatchNorm runs on GPUs only)",
            "use batchnorm='group_norm'",
        )


def convert_to_sync_batchnorm(module: nn.Module) -> None:
    """Replace every BatchNorm layer below ``module`` (its children's subtrees) by a SyncBatchNorm."""
    for name, child in list(module.named_children()):
        setattr(module, name, nn.SyncBatchNorm.convert_sync_batchnorm(child))


def accumulation_warning(names: list[str], max_factor: int) -> str:
    """The warning for BatchNorm layers ``names`` under up to ``max_factor`` micro-batches per step."""
    return (
        f"BatchNorm layers {names[:5]}{' ...' if len(names) > 5 else ''} under gradient accumulation "
        f"(up to {max_factor} micro-batches per step): their batch statistics and running "
        "averages see one micro-batch at a time, not the accumulated batch, so they are noisier than "
        "the effective batch size suggests. Pass GradientAccumulation(batchnorm='group_norm') to use "
        "GroupNorm (batch-independent), 'sync_batchnorm' under DDP, or 'ignore' to silence this."
    )


def handle_batchnorm(
    module: nn.Module,
    mode: str,
    max_factor: int,
    world_size: int,
    device_type: str,
    warn: Callable[[str], None],
) -> None:
    """Apply ``mode`` (one of :data:`BATCHNORM_MODES`) to the BatchNorm layers of ``module``.

    Call it before the optimizer is built: the conversions replace parameters.
    """
    names = batchnorm_modules(module)
    if not names or mode == "ignore":
        return
    if mode == "warn":
        warn(accumulation_warning(names, max_factor))
    elif mode == "group_norm":
        convert_to_group_norm(module)
    else:
        check_sync_batchnorm(world_size, device_type)
        convert_to_sync_batchnorm(module)
