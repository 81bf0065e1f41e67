"""The weight-hash check across data-parallel replicas: which ranks must hold equal weights, a fingerprint of a
rank's weights computed on the device, and the ranks whose fingerprint disagrees with their replicas'.

Megatron-LM has the same check (``--check-weight-hash-across-dp-replicas-interval``); it hashes each parameter
with SHA-256 on the host. Here the fingerprint stays on the device and is exact: the parameters' bits read as
integers, summed (and their squares summed) in int64, so that any changed bit of any element changes it, and
the order in which a device sums cannot (integer sums are exact). It is blind to values swapping places.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from lightning_stability import ranks
from lightning_stability.norms import is_dtensor, local_tensor

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

try:  # DTensor is public from torch 2.5
    from torch.distributed.tensor import Replicate
except ImportError:  # pragma: no cover
    Replicate = None  # type: ignore[assignment,misc]

#: The fingerprint's two sums are reduced modulo this prime (2**31 - 1) so that they reach the host exactly (the
#: logging transfer carries float64). A bit flip changes a sum by 2**k times a small factor, never a multiple of it.
FINGERPRINT_MODULUS = 2**31 - 1
_CHUNK = 1 << 24  # elements per int64 temporary: bounds the check's extra memory (128 MiB)
_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True)
class ReplicaLayout:
    """Which ranks must hold bit-identical parameters: ranks with the same ``groups[rank]`` do.

    Attributes:
        groups: one group id per rank of the default process group.
        what: the layout in words, for messages (``"DDP: every rank"``).
    """

    groups: tuple[int, ...]
    what: str

    def members(self, rank: int) -> list[int]:
        """The ranks that must equal ``rank`` (itself included)."""
        return [r for r, g in enumerate(self.groups) if g == self.groups[rank]]


def replica_groups(mesh_ranks: Tensor, replicate_dims: Sequence[int]) -> tuple[int, ...]:
    """Group ids, by rank, for a device mesh whose parameters are replicated along ``replicate_dims``: two ranks
    hold the same local shards when their coordinates agree on every other dim.

    ``mesh_ranks`` is the mesh's rank layout (``DeviceMesh.mesh``); it must hold every rank ``0..n-1`` once.
    Example: a 2 x 2 mesh ``[[0, 1], [2, 3]]`` replicated along dim 0 (hybrid sharding's ``"replicate"``):
    ranks 0 and 2 hold shard 0, ranks 1 and 3 shard 1, so the groups are ``(0, 1, 0, 1)``.
    """
    shape = tuple(mesh_ranks.shape)
    keep = [d for d in range(len(shape)) if d not in set(replicate_dims)]
    groups: dict[int, int] = {}
    ids: dict[tuple[int, ...], int] = {}
    ranks = mesh_ranks.reshape(-1).tolist()  # row-major, the order of itertools.product below
    for rank, coord in zip(ranks, itertools.product(*(range(n) for n in shape)), strict=True):
        key = tuple(coord[d] for d in keep)
        groups[int(rank)] = ids.setdefault(key, len(ids))
    return tuple(groups[r] for r in range(len(groups)))


def replica_layout(params: Sequence[Tensor], world_size: int, data_parallel: bool) -> ReplicaLayout | str:
    """Which ranks must hold equal weights, or, for a layout this check does not cover, why (a sentence).

    Covered: plain parameters under a data-parallel strategy (DDP: every rank); ``DTensor`` parameters on one
    device mesh spanning every rank, or on it and on sub-meshes of it (``mesh["data_parallel"]``, the mesh FSDP2
    gives the parameters a tensor-parallel plan left alone), whose placements are ``Replicate`` along some dims
    of the whole mesh for every parameter: the ranks that differ only along those dims (hybrid sharding's
    ``"replicate"`` dim; the data-parallel dim of a tensor-parallel model that is replicated over it). A
    parameter on a sub-mesh counts as replicated along the dims its sub-mesh leaves out. The tensor-parallel dim
    never qualifies while some parameter is split over it: its ranks legitimately hold different shards. Not
    covered: fully sharded parameters (every rank holds a different shard), meshes that are not dims of one mesh
    spanning the world, plain parameters beside DTensors or under a strategy that does not keep them equal.

    Args:
        params: the model's parameters (``DTensor`` or plain).
        world_size: ranks in the default process group.
        data_parallel: the strategy keeps plain parameters equal on every rank (Lightning's ``DDPStrategy``).
    """
    if world_size < 2:
        return "one process: there are no replicas to compare"
    sharded = [p for p in params if is_dtensor(p)]
    if not sharded:
        if data_parallel:
            return ReplicaLayout((0,) * world_size, "DDP: every rank holds the same weights")
        return "plain (non-DTensor) parameters under a strategy that is not DDP: which ranks must be equal is unknown"
    if len(sharded) != len(params):
        return "some parameters are DTensors and some are not"
    meshes = {id(p.device_mesh): p.device_mesh for p in sharded}  # type: ignore[attr-defined]
    whole = [m for m in meshes.values() if m.size() == world_size]
    if not whole:
        (mesh, *_) = meshes.values()
        return f"the parameters' device mesh holds {mesh.size()} of the {world_size} ranks"
    world = whole[0]
    dims_of = {key: _dims_in(mesh, world) for key, mesh in meshes.items()}
    if any(dims is None for dims in dims_of.values()):
        return f"the parameters live on {len(meshes)} different device meshes that are not dims of one mesh"
    replicated = set(range(world.ndim))
    for p in sharded:
        dims = dims_of[id(p.device_mesh)]  # type: ignore[attr-defined]
        assert dims is not None
        split = {dims[d] for d, placement in enumerate(p.placements) if not _is_replicate(placement)}  # type: ignore[attr-defined]
        replicated -= split
    if not replicated:
        return "every rank holds a different shard of the weights (fully sharded): no two ranks must be equal"
    names = world.mesh_dim_names or tuple(str(d) for d in range(world.ndim))
    which = ", ".join(repr(names[d]) for d in sorted(replicated))
    return ReplicaLayout(
        replica_groups(world.mesh, sorted(replicated)), f"the ranks along mesh dim {which} hold equal shards"
    )


def _is_replicate(placement: object) -> bool:
    return Replicate is not None and isinstance(placement, Replicate)


def _dims_in(mesh: DeviceMesh, world: DeviceMesh) -> list[int] | None:
    """For each dim of ``mesh``, the dim of ``world`` it is, when ``mesh`` is ``world`` or this rank's sub-mesh of
    it along named dims (in ``world``'s order); else ``None``."""
    if mesh is world:
        return list(range(world.ndim))
    names, world_names = mesh.mesh_dim_names, world.mesh_dim_names
    if not names or not world_names or any(n not in world_names for n in names):
        return None
    dims = [world_names.index(n) for n in names]
    if dims != sorted(set(dims)):
        return None
    here = world.get_coordinate()
    if here is None:
        return None
    index = tuple(slice(None) if d in dims else here[d] for d in range(world.ndim))
    return dims if torch.equal(world.mesh[index], mesh.mesh) else None


def keeps_plain_parameters_equal(strategy: object) -> bool:
    """Whether ``strategy`` keeps plain (non-DTensor) parameters equal on every rank: Lightning's DDP, not
    DeepSpeed (a ``DDPStrategy`` subclass that shards them)."""
    from lightning.pytorch.strategies import DDPStrategy

    return isinstance(strategy, DDPStrategy) and type(strategy).__name__ != "DeepSpeedStrategy"


def _bits(t: Tensor) -> Tensor:
    """``t``'s elements as integers of the same width, flat (their bit patterns for floating point)."""
    flat = t.detach().reshape(-1)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    if flat.dtype == torch.bool:
        return flat.to(torch.int8)
    if flat.is_floating_point():
        return flat.view(_BITS[flat.element_size()])
    return flat


def weight_fingerprint(tensors: Iterable[Tensor], device: torch.device) -> Tensor:
    """An exact fingerprint of ``tensors`` (a ``DTensor``'s local shard): int64 ``[sum of bits, sum of squared
    bits]`` modulo :data:`FINGERPRINT_MODULUS`, on ``device``. A few kernels per tensor, no host sync.

    Equal tensors give equal fingerprints on any device; a changed bit anywhere changes the first sum (and the
    second, unless by chance).
    """
    sums: list[Tensor] = []
    for t in tensors:
        bits = _bits(local_tensor(t))
        for chunk in bits.split(_CHUNK):
            wide = chunk.to(torch.int64)
            sums.append(torch.stack([wide.sum(), (wide * wide).sum()]).to(device))
    if not sums:
        return torch.zeros(2, dtype=torch.int64, device=device)
    # int64 sums wrap on overflow, the same way on every rank
    return torch.remainder(torch.stack(sums).sum(0), FINGERPRINT_MODULUS)


def gather_fingerprints(fingerprint: Tensor) -> Tensor:
    """Every rank's fingerprint, ``(world_size, 2)`` on every rank: one small all-gather on the default group."""
    return ranks.gather(fingerprint)


def disagreeing_replicas(fingerprints: Sequence[Sequence[float]], layout: ReplicaLayout) -> dict[int, list[int]]:
    """The ranks whose fingerprint differs from their replicas': ``{rank: the ranks it should equal}``.

    Within each group the reference is the fingerprint a strict majority holds, or else the group's first
    rank's (two replicas that differ: the first is taken as right, the second named).
    """
    found: dict[int, list[int]] = {}
    for group in sorted(set(layout.groups)):
        members = [r for r, g in enumerate(layout.groups) if g == group]
        prints = [tuple(fingerprints[r]) for r in members]
        majority = [p for p in prints if prints.count(p) * 2 > len(prints)]
        reference = majority[0] if majority else prints[0]
        for rank, p in zip(members, prints, strict=True):
            if p != reference:
                found[rank] = members
    return found


def gather_from_ranks(value: Tensor) -> Tensor:
    """Every rank's ``value`` (0-dim), gathered into a vector on every rank: one small all-gather."""
    return ranks.gather(value.detach().to(torch.float32).reshape(()))
