"""The device mesh of :class:`~lightning_stability.strategies.fsdp.StableFSDPStrategy`: its shape for each
sharding and tensor-parallel layout, the part FSDP2 shards over, and the check that a tensor-parallel plan was
applied."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn

from lightning_stability import _compat
from lightning_stability.errors import StabilityConfigError, config_error

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from lightning_stability.strategies.fsdp_config import FSDPConfig


def build_mesh(cfg: FSDPConfig, num_nodes: int, num_processes: int, device_type: str) -> DeviceMesh:
    """The device mesh.

    ==============  ==========================================================================================
    full            1-D ``("shard",)``
    hybrid          2-D ``("replicate", "shard")``: shard within a node, replicate across nodes
    full + TP       2-D ``("data_parallel", "tensor_parallel")``, Lightning ``ModelParallelStrategy``'s contract
    hybrid + TP     3-D ``("replicate", "shard", "tensor_parallel")``, and ``"data_parallel"``: the first two
                    flattened into one dim (the data-parallel ranks, for the sampler and the module's own use)
    ==============  ==========================================================================================

    The tensor-parallel dim is innermost, so the N devices of a group are neighbours within a node.
    """
    from torch.distributed.device_mesh import init_device_mesh

    world, tp = num_nodes * num_processes, cfg.tensor_parallel
    if tp > 1 and num_processes % tp:
        raise config_error(
            "tensor_parallel",
            tp,
            f"does not divide the {num_processes} devices per node ({num_nodes} nodes x {num_processes} devices)",
            "pass a divisor of the devices per node: a tensor-parallel group communicates at every layer and "
            "stays within a node's fast links",
        )
    if cfg.sharding == "full":
        if tp > 1:
            return init_device_mesh(device_type, (world // tp, tp), mesh_dim_names=("data_parallel", "tensor_parallel"))
        return init_device_mesh(device_type, (world,), mesh_dim_names=("shard",))
    data_parallel = world // tp
    shape = cfg.mesh_shape or (num_nodes, num_processes // tp)
    if shape[0] * shape[1] != data_parallel:
        covers = f"the world size {world}" if tp == 1 else f"the {data_parallel} data-parallel ranks ({world} / {tp})"
        raise config_error(
            "device_mesh",
            shape,
            f"does not cover {covers} ({num_nodes} nodes x {num_processes} devices"
            + (f", tensor_parallel={tp}" if tp > 1 else "")
            + ")",
            f"pass a (replicas, shard_size) pair whose product is {data_parallel}",
        )
    if tp == 1:
        return init_device_mesh(device_type, shape, mesh_dim_names=("replicate", "shard"))
    mesh = init_device_mesh(device_type, (*shape, tp), mesh_dim_names=("replicate", "shard", "tensor_parallel"))
    _compat.flatten_mesh_dims(mesh, ("replicate", "shard"), "data_parallel")
    return mesh


def fsdp_mesh(cfg: FSDPConfig, mesh: DeviceMesh) -> DeviceMesh:
    """The part of ``mesh`` that FSDP2 shards (and, hybrid, replicates) over: all of it but the tensor-parallel dim."""
    if cfg.tensor_parallel == 1:
        return mesh
    return mesh["replicate", "shard"] if cfg.sharding == "hybrid" else mesh["data_parallel"]


def check_tensor_parallel_applied(cfg: FSDPConfig, module: nn.Module, mesh: DeviceMesh | None) -> None:
    """Under ``tensor_parallel > 1``, ``configure_model`` must have split some parameter over the tensor-parallel
    dim; otherwise each rank of a group would train a whole copy on the same batches, for nothing."""
    if cfg.tensor_parallel == 1 or mesh is None:
        return
    from lightning_stability.norms import is_dtensor

    split = [name for name, p in module.named_parameters() if is_dtensor(p) and _on_tensor_parallel_dim(p)]
    if not split:
        raise StabilityConfigError(
            f"StableFSDPStrategy(tensor_parallel={cfg.tensor_parallel}): {type(module).__name__}.configure_model "
            "applied no tensor-parallel plan (no parameter is split over self.device_mesh['tensor_parallel']), so "
            f"each of the {cfg.tensor_parallel} ranks of a group would hold and train the same whole model. Fix: in "
            "configure_model, call torch.distributed.tensor.parallel.parallelize_module(self.<blocks>, "
            "self.device_mesh['tensor_parallel'], plan) (for a GPT-style block: "
            "lightning_stability.gpt_block_plan), or pass tensor_parallel=1."
        )


def _on_tensor_parallel_dim(param: Any) -> bool:
    """Whether a DTensor parameter is laid out over a tensor-parallel mesh dim (alone, or in a larger mesh)."""
    return "tensor_parallel" in (param.device_mesh.mesh_dim_names or ())
