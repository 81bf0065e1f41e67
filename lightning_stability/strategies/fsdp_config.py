"""The arguments of :class:`~lightning_stability.strategies.fsdp.StableFSDPStrategy`, checked at construction."""

from __future__ import annotations

import difflib
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from lightning_stability import _compat
from lightning_stability.errors import StabilityConfigError, check_int, config_error, require_fairscale
from lightning_stability.strategies import fsdp_fairscale as fs
from lightning_stability.strategies import fsdp_wrap as wrap
from lightning_stability.strategies.fsdp_precision import PRECISIONS, StableFSDPPrecision

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

KEYWORDS = (
    "auto_wrap_policy",
    "mixed_precision",
    "reduce_dtype",
    "flatten_parameters",
    "cpu_offload",
    "reshard_after_forward",
    "activation_checkpointing",
    "sharding",
    "device_mesh",
    "state_dict_type",
    "backend",
    "process_group_backend",
    "timeout",
)
_HALF = {torch.bfloat16: "bf16-mixed", torch.float16: "16-mixed"}
_FLATTEN_EXPLAINED = False


def resolve_mixed_precision(value: Any) -> tuple[str | None, Any]:
    """``mixed_precision`` argument -> (Lightning precision name or None, explicit FSDP2 policy or None)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if value is None:
        return None, None
    if value is True:  # FairScale's meaning: fp16 compute, fp32 master weights
        return "16-mixed", None
    if value is False:
        return "32-true", None
    if isinstance(value, str) and value in PRECISIONS:
        return value, None
    if isinstance(value, torch.dtype) and value in _HALF:
        return _HALF[value], None
    if isinstance(value, MixedPrecisionPolicy):
        return _HALF.get(value.param_dtype, "32-true") if value.param_dtype else "32-true", value
    raise config_error(
        "mixed_precision",
        value,
        "is not a precision",
        f"pass True (fp16 compute, fp32 master weights, as in FairScale), one of {PRECISIONS}, torch.bfloat16, "
        "or a torch.distributed.fsdp.MixedPrecisionPolicy",
    )


def check_extra_keywords(backend: str, extra: dict[str, Any]) -> None:
    """Keywords outside the signature: FairScale's own (only with ``backend='fairscale'``) or typos."""
    for key in extra:
        if backend == "fairscale" and key in fs.FAIRSCALE_KEYWORDS:
            continue
        if key in fs.FAIRSCALE_KEYWORDS:
            fix = fs.NATIVE_EQUIVALENT.get(key, "drop it (it has no FSDP2 equivalent)")
            raise config_error(
                key,
                extra[key],
                "is a FairScale keyword with no meaning for backend='native'",
                f"{fix}; or pass backend='fairscale'",
            )
        close = difflib.get_close_matches(key, [*KEYWORDS, *sorted(fs.FAIRSCALE_KEYWORDS)], n=1)
        hint = f"did you mean `{close[0]}`?" if close else "see the StableFSDPStrategy docstring for its keywords"
        raise config_error(key, extra[key], "is not a keyword of StableFSDPStrategy", hint)


@dataclass(frozen=True)
class FSDPConfig:
    """The strategy's checked arguments (see the StableFSDPStrategy docstring for each one)."""

    policy: wrap.WrapPolicy
    precision_name: str | None  # from `mixed_precision`; None: follow the Trainer
    mp_policy: Any  # an explicit MixedPrecisionPolicy, or None
    reduce_dtype: torch.dtype | None
    flatten_parameters: bool | None
    cpu_offload: bool
    reshard_after_forward: bool | int
    activation_checkpointing: bool | tuple[type[nn.Module], ...]
    sharding: str
    mesh_shape: tuple[int, int] | None
    state_dict_type: str
    backend: str
    tensor_parallel: int = 1
    fairscale_kwargs: dict[str, Any] = field(default_factory=dict)


def parse_arguments(
    *,
    auto_wrap_policy: Any,
    mixed_precision: Any,
    reduce_dtype: Any,
    flatten_parameters: Any,
    cpu_offload: Any,
    reshard_after_forward: Any,
    activation_checkpointing: Any,
    sharding: Any,
    device_mesh: Any,
    state_dict_type: Any,
    backend: Any,
    extra: dict[str, Any],
    tensor_parallel: Any = 1,
) -> FSDPConfig:
    """Check every argument; raise :class:`StabilityConfigError` naming the first bad one."""
    if backend not in ("native", "fairscale"):
        raise config_error("backend", backend, "is not a backend", "pass 'native' (FSDP2) or 'fairscale'")
    check_extra_keywords(backend, extra)
    policy = wrap.validate_policy(auto_wrap_policy)
    precision_name, mp_policy = resolve_mixed_precision(mixed_precision)
    if reduce_dtype is not None and not (isinstance(reduce_dtype, torch.dtype) and reduce_dtype.is_floating_point):
        raise config_error("reduce_dtype", reduce_dtype, "is not a floating dtype", "pass torch.float32 or None")
    for name, flag in (("cpu_offload", cpu_offload), ("flatten_parameters", flatten_parameters)):
        if flag is not None and not isinstance(flag, bool):
            raise config_error(name, flag, "must be a bool", f"pass {name}=True or False")
    if not isinstance(reshard_after_forward, bool) and (
        not isinstance(reshard_after_forward, int) or reshard_after_forward < 2
    ):
        raise config_error(
            "reshard_after_forward",
            reshard_after_forward,
            "must be a bool or a group size >= 2",
            "pass True (save memory), False (save communication) or e.g. 8 (devices per node)",
        )
    ac: bool | tuple[type[nn.Module], ...]
    if isinstance(activation_checkpointing, bool):
        ac = activation_checkpointing
    else:
        if not isinstance(activation_checkpointing, Collection):
            activation_checkpointing = [activation_checkpointing]
        if not activation_checkpointing or not all(
            isinstance(c, type) and issubclass(c, nn.Module) for c in activation_checkpointing
        ):
            raise config_error(
                "activation_checkpointing",
                activation_checkpointing,
                "must be a bool or module classes",
                "pass True (the wrapped blocks) or e.g. {TransformerBlock}",
            )
        classes = wrap.validate_policy(set(activation_checkpointing))
        ac = tuple(classes) if isinstance(classes, set) else ()
    if sharding not in ("full", "hybrid"):
        raise config_error("sharding", sharding, "is not a sharding mode", "pass 'full' or 'hybrid'")
    if device_mesh is not None and (
        sharding != "hybrid"
        or not isinstance(device_mesh, (tuple, list))
        or len(device_mesh) != 2
        or not all(isinstance(d, int) and d > 0 for d in device_mesh)
    ):
        raise config_error(
            "device_mesh",
            device_mesh,
            "must be a (replicas, shard_size) pair of positive ints with sharding='hybrid'",
            "pass sharding='hybrid', device_mesh=(num_nodes, devices_per_node)",
        )
    if state_dict_type not in (None, "sharded", "full"):
        raise config_error("state_dict_type", state_dict_type, "is not a checkpoint layout", "pass 'sharded' or 'full'")
    check_int("tensor_parallel", tensor_parallel, 1, "tensor_parallel=2 (devices splitting each layer; 1: none)")
    if tensor_parallel > 1 and backend == "fairscale":
        raise config_error(
            "tensor_parallel", tensor_parallel, "is not available with backend='fairscale'", "use backend='native'"
        )
    if backend == "fairscale":
        if sharding == "hybrid":
            raise config_error("sharding", sharding, "is not available with backend='fairscale'", "use 'full'")
        if state_dict_type == "sharded":
            raise config_error(
                "state_dict_type",
                state_dict_type,
                "is not available with backend='fairscale' (its local shards load only at the same world size)",
                "use 'full', or backend='native' to reshard",
            )
    return FSDPConfig(
        policy=policy,
        precision_name=precision_name,
        mp_policy=mp_policy,
        reduce_dtype=reduce_dtype,
        flatten_parameters=flatten_parameters,
        cpu_offload=cpu_offload,
        reshard_after_forward=reshard_after_forward,
        activation_checkpointing=ac,
        sharding=sharding,
        mesh_shape=tuple(device_mesh) if device_mesh else None,
        state_dict_type=state_dict_type or ("full" if backend == "fairscale" else "sharded"),
        backend=backend,
        tensor_parallel=tensor_parallel,
        fairscale_kwargs=dict(extra),
    )


# ---------------------------------------------------------------------- at Trainer construction
def adopt_precision(plugin: Any, cfg: FSDPConfig, accelerator: Any) -> StableFSDPPrecision | None:
    """The FSDP2 precision plugin for the one Lightning built from ``Trainer(precision=...)``.

    Raises:
        StabilityConfigError: when ``mixed_precision`` and the Trainer's precision disagree, or for a
            plugin with no FSDP2 meaning (e.g. ``"64-true"``).
    """
    from lightning.pytorch.accelerators import CPUAccelerator
    from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision

    if plugin is None or isinstance(plugin, StableFSDPPrecision):
        return plugin
    if type(plugin) not in (Precision, MixedPrecision, HalfPrecision):
        raise StabilityConfigError(
            f"StableFSDPStrategy cannot use the precision plugin {type(plugin).__name__} "
            f"(precision={getattr(plugin, 'precision', '?')!r}). Fix: pass Trainer(precision=...) as one of "
            f"{PRECISIONS}, or StableFSDPStrategy(mixed_precision=...)."
        )
    name = str(plugin.precision)
    if cfg.precision_name is not None:
        if name not in ("32-true", cfg.precision_name):
            raise StabilityConfigError(
                f"StableFSDPStrategy(mixed_precision -> {cfg.precision_name!r}) and Trainer(precision="
                f"{name!r}) disagree. Fix: set the precision in one place only."
            )
        name = cfg.precision_name
    device_type = "cpu" if isinstance(accelerator, CPUAccelerator) else None
    return StableFSDPPrecision(name, reduce_dtype=cfg.reduce_dtype, device_type=device_type, policy=cfg.mp_policy)


def explain_flatten_parameters(cfg: FSDPConfig) -> None:
    """Say once per process what ``flatten_parameters`` (a FairScale keyword) means under FSDP2."""
    global _FLATTEN_EXPLAINED
    if cfg.flatten_parameters is None or cfg.backend != "native" or _FLATTEN_EXPLAINED:
        return
    _FLATTEN_EXPLAINED = True
    rank_zero_info(
        f"StableFSDPStrategy: `flatten_parameters={cfg.flatten_parameters}` (a FairScale keyword) has no FSDP2 "
        "equivalent and is ignored. FSDP2 shards each parameter on its own dim 0 (a DTensor that keeps its name "
        "and dtype) and still all-gathers each wrapped unit in one collective."
    )


# ---------------------------------------------------------------------- at setup
def check_device(cfg: FSDPConfig, device: torch.device) -> None:
    """Refuse a backend or offloading that this run's device cannot do (before any process group)."""
    if cfg.backend == "fairscale":
        if device.type != "cuda":
            raise StabilityConfigError(
                f"`backend='fairscale'` needs CUDA (FairScale's FSDP runs on CUDA streams), but this run's device is "
                f"{device.type!r}. Fix: use the native backend, StableFSDPStrategy(backend='native') (PyTorch FSDP2), "
                "which runs on CPU with gloo and on GPUs with NCCL."
            )
        require_fairscale("backend", "fairscale", "use the default backend='native' (PyTorch FSDP2)")
    if cfg.cpu_offload and device.type == "cpu":
        raise config_error(
            "cpu_offload",
            True,
            f"moves parameters from the accelerator to CPU memory, but this run's device is already the CPU "
            f"(backend={cfg.backend!r}): there is nothing to offload",
            "drop cpu_offload, or train on GPUs (accelerator='gpu')",
        )


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
