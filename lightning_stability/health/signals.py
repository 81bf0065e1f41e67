"""The health monitor's measurements: update size, peak memory and its capacity, means over ranks.

* Update size, ``‖Δθ‖ / ‖θ‖`` in total and per module, on logging steps only: :class:`UpdateSize` keeps one
  transient copy of the local shard of the parameters from before the update, turns it into the update in place
  afterwards, and takes the norms (sharded parameters are reduced across their mesh, as for gradient norms).
  Other steps get no extra memory.
* Peak memory of this process (:func:`peak_memory`) and the capacity it must fit in (:func:`capacity`): CUDA's
  caching allocator statistics on a GPU, the RSS from ``resource.getrusage`` on a CPU. Host-side counters only,
  no device sync; the monitor reads them on logging steps and takes the maximum over ranks.
"""

from __future__ import annotations

import os
import resource
import sys

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_stability import _compat
from lightning_stability.norms import DTensor, combine_norms, group_norms, is_dtensor, local_tensor, per_tensor_norms


class UpdateSize:
    """Started right before an update (:meth:`__init__`), finished right after it (:meth:`finish`).

    Args:
        params: the parameters the optimizer updates.
        module_index: each parameter's module, as an int64 vector on the device.
        n_modules: the number of modules.
    """

    def __init__(self, params: list[Tensor], module_index: Tensor, n_modules: int) -> None:
        self.params, self.module_index, self.n_modules = params, module_index, n_modules
        with torch.no_grad():
            self.weight_norms = per_tensor_norms([p.detach() for p in params])
            self._before = [local_tensor(p).detach().clone() for p in params]  # the one transient copy

    def finish(self) -> tuple[Tensor, Tensor]:
        """``(total, per_module)`` update-to-weight ratios (device tensors); frees the copy."""
        with torch.no_grad():
            after = [local_tensor(p).detach() for p in self.params]
            _compat.foreach_sub_(self._before, after)  # before - after: the update, negated, in place
            deltas = [
                DTensor.from_local(d, p.device_mesh, p.placements, run_check=False) if is_dtensor(p) else d  # type: ignore[attr-defined]
                for d, p in zip(self._before, self.params, strict=True)
            ]
            update_norms = per_tensor_norms(deltas)
        self._before = []
        eps = torch.finfo(torch.float32).tiny
        total = combine_norms(update_norms) / combine_norms(self.weight_norms).clamp(min=eps)
        per_module = group_norms(update_norms, self.module_index, self.n_modules) / group_norms(
            self.weight_norms, self.module_index, self.n_modules
        ).clamp(min=eps)
        return total, per_module


GiB = float(1 << 30)


def peak_memory(device: torch.device) -> tuple[float, float]:
    """``(peak, second)`` in GiB since the start (or the last reset): on CUDA the peak allocated and the peak
    reserved by the caching allocator; elsewhere the process's peak resident set size, twice."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / GiB, torch.cuda.max_memory_reserved(device) / GiB
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rss_bytes = rss if sys.platform == "darwin" else rss * 1024  # bytes on macOS, KiB on Linux
    return rss_bytes / GiB, rss_bytes / GiB


def peak_memory_over_ranks(device: torch.device) -> torch.Tensor:
    """``[peak, second]`` of :func:`peak_memory` as a device tensor, the max over ranks (one collective: logging
    steps only)."""
    peak, second = peak_memory(device)
    # fills with host scalars: no host-to-device copy
    memory = torch.stack([torch.full((), v, dtype=torch.float32, device=device) for v in (peak, second)])
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(memory, op=dist.ReduceOp.MAX)
    return memory


def capacity(device: torch.device) -> float | None:
    """The memory the peak must fit in, GiB: the GPU's total memory, or the host's RAM (a cgroup limit if lower)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory / GiB
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return total / GiB


def memory_warning(peak: float, total: float | None, fraction: float) -> str | None:
    """The warning to give when ``peak`` (GiB) passes ``fraction`` of ``total``, else ``None``."""
    if total is None or peak < fraction * total:
        return None
    return (
        f"TrainingHealthMonitor: peak memory {peak:.2f} GiB is {100 * peak / total:.0f}% of the {total:.2f} GiB "
        "available: close to out-of-memory. Fix: a smaller micro-batch with more gradient accumulation, activation "
        "checkpointing, or sharding (StableFSDPStrategy)."
    )


def mean_over_ranks(values: Tensor) -> Tensor:
    """The mean over ranks (one all-reduce; ``values`` itself when not distributed): every rank then decides from
    the same numbers."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
        values = values / dist.get_world_size()
    return values
