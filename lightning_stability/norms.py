"""Gradient norms without host synchronisation.

Pure functions: they take lists of tensors and return tensors. Nothing here calls ``.item()``.

* Plain tensors (single device, DDP) are grouped by device and dtype and measured with torch's fused
  ``foreach`` norm, once per group (:func:`lightning_stability._compat.foreach_norm`), accumulating in fp32.
* Sharded tensors (``DTensor``, e.g. FSDP2 parameters) are measured on their local shard and the
  per-tensor results are reduced across the shard dimensions of their mesh with **one** collective
  per (mesh, placements) group, so the norm is the norm of the whole gradient, never of one shard.
  Every placement that splits a tensor counts as a shard dimension, also torch's ``_StridedShard`` (what
  FSDP2 gives a tensor-parallel parameter when both shard the same dim; not a ``Shard`` subclass in torch
  2.13). ``Replicate`` dimensions are not reduced: a replicated tensor counts once, not once per rank.
* A ``Partial`` tensor (a sequence-parallel norm's gradient, still a sum pending over the tensor-parallel
  ranks) is first reduced to what it stands for, one collective per tensor; its local part is not the
  gradient, and its norm would differ from rank to rank.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_stability import _compat

try:  # DTensor is public from torch 2.5
    from torch.distributed.tensor import DTensor, Partial, Replicate
except ImportError:  # pragma: no cover - torch built without distributed
    DTensor = None  # type: ignore[assignment,misc]


def is_dtensor(t: Tensor) -> bool:
    """Whether ``t`` is a sharded (or replicated) ``DTensor``."""
    return DTensor is not None and isinstance(t, DTensor)


def local_tensor(t: Tensor) -> Tensor:
    """This rank's part of ``t``: a ``DTensor``'s local shard, any other tensor itself."""
    return t.to_local() if is_dtensor(t) else t  # type: ignore[attr-defined]


def _foreach_norm_fp32(tensors: list[Tensor], norm_type: float) -> tuple[Tensor, ...]:
    """torch's fused ``foreach`` norm; low-precision tensors accumulate in fp32."""
    dtype = tensors[0].dtype
    if dtype is torch.float32:
        return _compat.foreach_norm(tensors, norm_type)
    if dtype is torch.float64:
        return tuple(n.float() for n in _compat.foreach_norm(tensors, norm_type))
    return _compat.foreach_norm(tensors, norm_type, dtype=torch.float32)


def is_uniform(tensors: Sequence[Tensor]) -> bool:
    """Whether ``tensors`` are plain (not sharded), non-empty, and all of one device and dtype: then
    :func:`per_tensor_norms` and :func:`scale_` take the fused ``foreach`` path directly, with ``uniform=True`` and
    no per-tensor checks. The answer holds for the gradients of the same parameters on every step (torch keeps a
    gradient's device, dtype and shape those of its parameter), so callers work it out once per parameter list."""
    if not tensors:
        return False
    first = tensors[0]
    device, dtype = first.device, first.dtype
    return all(not is_dtensor(t) and t.numel() > 0 and t.dtype is dtype and t.device == device for t in tensors)


def _local_norms(tensors: Sequence[Tensor], norm_type: float) -> Tensor:
    """Per-tensor norms (fp32) of plain tensors, stacked on the first tensor's device."""
    if any(t.numel() == 0 for t in tensors):
        # An empty local shard (uneven sharding) has norm 0; the inf-norm of an empty tensor would raise.
        tensors = [t if t.numel() else t.new_zeros(1) for t in tensors]
    buckets: dict[tuple[torch.device, torch.dtype], list[int]] = defaultdict(list)
    for i, t in enumerate(tensors):
        buckets[(t.device, t.dtype)].append(i)
    if len(buckets) == 1:  # the common case: one device, one dtype, already in order
        return torch.stack(_foreach_norm_fp32(list(tensors), norm_type))
    out_device = tensors[0].device
    ordered: list[Tensor] = [tensors[0]] * len(tensors)  # placeholders, all overwritten below
    for idx in buckets.values():
        for i, norm in zip(idx, _foreach_norm_fp32([tensors[i] for i in idx], norm_type), strict=True):
            ordered[i] = norm.to(out_device, non_blocking=True)
    # Stacked back in input order; no index tensor is built from host data (a blocking copy on a GPU).
    return torch.stack(ordered)


def _splits(placement: object) -> bool:
    """Whether a placement splits the tensor along its mesh dimension (``Shard``, ``_StridedShard``, ...)."""
    return not placement.is_replicate() and not placement.is_partial()  # type: ignore[attr-defined]


def _reduce_pending(t: Tensor) -> Tensor:
    """A ``DTensor`` with ``Partial`` placements redistributed to ``Replicate`` there (one collective); else ``t``."""
    placements = t.placements  # type: ignore[attr-defined]
    if not any(p.is_partial() for p in placements):
        return t
    target = [Replicate() if p.is_partial() else p for p in placements]
    return t.redistribute(t.device_mesh, target)  # type: ignore[attr-defined]


def _reduce_sharded(local: Tensor, norm_type: float, mesh: object, placements: tuple[object, ...]) -> Tensor:
    """Combine per-shard norms into global per-tensor norms with one collective."""
    if math.isinf(norm_type):
        partial = Partial("max")
        value = local
    else:
        partial = Partial("sum")
        value = local.pow(norm_type)
    reduced_placements = [partial if _splits(p) else Replicate() for p in placements]
    if not any(isinstance(p, Partial) for p in reduced_placements):
        return local
    full = DTensor.from_local(value, mesh, reduced_placements, run_check=False).full_tensor()  # type: ignore[arg-type]
    return full if math.isinf(norm_type) else full.pow(1.0 / norm_type)


def per_tensor_norms(tensors: Sequence[Tensor], norm_type: float = 2.0, uniform: bool = False) -> Tensor:
    """The ``norm_type``-norm of every tensor, as one fp32 vector (no host sync).

    Sharded ``DTensor`` inputs get the norm of the whole (unsharded) tensor. ``uniform``: the caller knows
    :func:`is_uniform` holds for ``tensors`` (skips the per-tensor checks).
    """
    if uniform:
        return torch.stack(_foreach_norm_fp32(list(tensors), norm_type))
    if not tensors:
        return torch.zeros(0, dtype=torch.float32)
    plain_idx = [i for i, t in enumerate(tensors) if not is_dtensor(t)]
    if len(plain_idx) == len(tensors):
        return _local_norms(tensors, norm_type)
    tensors = [_reduce_pending(t) if is_dtensor(t) else t for t in tensors]
    sharded: dict[tuple[object, tuple[object, ...]], list[int]] = defaultdict(list)
    for i, t in enumerate(tensors):
        if is_dtensor(t):
            sharded[(t.device_mesh, tuple(t.placements))].append(i)  # type: ignore[attr-defined]
    first = tensors[0]
    device = local_tensor(first).device
    ordered: list[Tensor] = [first] * len(tensors)  # placeholders, all overwritten below
    groups: list[tuple[list[int], Tensor]] = []
    if plain_idx:
        groups.append((plain_idx, _local_norms([tensors[i] for i in plain_idx], norm_type)))
    for (mesh, placements), idx in sharded.items():
        local = _local_norms([local_tensor(tensors[i]) for i in idx], norm_type)
        groups.append((idx, _reduce_sharded(local, norm_type, mesh, placements)))
    for idx, norms in groups:
        for i, norm in zip(idx, norms.to(device, non_blocking=True).unbind(), strict=True):
            ordered[i] = norm
    # Stacked back in input order; no index tensor is built from host data (a blocking copy on a GPU).
    return torch.stack(ordered)


def per_tensor_norms_of_parts(parts: Sequence[Tensor], wholes: Sequence[Tensor], norm_type: float = 2.0) -> Tensor:
    """:func:`per_tensor_norms` of tensors computed shard by shard: ``parts[i]`` is this rank's part of a tensor laid
    out like ``wholes[i]`` (a ``DTensor``'s local shard, or for a plain tensor the whole tensor). The norms are
    those of the whole tensors, reduced over the shards as :func:`per_tensor_norms` reduces ``wholes``.
    """
    if not any(is_dtensor(w) for w in wholes):
        return per_tensor_norms(parts, norm_type)
    laid_out = [
        DTensor.from_local(
            part,
            whole.device_mesh,  # type: ignore[attr-defined]
            whole.placements,  # type: ignore[attr-defined]
            run_check=False,
            shape=whole.shape,
            stride=whole.stride(),
        )
        if is_dtensor(whole)
        else part
        for part, whole in zip(parts, wholes, strict=True)
    ]
    return per_tensor_norms(laid_out, norm_type)


def combine_norms(norms: Tensor, norm_type: float = 2.0) -> Tensor:
    """The norm of a concatenation, from the norms of its parts."""
    if norms.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=norms.device)
    return torch.linalg.vector_norm(norms, norm_type)


def group_norms(norms: Tensor, group_index: Tensor, num_groups: int, norm_type: float = 2.0) -> Tensor:
    """Combine per-tensor norms into per-group norms (e.g. per module), on the device.

    Args:
        norms: per-tensor norms, shape ``(N,)``.
        group_index: group id of each tensor, shape ``(N,)``, int64, same device.
        num_groups: number of groups ``G``; the result has shape ``(G,)``.
        norm_type: the p of the p-norm.
    """
    out = torch.zeros(num_groups, dtype=norms.dtype, device=norms.device)
    if math.isinf(norm_type):
        return out.scatter_reduce_(0, group_index, norms, reduce="amax", include_self=True)
    out.index_add_(0, group_index, norms.pow(norm_type))
    return out.pow(1.0 / norm_type)


def clip_coefficient(total_norm: Tensor, max_norm: float, eps: float = 1e-6) -> Tensor:
    """``min(1, max_norm / (total_norm + eps))`` as a tensor, like ``torch.nn.utils.clip_grad_norm_``."""
    return torch.clamp(max_norm / (total_norm + eps), max=1.0)


def clip_by_global_norm_(
    tensors: Sequence[Tensor],
    max_norm: float | Tensor,
    total: Tensor | None = None,
    norm_type: float = 2.0,
    uniform: bool = False,
) -> Tensor:
    """Clip by the global norm, in place: every tensor times ``min(1, max_norm / (total + 1e-6))``, the coefficient
    of ``torch.nn.utils.clip_grad_norm_``; returns it (a 0-dim tensor, no host sync).

    The one clip of the package: ``StepGradients.clip_`` (the callbacks' clips), ``StableFSDPPrecision`` and
    ``FusedClipMixedPrecision`` (``Trainer(gradient_clip_val)``). ``total``: the tensors' global norm when the
    caller knows it (else measured here, sharded tensors reduced over their mesh); ``uniform``: as for
    :func:`per_tensor_norms`.
    """
    if total is None:
        total = total_norm(tensors, norm_type)
    coef = clip_coefficient(total, max_norm)  # type: ignore[arg-type]
    if tensors:
        scale_(tensors, coef, uniform)
    return coef


def scale_(tensors: Sequence[Tensor], coef: Tensor, uniform: bool = False) -> None:
    """Multiply tensors in place by a scalar tensor; sharded tensors are scaled shard by shard. ``uniform``: as
    for :func:`per_tensor_norms`."""
    if uniform:
        _compat.foreach_mul_(list(tensors), coef.to(tensors[0].device, non_blocking=True))
        return
    buckets: dict[torch.device, list[Tensor]] = defaultdict(list)
    for t in tensors:
        local = local_tensor(t)
        buckets[local.device].append(local)
    for device, group in buckets.items():
        _compat.foreach_mul_(group, coef.to(device, non_blocking=True))


def total_norm(tensors: Sequence[Tensor], norm_type: float = 2.0) -> Tensor:
    """The norm of all tensors taken together (a 0-dim fp32 tensor, no host sync)."""
    return combine_norms(per_tensor_norms(tensors, norm_type), norm_type)


def module_groups(params: Sequence[Tensor], names: dict[int, str]) -> tuple[list[int], list[str]]:
    """Each parameter's module (the owner in its qualified name: ``net.0`` for ``net.0.weight``), as indices
    into the returned list of module names. ``names`` maps ``id(param)`` to its name."""
    groups: dict[str, int] = {}
    index = []
    for i, p in enumerate(params):
        name = names.get(id(p), f"param_{i}")
        module = name.rsplit(".", 1)[0] if "." in name else name
        index.append(groups.setdefault(module, len(groups)))
    return index, list(groups)
