"""The random number generator states a process draws from, captured and put back, so that a resumed run draws
what the uninterrupted run drew: dropout masks, random augmentation, noise, sampling.

One process's states: torch's CPU generator, every initialised CUDA device's, NumPy's global ``RandomState`` (when
NumPy is installed) and Python's ``random``. The HF Trainer saves the same four per process
(``rng_state_<rank>.pth``); each rank has its own, so a checkpoint holds one set per rank (gathered with
:func:`lightning_stability.ranks.gather_objects`). A rank that a resume on more processes adds has none saved: it
gets :func:`derive`'s.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

import torch

try:  # NumPy is optional
    import numpy as np
except ImportError:  # pragma: no cover
    np = None  # type: ignore[assignment]


def capture() -> dict[str, Any]:
    """This process's generator states (CPU tensors and plain Python objects: picklable, small)."""
    states: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if np is not None:
        states["numpy"] = _numpy_state(np.random.get_state(legacy=True))
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def capture_torch() -> dict[str, Any]:
    """torch's generator states only (CPU, and every initialised CUDA device's): what dropout and ``torch.rand*``
    draw from, ~1 us (NumPy's capture alone costs ~50 us). :func:`restore` puts them back."""
    states: dict[str, Any] = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def _numpy_state(state: Any) -> tuple[str, torch.Tensor, int, int, float]:
    """NumPy's legacy state as a tensor and plain numbers: a checkpoint loads with ``torch.load(weights_only=True)``."""
    name, keys, pos, has_gauss, gauss = state
    return str(name), torch.from_numpy(np.asarray(keys).astype(np.int64)), int(pos), int(has_gauss), float(gauss)


def restore(states: dict[str, Any]) -> list[str]:
    """Put back states from :func:`capture` (or :func:`capture_torch`: the generators it holds); returns the
    generators it could not restore (and why)."""
    problems = []
    torch.set_rng_state(states["torch"])
    if "python" in states:
        random.setstate(states["python"])
    if "numpy" in states:
        if np is not None:
            name, keys, pos, has_gauss, gauss = states["numpy"]
            np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
        else:
            problems.append("NumPy's (NumPy is not installed here)")
    if "cuda_seed" in states and torch.cuda.is_available():
        torch.cuda.manual_seed_all(int(states["cuda_seed"]))
    if "cuda" in states:
        saved = states["cuda"]
        if torch.cuda.is_available() and torch.cuda.device_count() == len(saved):
            torch.cuda.set_rng_state_all(saved)
        else:
            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            problems.append(f"CUDA's (saved for {len(saved)} devices, {count} here)")
    return problems


def derive(states: dict[str, Any], rank: int) -> dict[str, Any]:
    """New states for ``rank`` from another rank's ``states`` (for :func:`restore`): every generator seeded from a
    hash of ``states``' torch state and ``rank``. The same for every resume from the same states, different for
    each rank (two ranks drawing the same dropout masks on different samples would correlate them), and unlike
    any stream the saved run drew from."""
    digest = hashlib.sha256(states["torch"].numpy().tobytes() + rank.to_bytes(8, "little")).digest()
    seed = int.from_bytes(digest[:8], "little") >> 1  # below 2**63: torch's manual_seed takes it
    derived: dict[str, Any] = {
        "torch": torch.Generator().manual_seed(seed).get_state(),
        "python": random.Random(seed).getstate(),
        "cuda_seed": seed,
    }
    if np is not None:
        derived["numpy"] = _numpy_state(np.random.RandomState(seed % 2**32).get_state(legacy=True))
    return derived
