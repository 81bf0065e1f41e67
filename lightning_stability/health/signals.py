"""The health monitor's measurements: peak memory and its capacity (the update size is the
step's: ``lightning_stability.ledger.update.UpdateSize``).

* Peak memory of this process (:func:`peak_memory`) and the capacity it must fit in (:func:`capacity`): CUDA's
  caching allocator statistics on a GPU, the RSS from ``resource.getrusage`` on a CPU. Host-side counters only,
  no device sync; the monitor reads them on logging steps and takes the maximum over ranks.
"""

from __future__ import annotations

import os
import resource
import sys

import torch

from lightning_stability import ranks

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
    return ranks.max_(memory)


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
