"""Pure: the update-to-weight ratio per layer, ``||update|| / ||weights||`` over each layer's tensors, on the device.

A layer is a numbered block (the name up to its first numeric part: ``blocks.layers.3`` for
``blocks.layers.3.self_attn.in_proj_weight``, ``model.layers.0`` in Hugging Face models); a tensor outside any
numbered block is its own module's (``embed``, ``lm_head``). The per-layer ratio is the norm of the layer's
update over the norm of its weights, both combined from per-tensor norms (:func:`lightning_stability.norms.
group_norms`), so sharded tensors count whole.

The update norms come either from a copy taken before the step (``||theta_after - theta_before||``, the health
monitor's ``UpdateSize``), or, for Adam-like optimizers, copy-free from the state:
:attr:`~lightning_stability.precursors.adam.AdamUpdates.norms` (``||lr * m_hat / (sqrt(v_hat) + eps)||``,
decoupled weight decay left out).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_stability.norms import group_norms


def layer_of(name: str) -> str:
    """The layer of a parameter's qualified name: up to its first numeric part, else its module."""
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return ".".join(parts[:-1]) if len(parts) > 1 else name


def layer_groups(names: Sequence[str]) -> tuple[list[int], list[str]]:
    """Each name's layer (:func:`layer_of`) as an index into the returned list of layers, in first-seen order."""
    layers: dict[str, int] = {}
    index = [layers.setdefault(layer_of(n), len(layers)) for n in names]
    return index, list(layers)


def update_to_weight_ratios(update_norms: Tensor, weight_norms: Tensor, index: Tensor, layers: int) -> Tensor:
    """``(layers,)``: per layer, the 2-norm of its tensors' update norms over that of their weight norms.

    ``index``: each tensor's layer (int64, on the norms' device; build it once). A layer with zero weights
    gets ``inf`` if it moved, else 0.
    """
    updates = group_norms(update_norms.float(), index, layers)
    weights = group_norms(weight_norms.float(), index, layers)
    return updates / weights.clamp(min=torch.finfo(torch.float32).tiny)
