"""The arguments of :class:`~lightning_stability.strategies.fsdp.StableFSDPStrategy`, checked at construction."""

from __future__ import annotations

import difflib
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_stability.errors import StabilityConfigError, check_bool, check_int, config_error
from lightning_stability.strategies import fsdp_wrap as wrap
from lightning_stability.strategies.fsdp_precision import PRECISIONS, StableFSDPPrecision

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

#: every keyword of ``fairscale.nn.FullyShardedDataParallel`` (FairScale 0.4.13)
FAIRSCALE_KEYWORDS = frozenset(
    {
        "process_group",
        "process_group_reduce_scatter",
        "reshard_after_forward",
        "disable_reshard_on_root",
        "mixed_precision",
        "fp32_reduce_scatter",
        "flatten_parameters",
        "move_params_to_cpu",
        "compute_dtype",
        "buffer_dtype",
        "move_grads_to_cpu",
        "bucket_cap_mb",
        "compute_device",
        "no_broadcast_optim_state",
        "state_dict_device",
        "clear_autocast_cache",
        "force_input_to_fp32",
        "verbose",
        "cpu_offload",
        "state_dict_on_rank_0_only",
        "gradient_predivide_factor",
        "allow_reset_parameters",
    }
)

#: what each FairScale-only keyword becomes under the native (FSDP2) backend
NATIVE_EQUIVALENT = {
    "bucket_cap_mb": "FSDP2 reduce-scatters each wrapped unit's gradients in one collective, so the unit is "
    "the bucket: size buckets with `auto_wrap_policy` (e.g. a parameter count)",
    "fp32_reduce_scatter": "gradients are reduced in fp32 by default: see `reduce_dtype`",
    "compute_dtype": "pass `mixed_precision='bf16-mixed'` or `'16-mixed'`",
    "buffer_dtype": "buffers follow the compute dtype of their unit: see `mixed_precision`",
    "move_params_to_cpu": "pass `cpu_offload=True`",
    "move_grads_to_cpu": "pass `cpu_offload=True` (FSDP2 offloads parameters, gradients and optimizer state together)",
}


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
        if backend == "fairscale" and key in FAIRSCALE_KEYWORDS:
            continue
        if key in FAIRSCALE_KEYWORDS:
            fix = NATIVE_EQUIVALENT.get(key, "drop it (it has no FSDP2 equivalent)")
            raise config_error(
                key,
                extra[key],
                "is a FairScale keyword with no meaning for backend='native'",
                f"{fix}; or pass backend='fairscale'",
            )
        close = difflib.get_close_matches(key, [*KEYWORDS, *sorted(FAIRSCALE_KEYWORDS)], n=1)
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
    check_extra_keywords(backend, extra)
    policy = wrap.validate_policy(auto_wrap_policy)
    precision_name, mp_policy = resolve_mixed_precision(mixed_precision)
    if reduce_dtype is not None and not (isinstance(reduce_dtype, torch.dtype) and reduce_dtype.is_floating_point):
        raise config_error("reduce_dtype", reduce_dtype, "is not a floating dtype", "pass torch.float32 or None")
    for name, flag in (("cpu_offload", cpu_offload), ("flatten_parameters", flatten_parameters)):
        if flag is not None:
            check_bool(name, flag)
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


# ---------------------------------------------------------------------- at setup
def check_device(cfg: FSDPConfig, device: torch.device) -> None:
    """Refuse offloading where this run's device is the CPU (before any process group)."""
    if cfg.cpu_offload and device.type == "cpu":
        raise config_error(
            "cpu_offload",
            True,
            f"moves parameters from the accelerator to CPU memory, but this run's device is already the CPU "
            f"(backend={cfg.backend!r}): there is nothing to offload",
            "drop cpu_offload, or train on GPUs (accelerator='gpu')",
        )
