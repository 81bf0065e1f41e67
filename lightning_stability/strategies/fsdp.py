"""StableFSDPStrategy: fully sharded training on PyTorch FSDP2 that clips, scales and checkpoints correctly."""

from __future__ import annotations

from collections.abc import Callable, Collection, Generator, Mapping
from concurrent.futures import Future
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, cast

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_stability import _compat
from lightning_stability.checkpoint import atomic
from lightning_stability.checkpoint.async_save import AsyncSaves
from lightning_stability.checkpoint.atomic import CheckpointError
from lightning_stability.errors import StabilityConfigError
from lightning_stability.strategies import fsdp_checkpoint as ckpt
from lightning_stability.strategies import fsdp_fairscale as fs
from lightning_stability.strategies import fsdp_wrap as wrap
from lightning_stability.strategies.fsdp_config import (
    adopt_precision,
    build_mesh,
    check_device,
    check_tensor_parallel_applied,
    explain_flatten_parameters,
    fsdp_mesh,
    parse_arguments,
)
from lightning_stability.strategies.fsdp_precision import StableFSDPPrecision

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch.distributed.device_mesh import DeviceMesh


class StableFSDPStrategy(ParallelStrategy):
    """Fully sharded data parallel training on PyTorch FSDP2 (``fully_shard``), CPU (gloo) or GPU (NCCL).

    The strategy wraps an unchanged ``LightningModule``: the blocks its ``auto_wrap_policy`` selects
    (by default the repeated blocks, e.g. transformer layers) each become an FSDP unit that
    all-gathers its parameters before use and reduce-scatters its gradients in backward; the
    module's top-level submodules and a root cover the rest. A module that shards itself in
    ``configure_model`` (``fully_shard`` on ``self.device_mesh``) is left as it is.

    What it does that Lightning's ``FSDPStrategy`` does not:

    * clips by the true global norm across shards, through ``GradientNormMonitor(max_norm=...)`` and
      through ``Trainer(gradient_clip_val=..., gradient_clip_algorithm="norm")``;
    * mixed precision computes in bf16/fp16 but reduces gradients and keeps master weights in fp32;
    * fp16 uses a rank-consistent loss scaler (``trainer.precision_plugin.scaler``): an inf in one
      rank's shard skips the step on every rank;
    * gradient accumulation does not reduce-scatter on non-final micro-batches;
    * checkpoints are sharded directories (each rank writes its shard) that load at any world size,
      written aside and published by one rename (a crash leaves the previous checkpoint or the new one,
      whole), and checked for completeness before they load;
      ``state_dict_type="full"`` writes one file; :func:`~lightning_stability.strategies.consolidate_checkpoint`
      merges a sharded directory into one file for export;
    * runs on CPU with gloo, so it is tested for real in CI;
    * ``tensor_parallel=N`` adds a tensor-parallel dim with Lightning ``ModelParallelStrategy``'s contract:
      ``configure_model`` applies the module's TP plan with
      ``parallelize_module(..., self.device_mesh["tensor_parallel"], plan)`` and the strategy shards the result
      with FSDP2 over ``self.device_mesh["data_parallel"]`` (hybrid: replicate x shard). A module written for
      ``ModelParallelStrategy`` runs unchanged once its ``fully_shard`` calls are dropped (or kept: a module
      ``configure_model`` already sharded is left as it is); the norms, clipping, fp16 loss scaling and
      checkpoints above hold on that mesh.

    FairScale's FSDP keywords are accepted as written. ``mixed_precision=True`` means what it means
    in FairScale: fp16 compute with fp32 master weights (here also fp32 reduction and a loss scaler).
    ``cpu_offload=True`` keeps sharded parameters, gradients and optimizer state in CPU memory
    (``CPUOffloadPolicy``). ``flatten_parameters`` has no FSDP2 equivalent: FSDP2 shards every
    parameter on its own dim 0 as a DTensor (keeping names, dtypes and ``requires_grad`` per
    parameter) while still gathering each unit with one collective, which is what flattening bought;
    the keyword is accepted and ignored, with a one-time info message. Communication overlaps compute
    through FSDP2's implicit forward/backward prefetch of the next unit; this replaces FairScale's
    ``bucket_cap_mb`` bucketing (each unit is one bucket).

    Args:
        auto_wrap_policy: which modules become units: ``None`` (the repeated blocks, e.g. the transformer
            layers: one unit per block, also after a tensor-parallel plan, as torchtitan wraps), a set of module
            classes, a callable ``fn(module) -> bool``, or a minimum parameter count (of the elements a rank holds
            after ``configure_model``: a tensor-parallel layer counts its slice).
        mixed_precision: ``None`` (follow ``Trainer(precision=...)``), ``True`` (fp16 mixed, as in
            FairScale), ``False``, a Lightning precision name (``"bf16-mixed"``, ``"16-mixed"``,
            ``"32-true"``, ``"bf16-true"``, ``"16-true"``), ``torch.bfloat16``/``torch.float16``, or a
            ``MixedPrecisionPolicy``.
        reduce_dtype: dtype of gradient reduction; ``None`` reduces in the compute dtype.
        flatten_parameters: accepted for FairScale compatibility (see above).
        cpu_offload: offload sharded parameters, gradients and optimizer state to CPU memory (GPU runs).
        reshard_after_forward: free gathered parameters after forward (``True``), keep them
            (``False``), or reshard to a smaller group of this size (an ``int``).
        activation_checkpointing: recompute the activations of the wrapped blocks (``True``) or of
            the modules of these classes in backward.
        sharding: ``"full"`` (shard over every rank) or ``"hybrid"`` (shard within a node, replicate
            across nodes: a 2-D mesh ``(num_nodes, devices)``; with ``tensor_parallel=N`` a 3-D mesh
            ``("replicate", "shard", "tensor_parallel")`` of shape ``(num_nodes, devices // N, N)``, whose first
            two dims together are ``self.device_mesh["data_parallel"]``).
        device_mesh: for ``sharding="hybrid"``, the shape ``(replicas, shard_size)`` of the data-parallel ranks
            (all ranks, or all ranks / ``tensor_parallel``).
        state_dict_type: ``"sharded"`` (default) or ``"full"`` checkpoints.
        backend: ``"native"`` (FSDP2) or ``"fairscale"`` (FairScale's FSDP, CUDA only, needs the extra).
        tensor_parallel: devices that split each layer (tensor parallelism, applied by ``configure_model``);
            1: none. Must divide the devices per node.
        process_group_backend: ``"gloo"``, ``"nccl"``, ...; default: the device's.
        timeout: process group timeout.
        **fairscale_kwargs: further FairScale FSDP keywords, only with ``backend="fairscale"``.

    Raises:
        StabilityConfigError: for an unknown keyword, a bad value, ``cpu_offload`` on a CPU run, a
            policy that wraps nothing, ``backend="fairscale"`` without CUDA, a mesh that does not
            match the world size.

    Example::

        trainer = L.Trainer(
            accelerator="gpu", devices=8, num_nodes=2, precision="bf16-mixed", gradient_clip_val=1.0,
            strategy=StableFSDPStrategy(sharding="hybrid", activation_checkpointing=True),
        )
    """

    strategy_name = "stable_fsdp"

    def __init__(
        self,
        *,
        auto_wrap_policy: wrap.WrapPolicy = None,
        mixed_precision: bool | str | torch.dtype | Any | None = None,
        reduce_dtype: torch.dtype | None = torch.float32,
        flatten_parameters: bool | None = None,
        cpu_offload: bool = False,
        reshard_after_forward: bool | int = True,
        activation_checkpointing: bool | Collection[type[nn.Module]] = False,
        sharding: Literal["full", "hybrid"] = "full",
        device_mesh: tuple[int, int] | None = None,
        state_dict_type: Literal["sharded", "full"] | None = None,
        backend: Literal["native", "fairscale"] = "native",
        tensor_parallel: int = 1,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        **fairscale_kwargs: Any,
    ) -> None:
        self._cfg = parse_arguments(
            auto_wrap_policy=auto_wrap_policy,
            mixed_precision=mixed_precision,
            reduce_dtype=reduce_dtype,
            flatten_parameters=flatten_parameters,
            cpu_offload=cpu_offload,
            reshard_after_forward=reshard_after_forward,
            activation_checkpointing=activation_checkpointing,
            sharding=sharding,
            device_mesh=device_mesh,
            state_dict_type=state_dict_type,
            backend=backend,
            extra=fairscale_kwargs,
            tensor_parallel=tensor_parallel,
        )
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._device_mesh: DeviceMesh | None = None
        self._root: nn.Module | None = None
        self._wrapped: nn.Module | None = None
        self._cleaned_dirs: set[Path] = set()  # rank 0: directories cleared of what a crashed save left
        self.num_nodes = 1
        super().__init__()
        explain_flatten_parameters(self._cfg)

    # ------------------------------------------------------------------ precision
    @property
    def precision_plugin(self) -> StableFSDPPrecision:
        plugin = _compat.strategy_precision_plugin(self)
        if plugin is None:
            plugin = adopt_precision(Precision(), self._cfg, self.accelerator)
            _compat.set_strategy_precision_plugin(self, plugin)
        assert isinstance(plugin, StableFSDPPrecision)
        return plugin

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        # the Trainer hands every strategy a plugin built from `precision=`: turn it into the FSDP2 one
        _compat.set_strategy_precision_plugin(self, adopt_precision(plugin, self._cfg, self.accelerator))

    # ------------------------------------------------------------------ processes and mesh
    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        return True

    @property
    def device_mesh(self) -> DeviceMesh:
        if self._device_mesh is None:
            raise RuntimeError("The device mesh exists once the processes are set up (in `setup_environment`).")
        return self._device_mesh

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Sharding (and, in hybrid mode, replication) is data parallel: every data-parallel rank sees its own data;
        # the ranks of one tensor-parallel group see the same.
        if self._cfg.tensor_parallel > 1:
            dp = self.device_mesh["data_parallel"]
            return {"num_replicas": dp.size(), "rank": dp.get_local_rank()}
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False

    def _configure_launcher(self) -> None:  # Lightning's private hook, called at Trainer construction
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            _compat.use_subprocess_launcher(self)

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]

    def setup_environment(self) -> None:
        _compat.check_strategy_supported(self)
        check_device(self._cfg, self.root_device)
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = self._process_group_backend or _compat.default_process_group_backend(
            self.root_device
        )
        assert self.cluster_environment is not None
        kwargs: dict[str, Any] = {"timeout": self._timeout}
        if self.root_device.type != "cpu":
            kwargs["device_id"] = self.root_device
        _compat.init_dist_connection(self.cluster_environment, self._process_group_backend, **kwargs)
        if self._cfg.backend == "native":
            self._device_mesh = build_mesh(self._cfg, self.num_nodes, self.num_processes, self.root_device.type)
            assert self.lightning_module is not None
            _compat.set_module_device_mesh(self.lightning_module, self._device_mesh)  # for configure_model

    # ------------------------------------------------------------------ wrapping
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None
        assert self.lightning_module is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        if self._root is None or self._wrapped is not module:  # wrap once; fit -> validate reuses it
            check_tensor_parallel_applied(self._cfg, module, self._device_mesh)
            self._root = self._wrap(module)
            self._wrapped = module
        self.model = self._root
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            _compat.reset_optimizers_and_schedulers(self)
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING and not self._cfg.cpu_offload:
            _compat.optimizers_to_device(self.optimizers, self.root_device)
        if self._cfg.backend == "fairscale":
            fs.refuse_shard_local_monitors(trainer)

    @property
    def gradients_are_local_shards(self) -> bool:
        """``True`` when gradients are flat local shards (FairScale) rather than DTensors."""
        return self._cfg.backend == "fairscale"

    def _wrap(self, module: pl.LightningModule) -> nn.Module:
        precision, cfg = self.precision_plugin, self._cfg
        module = precision.convert_module(module)  # type: ignore[assignment]
        plan = wrap.plan_wrapping(module, cfg.policy, cfg.activation_checkpointing, native=cfg.backend == "native")
        if cfg.backend == "fairscale":
            if not cfg.cpu_offload:
                module.to(self.root_device)  # FairScale shards on the device the parameters are on
            kwargs = fs.fairscale_kwargs(
                param_dtype=precision.param_dtype,
                reduce_dtype=cfg.reduce_dtype,
                flatten_parameters=cfg.flatten_parameters,
                cpu_offload=cfg.cpu_offload,
                reshard_after_forward=cfg.reshard_after_forward,
                extra=cfg.fairscale_kwargs,
            )
            root = fs.wrap_fairscale(module, plan, kwargs)
            precision.clip_norm_fn = cast(Callable[[float], Any], root.clip_grad_norm_)
            return root
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

        half = precision.param_dtype is not None
        root = wrap.shard_module(
            module,
            plan,
            mesh=fsdp_mesh(cfg, self.device_mesh),
            reshard_after_forward=cfg.reshard_after_forward,
            block_policy=precision.mp_policy(),
            # what the top-level units hand back to the LightningModule (logits for the loss) is fp32
            unit_policy=precision.mp_policy(output_dtype=torch.float32 if half else None),
            # the batch keeps its dtype (fp32 targets stay fp32); the units cast what they receive
            root_policy=precision.mp_policy(cast_forward_inputs=False),
            offload_policy=CPUOffloadPolicy() if cfg.cpu_offload else OffloadPolicy(),
        )
        _compat.materialize_distributed_module(root, self.root_device)
        return root

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Accumulate gradients locally on non-final micro-batches: no reduce-scatter, no all-reduce."""
        root = self._root
        if root is None:
            yield
        elif self._cfg.backend == "fairscale":
            with root.no_sync():  # type: ignore[operator]
                yield
        else:
            root.set_requires_gradient_sync(False)  # type: ignore[operator]
            try:
                yield
            finally:
                root.set_requires_gradient_sync(True)  # type: ignore[operator]

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    # ------------------------------------------------------------------ collectives
    def barrier(self, name: str | None = None) -> None:
        if not _compat.distributed_is_initialized():
            return
        if torch.distributed.get_backend() == "nccl":
            torch.distributed.barrier(device_ids=[self.root_device.index])
        else:
            torch.distributed.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _compat.distributed_is_initialized():
            return obj
        holder = [obj]
        torch.distributed.broadcast_object_list(holder, src)
        return holder[0]

    def reduce(self, tensor: Tensor | Any, group: Any | None = None, reduce_op: Any | None = "mean") -> Any:
        return (
            _compat.sync_ddp_if_available(tensor, group, reduce_op=reduce_op) if isinstance(tensor, Tensor) else tensor
        )

    def teardown(self) -> None:
        assert self.cluster_environment is not None
        assert self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()

    # ------------------------------------------------------------------ checkpoints
    @property
    def _full(self) -> bool:
        return self._cfg.state_dict_type == "full"

    def lightning_module_state_dict(self) -> dict[str, Any]:
        assert self.lightning_module is not None
        if self._cfg.backend == "fairscale":
            return fs.model_state(self._root)  # type: ignore[arg-type]
        return ckpt.model_state(self.lightning_module, self._full)

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer.optimizer
        assert self.lightning_module is not None
        if self._cfg.backend == "fairscale":
            return fs.optimizer_state(self._root, optimizer)
        return ckpt.optimizer_state(self.lightning_module, optimizer, self._full)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Write the checkpoint into a hidden sibling of ``filepath``, then publish it with one rename (rank 0).

        Every rank writes its shards into ``.lsckpt-partial-<token>`` (the token drawn by rank 0 and broadcast);
        rank 0 adds ``meta.pt``; once every rank reports success, rank 0 swaps the directory in (or replaces the
        file, ``state_dict_type="full"``) and only then deletes the previous checkpoint. A failure on any rank
        is raised on every rank, and the previous checkpoint stays in place.
        """
        if storage_options is not None:
            raise StabilityConfigError(
                "StableFSDPStrategy.save_checkpoint(storage_options=...) is not supported: checkpoints are "
                "written by torch.distributed.checkpoint, not a CheckpointIO. Fix: drop storage_options."
            )
        prepared: tuple[str, str, str | None] | None = None
        if self.is_global_zero:
            prepared = self._prepare_save(Path(filepath))
        where, token, error = self.broadcast(prepared)
        path = Path(where)
        partial = atomic.partial_path(path, token)
        if error is not None:
            raise self._save_failed({0: error}, f"preparing {partial}", path, partial)
        try:
            ckpt.save(checkpoint, partial, full=self._full, is_global_zero=self.is_global_zero)
            error = None
        except Exception as err:
            error = f"{type(err).__name__}: {err}"
        failed = self._gather_errors(error)  # also the barrier before publishing
        if failed:
            raise self._save_failed(failed, f"writing {partial}", path, partial)
        if self.is_global_zero:
            try:
                atomic.publish(partial, path)
            except Exception as err:
                error = f"{type(err).__name__}: {err}"
        error = self.broadcast(error)
        if error is not None:
            raise self._save_failed({0: error}, f"publishing {partial} at {path}", path, partial)

    def save_checkpoint_async(
        self, checkpoint: dict[str, Any], filepath: Path, saves: AsyncSaves
    ) -> list[Future[None]]:
        """:meth:`save_checkpoint` in two parts, for ``StableCheckpoint(async_save=True)``: every rank copies its
        state to host memory now; the write goes on in the background (shards through
        ``torch.distributed.checkpoint.async_save`` on ``saves.dcp_group``, gloo) and rank 0 publishes once every
        rank's shards and ``meta.pt`` are written. Returns this rank's background work (see ``async_save.py``)."""
        import torch.distributed.checkpoint as dcp

        prepared: tuple[str, str, str | None] | None = None
        if self.is_global_zero:
            prepared = self._prepare_save(Path(filepath))
        where, token, error = self.broadcast(prepared)
        path = Path(where)
        partial = atomic.partial_path(path, token)
        if error is not None:
            raise self._save_failed({0: error}, f"preparing {partial}", path, partial)
        zero = self.is_global_zero
        if self._full or self._cfg.backend == "fairscale":
            if not zero:
                return []  # rank 0 writes the one file
            staged = saves.stage(checkpoint)
            partial = partial.with_name(f"{partial.name}.pt")  # torch's writer wants a suffix
            return [
                saves.submit(
                    lambda: atomic.torch_save_durably(partial, staged),
                    lambda: atomic.publish(partial, path),
                    partial,
                )
            ]
        tensors, rest = ckpt.split_sharded(checkpoint)
        meta = saves.stage(rest, "meta") if zero else None
        shards = dcp.async_save(
            tensors, checkpoint_id=partial, process_group=saves.dcp_group, async_stager=saves.stager()
        )

        def write() -> None:
            # every rank's shards and .metadata, fsynced by FileSystemWriter (an AsyncSaveResponse only with a
            # stager that stages in the background, which ours does not)
            future = getattr(shards, "upload_completion", shards)
            cast(Future, future).result()
            if meta is not None:
                ckpt.write_meta(meta, partial)

        publish = (lambda: atomic.publish(partial, path)) if zero else (lambda: None)
        return [saves.submit(write, publish, partial if zero else None)]

    def _prepare_save(self, path: Path) -> tuple[str, str, str | None]:
        """Rank 0: clear what a crash left in the directory (once), make the hidden sibling of a sharded save."""
        token = atomic.new_token()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            if path.parent.resolve() not in self._cleaned_dirs:
                atomic.clean_directory(path.parent)
                self._cleaned_dirs.add(path.parent.resolve())
            if not self._full:
                atomic.partial_path(path, token).mkdir()
        except OSError as err:
            return str(path), token, f"{type(err).__name__}: {err}"
        return str(path), token, None

    def _gather_errors(self, error: str | None) -> dict[int, str]:
        """Every rank's error (``None`` for success), known to every rank: one all-gather, also a barrier."""
        errors = [error]
        if _compat.distributed_is_initialized():
            errors = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(errors, error)
        return {rank: e for rank, e in enumerate(errors) if e is not None}

    def _save_failed(self, failed: dict[int, str], stage: str, path: Path, partial: Path) -> CheckpointError:
        """The error every rank raises when a save failed on some rank; rank 0 deletes the hidden sibling."""
        if self.is_global_zero:
            atomic.delete(partial)
        rank, first = next(iter(failed.items()))
        return CheckpointError(
            f"Saving the checkpoint {path} failed on rank(s) {sorted(failed)} while {stage}: rank {rank}: {first}. "
            f"The previous checkpoint at {path}, if any, is untouched. Fix: the cause above (disk space, "
            "permissions, a path every rank can reach), then save again."
        )

    def remove_checkpoint(self, filepath: Any) -> None:
        """Rank 0 renames the checkpoint (file or sharded directory) away, then deletes it: never half-removed."""
        if self.is_global_zero:
            atomic.remove(Path(filepath))

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Check the checkpoint is complete on every rank, then load it (a clear error otherwise, on every rank)."""
        path = Path(self.broadcast(str(checkpoint_path)))
        try:
            found = atomic.verify_checkpoint(path, meta_file=ckpt.META_FILE)
            error = None
        except (atomic.CheckpointError, FileNotFoundError) as err:
            found, error = path, str(err)
        failed = self._gather_errors(error)
        if failed:
            first = next(iter(failed.values()))
            where = f" (found on rank(s) {sorted(failed)})" if self.world_size > 1 else ""
            raise CheckpointError(f"{first}{where}")
        module = self.lightning_module
        assert module is not None
        if self._cfg.backend == "fairscale":
            checkpoint: dict[str, Any] = torch.load(found, map_location="cpu", weights_only=False)
            fs.load_full(self._root, self.optimizers, checkpoint, strict=module.strict_loading)
            return checkpoint
        return ckpt.load(found, module, self.optimizers, strict=module.strict_loading)

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        pass  # done in load_checkpoint, which knows the sharding

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass  # done in load_checkpoint


if "stable_fsdp" not in StrategyRegistry:
    StrategyRegistry.register(
        "stable_fsdp",
        StableFSDPStrategy,
        description="FSDP2 fully sharded training with global-norm clipping, fp32 reduction and resharding checkpoints",
    )
