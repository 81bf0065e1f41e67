"""The backend of :class:`~lightning_stability.strategies.fsdp.StableFSDPStrategy`: the few operations that differ
between PyTorch FSDP2 (``backend="native"``, :class:`FSDP2Backend`, here) and FairScale's FSDP
(``backend="fairscale"``, :class:`~lightning_stability.strategies.fsdp_fairscale.FairScaleBackend`).

The strategy picks one at construction and calls it for each of these; everything else (processes, collectives,
atomic saves, precision) is the strategy's own.

=====================  ==========================================================================================
``arguments``          the keywords only this backend takes (Lightning ``FSDPStrategy``'s, or none), at construction
``check_device``       refuse a device the backend cannot run on, before any process group
``mesh``               the device mesh built at ``setup_environment`` (``None``: the backend needs none)
``wrap``               shard the module into units under a root
``no_sync``            accumulate gradients locally on a non-final micro-batch
``model_state``,       what ``save_checkpoint`` writes
``optimizer_state``
``load``               read a verified checkpoint into the wrapped module and the optimizers
=====================  ==========================================================================================
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.optim import Optimizer

from lightning_stability import _compat
from lightning_stability.strategies import fsdp_checkpoint as ckpt
from lightning_stability.strategies import fsdp_lightning as lightning
from lightning_stability.strategies import fsdp_wrap as wrap
from lightning_stability.strategies import mesh as meshes

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from lightning_stability.strategies.fsdp_config import FSDPConfig
    from lightning_stability.strategies.fsdp_precision import StableFSDPPrecision

_FLATTEN_EXPLAINED = False


class FSDPBackend:
    """The operations of one backend (see the module docstring). ``cfg``: the strategy's checked arguments."""

    #: gradients are flat local shards (FairScale) rather than DTensors: their global norm cannot be measured
    gradients_are_local_shards = False

    def __init__(self, cfg: FSDPConfig) -> None:
        self.cfg = cfg

    @property
    def one_file(self) -> bool:
        """Whether a checkpoint is one file (written by rank 0) rather than a sharded directory."""
        return self.cfg.state_dict_type == "full"

    @staticmethod
    def arguments(arguments: dict[str, Any], lightning_keywords: dict[str, Any], extra: dict[str, Any]) -> list[str]:
        """Translate (or refuse) the keywords only this backend takes into ``arguments``, in place; the notes to
        say once. ``lightning_keywords``: Lightning ``FSDPStrategy``'s ``sharding_strategy`` and
        ``activation_checkpointing_policy``; ``extra``: the keywords outside the signature."""
        raise NotImplementedError

    def check_device(self, device: torch.device) -> None:
        """Refuse a device this backend cannot run on (before any process group)."""

    def mesh(self, num_nodes: int, num_processes: int, device_type: str) -> DeviceMesh | None:
        """The device mesh, built once the process group exists; ``None`` where the backend needs none."""
        return None

    def wrap(
        self, module: nn.Module, precision: StableFSDPPrecision, device: torch.device, mesh: DeviceMesh | None
    ) -> nn.Module:
        """``module`` sharded into units under a root that runs ``training_step``."""
        raise NotImplementedError

    @contextmanager
    def no_sync(self, root: nn.Module) -> Generator[None, None, None]:
        """Gradients accumulate locally inside (no reduce-scatter, no all-reduce)."""
        raise NotImplementedError
        yield

    def model_state(self, root: nn.Module | None, module: nn.Module) -> dict[str, Any]:
        """The weights to save, named as in the LightningModule (every rank calls)."""
        raise NotImplementedError

    def optimizer_state(self, root: nn.Module | None, module: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
        """One optimizer's state to save (every rank calls)."""
        raise NotImplementedError

    def load(
        self, path: Path, root: nn.Module | None, module: nn.Module, optimizers: list[Optimizer], strict: bool
    ) -> dict[str, Any]:
        """Load the weights and the optimizers' state from a verified checkpoint; the rest of it, for Lightning."""
        raise NotImplementedError


class FSDP2Backend(FSDPBackend):
    """PyTorch FSDP2 (``fully_shard``), ``backend="native"``: DTensor parameters and gradients, on GPUs (NCCL)
    or CPUs (gloo), sharded checkpoints through ``torch.distributed.checkpoint`` loadable at any world size."""

    def __init__(self, cfg: FSDPConfig) -> None:
        super().__init__(cfg)
        explain_flatten_parameters(cfg)

    @staticmethod
    def arguments(arguments: dict[str, Any], lightning_keywords: dict[str, Any], extra: dict[str, Any]) -> list[str]:
        return lightning.translate(arguments, lightning_keywords, extra)

    def mesh(self, num_nodes: int, num_processes: int, device_type: str) -> DeviceMesh:
        return meshes.build_mesh(self.cfg, num_nodes, num_processes, device_type)

    def wrap(
        self, module: nn.Module, precision: StableFSDPPrecision, device: torch.device, mesh: DeviceMesh | None
    ) -> nn.Module:
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

        cfg = self.cfg
        assert mesh is not None
        plan = wrap.plan_wrapping(module, cfg.policy, cfg.activation_checkpointing, native=True)
        half = precision.param_dtype is not None
        root = wrap.shard_module(
            module,
            plan,
            mesh=meshes.fsdp_mesh(cfg, mesh),
            reshard_after_forward=cfg.reshard_after_forward,
            block_policy=precision.mp_policy(),
            # what the top-level units hand back to the LightningModule (logits for the loss) is fp32
            unit_policy=precision.mp_policy(output_dtype=torch.float32 if half else None),
            # the batch keeps its dtype (fp32 targets stay fp32); the units cast what they receive
            root_policy=precision.mp_policy(cast_forward_inputs=False),
            offload_policy=CPUOffloadPolicy() if cfg.cpu_offload else OffloadPolicy(),
        )
        _compat.materialize_distributed_module(root, device)
        return root

    @contextmanager
    def no_sync(self, root: nn.Module) -> Generator[None, None, None]:
        root.set_requires_gradient_sync(False)  # type: ignore[operator]
        try:
            yield
        finally:
            root.set_requires_gradient_sync(True)  # type: ignore[operator]

    def model_state(self, root: nn.Module | None, module: nn.Module) -> dict[str, Any]:
        return ckpt.model_state(module, self.one_file)

    def optimizer_state(self, root: nn.Module | None, module: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
        return ckpt.optimizer_state(module, optimizer, self.one_file)

    def load(
        self, path: Path, root: nn.Module | None, module: nn.Module, optimizers: list[Optimizer], strict: bool
    ) -> dict[str, Any]:
        return ckpt.load(path, module, optimizers, strict=strict)


def explain_flatten_parameters(cfg: FSDPConfig) -> None:
    """Say once per process what ``flatten_parameters`` (a FairScale keyword) means under FSDP2."""
    global _FLATTEN_EXPLAINED
    if cfg.flatten_parameters is None or _FLATTEN_EXPLAINED:
        return
    _FLATTEN_EXPLAINED = True
    rank_zero_info(
        f"StableFSDPStrategy: `flatten_parameters={cfg.flatten_parameters}` (a FairScale keyword) has no FSDP2 "
        "equivalent and is ignored. FSDP2 shards each parameter on its own dim 0 (a DTensor that keeps its name "
        "and dtype) and still all-gathers each wrapped unit in one collective."
    )
