"""``backend="fairscale"``: FairScale's own FSDP, with FairScale's keywords, for CUDA users who want it.

FairScale needs CUDA streams, flattens each unit's parameters into one local shard (so gradients are
plain tensors, not DTensors) and checkpoints whole state dicts gathered on every rank. The strategy
uses it only on CUDA; checkpoints are ``full`` files. :class:`FairScaleBackend` is the strategy's backend
object for it (see :mod:`~lightning_stability.strategies.fsdp_backend`). Checked by
``tests/gpu/test_fsdp_fairscale.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_stability.errors import StabilityConfigError, config_error, require_fairscale
from lightning_stability.strategies.fsdp_backend import FSDPBackend
from lightning_stability.strategies.fsdp_wrap import ShardedRoot, WrapPlan, plan_wrapping

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from lightning_stability.strategies.fsdp_config import FSDPConfig
    from lightning_stability.strategies.fsdp_precision import StableFSDPPrecision


class FairScaleBackend(FSDPBackend):
    """FairScale's FSDP, ``backend="fairscale"``: flat local shards, FairScale's own ``no_sync`` and
    ``clip_grad_norm_``, full checkpoints gathered on every rank. CUDA only; no hybrid sharding, no tensor
    parallelism."""

    gradients_are_local_shards = True

    def __init__(self, cfg: FSDPConfig) -> None:
        super().__init__(cfg)
        if cfg.tensor_parallel > 1:
            raise config_error(
                "tensor_parallel",
                cfg.tensor_parallel,
                "is not available with backend='fairscale'",
                "use backend='native'",
            )
        if cfg.sharding == "hybrid":
            raise config_error("sharding", cfg.sharding, "is not available with backend='fairscale'", "use 'full'")
        if cfg.state_dict_type == "sharded":
            raise config_error(
                "state_dict_type",
                cfg.state_dict_type,
                "is not available with backend='fairscale' (its local shards load only at the same world size)",
                "use 'full', or backend='native' to reshard",
            )

    @staticmethod
    def arguments(arguments: dict[str, Any], lightning_keywords: dict[str, Any], extra: dict[str, Any]) -> list[str]:
        """Lightning ``FSDPStrategy``'s keywords mean something to the native backend only: refused."""
        for key, value in lightning_keywords.items():
            if value is not None:
                raise config_error(key, value, "is an FSDPStrategy keyword, for backend='native'", "drop it")
        return []

    def check_device(self, device: torch.device) -> None:
        if device.type != "cuda":
            raise StabilityConfigError(
                f"`backend='fairscale'` needs CUDA (FairScale's FSDP runs on CUDA streams), but this run's device is "
                f"{device.type!r}. Fix: use the native backend, StableFSDPStrategy(backend='native') (PyTorch FSDP2), "
                "which runs on CPU with gloo and on GPUs with NCCL."
            )
        require_fairscale("backend", "fairscale", "use the default backend='native' (PyTorch FSDP2)")

    def wrap(
        self, module: nn.Module, precision: StableFSDPPrecision, device: torch.device, mesh: DeviceMesh | None
    ) -> nn.Module:
        cfg = self.cfg
        plan = plan_wrapping(module, cfg.policy, cfg.activation_checkpointing, native=False)
        if not cfg.cpu_offload:
            module.to(device)  # FairScale shards on the device the parameters are on
        kwargs = fairscale_kwargs(
            param_dtype=precision.param_dtype,
            reduce_dtype=cfg.reduce_dtype,
            flatten_parameters=cfg.flatten_parameters,
            cpu_offload=cfg.cpu_offload,
            reshard_after_forward=cfg.reshard_after_forward,
            extra=cfg.fairscale_kwargs,
        )
        root = wrap_fairscale(module, plan, kwargs)
        precision.clip_norm_fn = cast(Callable[[float], Any], root.clip_grad_norm_)  # gradient_clip_val clips here
        return root

    @contextmanager
    def no_sync(self, root: nn.Module) -> Generator[None, None, None]:
        with root.no_sync():  # type: ignore[operator]
            yield

    def model_state(self, root: nn.Module | None, module: nn.Module) -> dict[str, Any]:
        assert root is not None
        return model_state(root)

    def optimizer_state(self, root: nn.Module | None, module: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
        assert root is not None
        return optimizer_state(root, optimizer)

    def load(
        self, path: Path, root: nn.Module | None, module: nn.Module, optimizers: list[Optimizer], strict: bool
    ) -> dict[str, Any]:
        assert root is not None
        checkpoint: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=False)
        load_full(root, optimizers, checkpoint, strict=strict)
        return checkpoint


def fairscale_fsdp_class() -> Any:
    """FairScale's FSDP class, or a clear error naming the extra when FairScale is not installed."""
    require_fairscale("backend", "fairscale", "use the default backend='native' (PyTorch FSDP2)")
    from fairscale.nn.data_parallel import FullyShardedDataParallel

    return FullyShardedDataParallel


def fairscale_kwargs(
    *,
    param_dtype: torch.dtype | None,
    reduce_dtype: torch.dtype | None,
    flatten_parameters: bool | None,
    cpu_offload: bool,
    reshard_after_forward: bool | int,
    extra: dict[str, Any],
) -> dict[str, Any]:
    """The keywords of every FairScale FSDP unit, from the strategy's arguments."""
    kwargs: dict[str, Any] = {
        "reshard_after_forward": bool(reshard_after_forward),
        "flatten_parameters": True if flatten_parameters is None else flatten_parameters,
        "cpu_offload": cpu_offload,
    }
    if param_dtype is not None:
        kwargs.update(
            mixed_precision=True, compute_dtype=param_dtype, fp32_reduce_scatter=reduce_dtype == torch.float32
        )
    kwargs.update(extra)
    return kwargs


def _replace(root: nn.Module, old: nn.Module, new: nn.Module) -> None:
    for module in root.modules():
        for name, child in module.named_children():
            if child is old:
                setattr(module, name, new)
                return
    raise RuntimeError(f"{type(old).__name__} is not a submodule of {type(root).__name__}")


def wrap_fairscale(module: nn.Module, plan: WrapPlan, kwargs: dict[str, Any]) -> nn.Module:
    """Wrap blocks, then top-level units, then a root around ``module`` in FairScale FSDP (not in place)."""
    fsdp_cls = fairscale_fsdp_class()
    from fairscale.nn.checkpoint import checkpoint_wrapper

    checkpointed = {id(m) for m in plan.checkpointed}
    for block in [*plan.blocks, *plan.units]:
        inner = checkpoint_wrapper(block) if id(block) in checkpointed else block
        _replace(module, block, fsdp_cls(inner, **kwargs))
    return fsdp_cls(ShardedRoot(module), **kwargs)


def model_state(root: nn.Module) -> dict[str, Any]:
    """The full state dict (every rank must call), with the names of the LightningModule."""
    state = root.state_dict()
    return {k.removeprefix("module."): v for k, v in state.items()}


def optimizer_state(root: Any, optimizer: Optimizer) -> dict[str, Any]:
    """The full optimizer state on rank 0 (``{}`` elsewhere); every rank must call."""
    return root.gather_full_optim_state_dict(optimizer) or {}


def load_full(root: Any, optimizers: list[Optimizer], checkpoint: dict[str, Any], strict: bool) -> None:
    """Load a full checkpoint into the FairScale root and the optimizers' local shards."""
    root.load_state_dict({f"module.{k}": v for k, v in checkpoint.pop("state_dict").items()}, strict=strict)
    for optimizer, osd in zip(optimizers, checkpoint.pop("optimizer_states", []), strict=False):
        optimizer.load_state_dict(root.get_shard_from_optim_state_dict(osd))
