"""StableFSDPStrategy: fully sharded training on PyTorch FSDP2 that clips, scales and checkpoints correctly."""

from __future__ import annotations

from collections.abc import Collection, Generator, Mapping
from concurrent.futures import Future
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, cast

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_stability import _compat, ranks
from lightning_stability.checkpoint import atomic
from lightning_stability.checkpoint.async_save import AsyncSaves
from lightning_stability.checkpoint.atomic import CheckpointError
from lightning_stability.errors import StabilityConfigError, check_instance, config_error
from lightning_stability.strategies import fsdp_checkpoint as ckpt
from lightning_stability.strategies import fsdp_fairscale as fs
from lightning_stability.strategies import fsdp_wrap as wrap
from lightning_stability.strategies.fsdp_backend import FSDP2Backend, FSDPBackend
from lightning_stability.strategies.fsdp_config import adopt_precision, check_device, parse_arguments
from lightning_stability.strategies.fsdp_precision import StableFSDPPrecision
from lightning_stability.strategies.mesh import check_tensor_parallel_applied

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch.distributed.device_mesh import DeviceMesh

#: the backends, by the name ``backend=`` takes: the one dispatch (see ``fsdp_backend.py``)
_BACKENDS: dict[str, type[FSDPBackend]] = {"native": FSDP2Backend, "fairscale": fs.FairScaleBackend}


class StableFSDPStrategy(ParallelStrategy):
    """Fully sharded data parallel training on PyTorch FSDP2 (``fully_shard``), on GPUs (NCCL) or CPUs (gloo).

    The ``LightningModule`` stays unchanged: the blocks ``auto_wrap_policy`` selects become FSDP units, a root
    covers the rest, and a module that calls ``fully_shard`` itself in ``configure_model`` is left as it is.
    Gradients are clipped by the true global norm across shards (``GradientNormMonitor(max_norm=...)`` or
    ``Trainer(gradient_clip_val=...)``), reduced and kept in fp32 under mixed precision, and not reduce-scattered
    on non-final micro-batches; checkpoints are written atomically. It takes Lightning ``FSDPStrategy``'s
    keywords with their meaning, so ``FSDPStrategy(...)`` -> ``StableFSDPStrategy(...)`` keeps the arguments,
    and FairScale's FSDP keywords.

    Args:
        auto_wrap_policy: which modules become units: ``None`` (the repeated blocks, e.g. transformer layers),
            a set of module classes, a callable ``fn(module) -> bool``, or a minimum parameter count (of the
            elements a rank holds after ``configure_model``). Lightning's ``ModuleWrapPolicy``,
            ``transformer_auto_wrap_policy`` and ``size_based_auto_wrap_policy`` partials and FSDP1 callables
            ``fn(module, recurse, nonwrapped_numel)`` are taken with the same meaning.
        mixed_precision: ``None`` (follow ``Trainer(precision=...)``), ``True`` (fp16 mixed, as in FairScale),
            ``False``, a Lightning precision name (``"bf16-mixed"``, ``"16-mixed"``, ``"32-true"``,
            ``"bf16-true"``, ``"16-true"``), ``torch.bfloat16``/``torch.float16``, a ``MixedPrecisionPolicy``, or
            FSDP1's ``MixedPrecision`` (its ``param_dtype``, ``reduce_dtype`` and input casting; not
            ``buffer_dtype``; ``keep_low_precision_grads=True`` is refused).
        reduce_dtype: dtype of gradient reduction; ``None`` reduces in the compute dtype.
        flatten_parameters: FairScale's; accepted and ignored (FSDP2 shards each parameter as a DTensor), said
            once.
        cpu_offload: keep sharded parameters, gradients and optimizer state in CPU memory (GPU runs); also
            FSDP1's ``CPUOffload(offload_params=...)``.
        reshard_after_forward: free gathered parameters after forward (``True``), keep them until backward
            (``False``: ZeRO-2's communication), or reshard to a smaller group of this size (an ``int``).
        activation_checkpointing: recompute in backward the activations of the wrapped blocks (``True``) or of
            the modules of these classes.
        sharding: ``"full"`` (shard over every data-parallel rank) or ``"hybrid"`` (shard within a node,
            replicate across nodes; with ``tensor_parallel=N`` a 3-D mesh ``("replicate", "shard",
            "tensor_parallel")``).
        device_mesh: for ``sharding="hybrid"``, the shape ``(replicas, shard_size)`` of the data-parallel ranks.
        state_dict_type: ``"sharded"`` (default: a directory, each rank writes its shard, loads at any world
            size) or ``"full"`` (one file). Lightning ``FSDPStrategy``'s default is ``"full"``.
        backend: ``"native"`` (FSDP2) or ``"fairscale"`` (FairScale's FSDP, CUDA only, the ``fairscale`` extra).
        tensor_parallel: devices that split each layer, applied by ``configure_model`` on
            ``self.device_mesh["tensor_parallel"]`` (Lightning ``ModelParallelStrategy``'s contract); 1: none.
            Must divide the devices per node.
        process_group_backend: ``"gloo"``, ``"nccl"``, ...; default: the device's.
        timeout: process group timeout.
        sharding_strategy: Lightning's: ``"FULL_SHARD"``, ``"SHARD_GRAD_OP"``, ``"HYBRID_SHARD"``,
            ``"_HYBRID_SHARD_ZERO2"`` or torch's ``ShardingStrategy``, as ``sharding`` and
            ``reshard_after_forward``; ``"NO_SHARD"`` is refused (that is DDP).
        activation_checkpointing_policy: Lightning's: a set of classes or a ``ModuleWrapPolicy``, as
            ``activation_checkpointing``.
        **fairscale_kwargs: with ``backend="fairscale"``, further FairScale FSDP keywords. With the native
            backend, Lightning's ``use_orig_params``, ``limit_all_gathers``, ``forward_prefetch``,
            ``backward_prefetch`` (no effect, said once) and ``sync_module_states=False``.

    Raises:
        StabilityConfigError: for an unknown keyword or a bad value; for a Lightning keyword with no FSDP2
            meaning (``process_group``, ``device_id``, ``ignored_modules``, ``param_init_fn``, ``checkpoint_io``,
            ``sync_module_states=True``, a callable checkpointing policy), naming its replacement;
            ``cpu_offload`` on a CPU run; a policy that wraps nothing; ``backend="fairscale"`` without CUDA; a
            mesh that does not match the world size.

    Example::

        trainer = L.Trainer(
            accelerator="gpu", devices=8, num_nodes=2, precision="bf16-mixed",
            strategy=StableFSDPStrategy(sharding="hybrid", activation_checkpointing=True),
            callbacks=[GradientNormMonitor(max_norm=1.0)],
        )
    """

    strategy_name = "stable_fsdp"

    def __init__(
        self,
        *,
        auto_wrap_policy: wrap.WrapPolicy | Any = None,
        mixed_precision: bool | str | torch.dtype | Any | None = None,
        reduce_dtype: torch.dtype | None = torch.float32,
        flatten_parameters: bool | None = None,
        cpu_offload: bool | Any = False,
        reshard_after_forward: bool | int = True,
        activation_checkpointing: bool | type[nn.Module] | Collection[type[nn.Module]] | None = False,
        sharding: Literal["full", "hybrid"] = "full",
        device_mesh: tuple[int, int] | None = None,
        state_dict_type: Literal["sharded", "full"] | None = None,
        backend: Literal["native", "fairscale"] = "native",
        tensor_parallel: int = 1,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        sharding_strategy: Any = None,
        activation_checkpointing_policy: Any = None,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        precision_plugin: Precision | None = None,
        **fairscale_kwargs: Any,
    ) -> None:
        kind = _BACKENDS.get(backend) if isinstance(backend, str) else None
        if kind is None:
            raise config_error("backend", backend, "is not a backend", "pass 'native' (FSDP2) or 'fairscale'")
        arguments: dict[str, Any] = dict(
            sharding=sharding,
            reshard_after_forward=reshard_after_forward,
            auto_wrap_policy=auto_wrap_policy,
            activation_checkpointing=activation_checkpointing,
            cpu_offload=cpu_offload,
            mixed_precision=mixed_precision,
        )
        lightning_keywords = dict(
            sharding_strategy=sharding_strategy, activation_checkpointing_policy=activation_checkpointing_policy
        )
        notes = kind.arguments(arguments, lightning_keywords, fairscale_kwargs)
        for key in ("activation_checkpointing", "cpu_offload"):  # None (Lightning's default): off
            arguments[key] = False if arguments[key] is None else arguments[key]
        self._cfg = parse_arguments(
            **arguments,
            reduce_dtype=reduce_dtype,
            flatten_parameters=flatten_parameters,
            device_mesh=device_mesh,
            state_dict_type=state_dict_type,
            backend=backend,
            extra=fairscale_kwargs,
            tensor_parallel=tensor_parallel,
        )
        self._backend = kind(self._cfg)
        if process_group_backend is not None:
            check_instance("process_group_backend", process_group_backend, str, "a backend name or None", "'nccl'")
        if timeout is not None:
            check_instance("timeout", timeout, timedelta, "a timedelta or None", "timedelta(minutes=10)")
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._device_mesh: DeviceMesh | None = None
        self._root: nn.Module | None = None
        self._wrapped: nn.Module | None = None
        self._cleaned_dirs: set[Path] = set()  # rank 0: directories cleared of what a crashed save left
        self.num_nodes = 1
        super().__init__(
            accelerator=accelerator, parallel_devices=parallel_devices, cluster_environment=cluster_environment
        )
        if precision_plugin is not None:
            self.precision_plugin = precision_plugin
        if notes:
            rank_zero_info("StableFSDPStrategy: " + "; ".join(notes) + ".")

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
        self._backend.check_device(self.root_device)
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
        self._device_mesh = self._backend.mesh(self.num_nodes, self.num_processes, self.root_device.type)
        if self._device_mesh is not None:
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

    @property
    def gradients_are_local_shards(self) -> bool:
        """``True`` when gradients are flat local shards (FairScale) rather than DTensors."""
        return self._backend.gradients_are_local_shards

    def _wrap(self, module: pl.LightningModule) -> nn.Module:
        precision = self.precision_plugin
        module = precision.convert_module(module)  # type: ignore[assignment]
        return self._backend.wrap(module, precision, self.root_device, self._device_mesh)

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Accumulate gradients locally on non-final micro-batches: no reduce-scatter, no all-reduce."""
        if self._root is None:
            yield
        else:
            with self._backend.no_sync(self._root):
                yield

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    # ------------------------------------------------------------------ collectives
    def barrier(self, name: str | None = None) -> None:
        if not ranks.is_distributed():
            return
        if torch.distributed.get_backend() == "nccl":
            torch.distributed.barrier(device_ids=[self.root_device.index])
        else:
            torch.distributed.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not ranks.is_distributed():
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
    def lightning_module_state_dict(self) -> dict[str, Any]:
        assert self.lightning_module is not None
        return self._backend.model_state(self._root, self.lightning_module)

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer.optimizer
        assert self.lightning_module is not None
        return self._backend.optimizer_state(self._root, self.lightning_module, optimizer)

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
        path, partial = self._start_save(Path(filepath))
        try:
            ckpt.save(checkpoint, partial, full=self._backend.one_file, is_global_zero=self.is_global_zero)
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

        path, partial = self._start_save(Path(filepath))
        zero = self.is_global_zero
        if self._backend.one_file:
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
            files = ckpt.gather_checksums(partial, saves.dcp_group)  # each rank hashes its own shards
            if meta is not None:
                ckpt.write_meta(meta, partial, files)

        publish = (lambda: atomic.publish(partial, path)) if zero else (lambda: None)
        return [saves.submit(write, publish, partial if zero else None)]

    def _start_save(self, filepath: Path) -> tuple[Path, Path]:
        """Every rank: the checkpoint's path and its hidden sibling, as rank 0 prepared them (one broadcast); a
        failure to prepare is raised on every rank."""
        prepared: tuple[str, str, str | None] | None = None
        if self.is_global_zero:
            prepared = self._prepare_save(filepath)
        where, token, error = self.broadcast(prepared)
        path = Path(where)
        partial = atomic.partial_path(path, token)
        if error is not None:
            raise self._save_failed({0: error}, f"preparing {partial}", path, partial)
        return path, partial

    def _prepare_save(self, path: Path) -> tuple[str, str, str | None]:
        """Rank 0: clear what a crash left in the directory (once), make the hidden sibling of a sharded save."""
        token = atomic.new_token()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            if path.parent.resolve() not in self._cleaned_dirs:
                atomic.clean_directory(path.parent)
                self._cleaned_dirs.add(path.parent.resolve())
            if not self._backend.one_file:
                atomic.partial_path(path, token).mkdir()
        except OSError as err:
            return str(path), token, f"{type(err).__name__}: {err}"
        return str(path), token, None

    def _gather_errors(self, error: str | None) -> dict[int, str]:
        """Every rank's error (``None`` for success), known to every rank: one all-gather, also a barrier."""
        errors = ranks.gather_objects(error)
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
        """Check the checkpoint is complete on every rank and its files' checksums (each rank a share of the
        files), then load it (a clear error otherwise, on every rank)."""
        path = Path(self.broadcast(str(checkpoint_path)))
        try:
            found, _ = atomic.verify(path, ckpt.META_FILE, share=(self.global_rank, self.world_size))
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
        return self._backend.load(found, self._root, module, self.optimizers, strict=module.strict_loading)

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
