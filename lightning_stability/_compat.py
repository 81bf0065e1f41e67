"""Every private Lightning and torch name the package touches, in one place.

Lightning and torch offer no public way to do the few things below, so the package reaches into their
internals, and only here. Each accessor says what it needs; :func:`check_supported` (callbacks) and
:func:`check_strategy_supported` (``StableFSDPStrategy``) run at ``setup`` and fail with one clear message
naming the supported versions when an internal is missing, instead of a traceback from deep inside a
training step. Internals that may be absent from other versions are imported lazily, inside the accessor,
so ``import lightning_stability`` never fails; an accessor whose internal is missing raises the same
message.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import re
import warnings
from collections import defaultdict
from typing import TYPE_CHECKING, Any, TypeGuard

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_stability.errors import StabilityConfigError

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Iterator

    from lightning.pytorch.plugins.precision import Precision

#: the oldest and newest (major, minor) of torch that the tests ran on; setup.cfg declares the oldest and no cap
TORCH_TESTED = ((2, 13), (2, 14))
SUPPORTED = "lightning>=2.5,<2.7 with torch>=2.13 (tested: torch 2.13 and 2.14)"


def _unsupported(what: str) -> StabilityConfigError:
    return StabilityConfigError(
        f"This Lightning/torch (lightning {pl.__version__}, torch {torch.__version__}) lacks {what}, which "
        f"lightning_stability relies on. Fix: install a supported pair ({SUPPORTED})."
    )


@functools.cache
def _private(module: str, name: str) -> Any:
    """The private ``module.name``, imported on first use, or the unsupported-version error."""
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as err:
        raise _unsupported(f"`{module}.{name}`") from err


def torch_minor(version: str) -> tuple[int, int]:
    """``(major, minor)`` of a torch version string such as ``"2.14.1+cu128"`` or ``"2.16.0a0+git1234"``."""
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


@functools.cache
def warn_if_untested(version: str | None = None) -> bool:
    """Warn once, on rank 0, when torch is newer than the newest version the tests ran on.

    Nothing is refused for being newer: a private name that is really missing fails on its own, in the checks
    below, with the fix. Returns whether it warned.
    """
    version = version or str(torch.__version__)
    if torch_minor(version) <= TORCH_TESTED[1]:
        return False
    from lightning.pytorch.utilities import rank_zero_warn

    oldest, newest = (".".join(map(str, v)) for v in TORCH_TESTED)
    rank_zero_warn(
        f"lightning_stability was tested with torch {oldest} to {newest}; this is torch {version}. It checked the "
        "torch and Lightning internals it needs and found them, so training goes on; if a step misbehaves, "
        f"report it with this version, or install torch {newest}."
    )
    return True


def _require_attr(obj: Any, name: str, what: str) -> None:
    if not hasattr(obj, name):
        raise _unsupported(f"{what}'s `{name}`")


# ---------------------------------------------------------------------------------------------- Lightning
def batches_that_stepped(trainer: pl.Trainer) -> int:
    """Lightning's step label: ``self.log`` and ``LearningRateMonitor`` label the k-th stepping batch ``k - 1``.

    It counts batches in which an optimizer stepped, once per batch whatever the number of optimizers.
    """
    return int(trainer.fit_loop.epoch_loop._batches_that_stepped)


def callback_metrics(trainer: pl.Trainer) -> dict[str, Tensor]:
    """The dict behind ``trainer.callback_metrics``, without the property's recomputation of logged results.

    The property gathers every ``self.log`` result on each read; writing a step's device tensors into the
    dict itself costs nothing and no transfer until a monitor reads them.
    """
    metrics: dict[str, Tensor] = trainer._logger_connector._callback_metrics
    return metrics


def log_with_module_metrics(trainer: pl.Trainer, metrics: dict[str, float], step: int) -> None:
    """Log ``metrics`` (host numbers) at ``step`` in the same logger call as the module's ``self.log``
    metrics of this training step: one row per logging step in ``CSVLogger``, with ``epoch``.

    Call it from ``on_train_batch_end`` with ``step`` = :func:`batches_that_stepped`. The metrics wait for
    Lightning's ``_LoggerConnector.update_train_step_metrics``, which runs right after the batch's
    ``on_train_batch_end`` hooks and logs the ``self.log`` metrics (through ``_LoggerConnector.log_metrics``,
    which adds ``epoch`` and keeps ``trainer.logged_metrics``); ours join that call. On a step where Lightning logs
    nothing (its ``log_every_n_steps`` differs from ours) they go out alone at the same point, still with
    ``epoch``. Nothing here touches a device: the values are already on the host.
    """
    if not trainer.loggers or not metrics:
        return
    connector = trainer._logger_connector
    row = connector.__dict__.get(_ROW_ATTR)
    if not isinstance(row, _TrainStepRow):
        row = _TrainStepRow(trainer)
    row.add(metrics, step)


_ROW_ATTR = "_lightning_stability_row"


class _TrainStepRow:
    """The metrics of one training step waiting for Lightning's logger call of that step (see
    :func:`log_with_module_metrics`). Installed once per Trainer on its logger connector, in front of two of its
    methods; everything else passes through unchanged."""

    def __init__(self, trainer: pl.Trainer) -> None:
        connector = trainer._logger_connector
        self.trainer = trainer
        self.pending: dict[str, float] = {}
        self.step = 0
        self._taking = False  # inside Lightning's update_train_step_metrics: its log_metrics call takes ours
        # Lightning's; host numbers pass through its tensor-to-number conversion as they are
        self._log_metrics: Any = connector.log_metrics
        self._update = connector.update_train_step_metrics
        # instance attributes in front of the connector's methods (this Trainer's only)
        connector.log_metrics = self.log_metrics  # type: ignore[method-assign]
        connector.update_train_step_metrics = self.update_train_step_metrics  # type: ignore[method-assign]
        connector.__dict__[_ROW_ATTR] = self

    def add(self, metrics: dict[str, float], step: int) -> None:
        if self.pending and step != self.step:  # an earlier step's, never taken (an exception in between)
            self._flush(self.step)
        self.pending.update(metrics)
        self.step = step

    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        if self._taking and self.pending and step is None and batches_that_stepped(self.trainer) == self.step:
            metrics = {**metrics, **self.pending}
            self.pending = {}
        self._log_metrics(metrics, step)

    def update_train_step_metrics(self) -> None:
        if not self.pending:
            self._update()
            return
        self._taking = True
        try:
            self._update()
        finally:
            self._taking = False
        if self.pending:  # Lightning logged nothing this step: ours alone, at the same label, with `epoch`
            self._flush(None if batches_that_stepped(self.trainer) == self.step else self.step)

    def _flush(self, step: int | None) -> None:
        pending, self.pending = self.pending, {}
        self._log_metrics(pending, step)


def epoch_loop(trainer: pl.Trainer) -> Any:
    """The fit loop's training epoch loop (the object that holds the private step counters below)."""
    return trainer.fit_loop.epoch_loop


def reads_callback_metrics_after(trainer: pl.Trainer, batch_idx: int) -> bool:
    """Whether Lightning reads ``callback_metrics`` after this batch (``ModelCheckpoint``, ``EarlyStopping``): the
    epoch's last batch, or one after which validation runs (Lightning's ``_should_check_val_fx``: every
    ``val_check_batch`` batches of the epoch, or of the run with ``check_val_every_n_epoch=None``)."""
    batches = trainer.num_training_batches
    if isinstance(batches, int) and batch_idx + 1 == batches:
        return True
    every = trainer.val_check_batch
    if not (trainer.enable_validation and isinstance(every, int) and every > 0):
        return False
    counted = epoch_loop(trainer).total_batch_idx if trainer.check_val_every_n_epoch is None else batch_idx
    return (counted + 1) % every == 0


def override_accumulation_decision(trainer: pl.Trainer, decide: Callable[[], bool] | None) -> None:
    """Make Lightning's "is this the last micro-batch of the step?" follow ``decide`` (``None`` restores it)."""
    loop = trainer.fit_loop.epoch_loop
    if decide is None:
        if "_accumulated_batches_reached" in vars(loop):
            delattr(loop, "_accumulated_batches_reached")
        return
    setattr(loop, "_accumulated_batches_reached", decide)  # noqa: B010


def accumulation_override(trainer: pl.Trainer) -> Callable[[], bool] | None:
    """The decision installed by :func:`override_accumulation_decision`, or ``None`` when Lightning's own is in use."""
    decide: Callable[[], bool] | None = vars(trainer.fit_loop.epoch_loop).get("_accumulated_batches_reached")
    return decide


def train_loaders(trainer: pl.Trainer) -> list[Any]:
    """The fit loop's training loaders as Lightning processed them (its ``DistributedSampler`` injected), in the
    order of its ``CombinedLoader``; empty before the fit loop set its data up."""
    combined = trainer.fit_loop._combined_loader
    return [] if combined is None else list(combined.flattened)


def restart_train_iterator(trainer: pl.Trainer) -> bool:
    """Build the fit loop's training iterator anew (``iter`` on its data fetcher, as Lightning does at each epoch's
    start), so that changes made to the loaders after the fit loop's setup apply from the next batch on.
    ``False`` when the fit loop has no data fetcher yet."""
    fetcher = trainer.fit_loop._data_fetcher
    if fetcher is None:
        return False
    iter(fetcher)
    return True


def start_next_epoch_as_new(trainer: pl.Trainer) -> bool:
    """On a resume from a checkpoint saved at an epoch's last batch (``on_train_batch_end``), let the fit loop begin
    the next epoch as it begins any epoch: counted ready and started, with ``on_train_epoch_start`` called.

    Lightning (2.6) closes the saved epoch when the fit starts (``FitLoop.reset``: processed, completed), but
    keeps its restart stage "restarted mid-epoch" until the next epoch's first iteration is done, so
    ``FitLoop.on_advance_start`` neither counts that epoch ready and started nor calls ``on_train_epoch_start``.
    The checkpoint saved at that epoch's last batch then holds an epoch progress whose resume sets the sampler's
    epoch one behind ``current_epoch`` (``DistributedSampler`` repeats the previous epoch's order). Call it from
    ``on_train_start`` (after ``reset``, before ``on_advance_start``). Returns whether it applied."""
    loop = trainer.fit_loop
    current: Any = loop.epoch_progress.current  # a _ProcessedTracker (typed as its base)
    if not getattr(loop, "restarted_mid_epoch", False) or current.processed != current.ready:
        return False  # not resumed at an epoch's last batch (a mid-epoch restart has processed == ready - 1)
    loop.reset_restart_stage()
    return True


@contextlib.contextmanager
def training_step_again(trainer: pl.Trainer, batch: Any) -> Iterator[None]:
    """Run the module's ``training_step`` once more inside the current step (a replay) as Lightning runs it, with
    what it logs dropped: ``self.log`` writes into a throw-away result collection (the fit loop's own keeps the
    original run's values), under the hook name ``training_step``."""
    result_collection = _private("lightning.pytorch.trainer.connectors.logger_connector.result", "_ResultCollection")
    loop, module, connector = trainer.fit_loop.epoch_loop, trainer.lightning_module, trainer._logger_connector
    kept = (loop._results, module._current_fx_name, connector._current_fx)
    scratch = result_collection(training=True)
    scratch.batch = batch
    loop._results = scratch
    module._current_fx_name = "training_step"
    try:
        yield
    finally:
        loop._results, module._current_fx_name, connector._current_fx = kept


#: the start of Lightning's warning that a mid-epoch resume of a loader without ``state_dict`` is not exact
#: (``_TrainingEpochLoop.reset``): not so where ``StableCheckpoint`` fast-forwards the loader itself
LOADER_NOT_RESUMABLE = "You're resuming from a checkpoint that ended before the epoch ended and your dataloader is"
#: the start of Lightning's warning that ``ckpt_path="last"`` found nothing, with its hint to set ``save_last``
#: (``_CheckpointConnector._parse_ckpt_path``): ``StableCheckpoint`` finds "last" in its list without it
NO_LAST_CHECKPOINT = '.fit(ckpt_path="last") is set, but there is no last checkpoint available'


def hide_lightning_warning(start: str) -> Any:
    """Ignore the warnings whose message starts with ``start`` until :func:`show_lightning_warning`; returns the
    filter installed."""
    warnings.filterwarnings("ignore", message=re.escape(start))
    return warnings.filters[0]


def show_lightning_warning(entry: Any) -> None:
    """Take off a filter :func:`hide_lightning_warning` installed (a no-op when it is gone already)."""
    with contextlib.suppress(ValueError):
        warnings.filters.remove(entry)  # type: ignore[attr-defined]
        warnings._filters_mutated()  # type: ignore[attr-defined]


def callback_state_key(callback: pl.Callback, **kwargs: Any) -> str:
    """A callback's checkpoint key built the way Lightning builds them: class name plus ``kwargs``."""
    key: str = callback._generate_state_key(**kwargs)
    return key


# Lightning: strategy internals (the same ones Lightning's own ModelParallelStrategy uses)
_FABRIC_DISTRIBUTED = "lightning.fabric.utilities.distributed"
_LAUNCHER = ("lightning.pytorch.strategies.launchers.subprocess_script", "_SubprocessScriptLauncher")


def default_process_group_backend(device: torch.device) -> str:
    """Lightning's default process-group backend for ``device`` (e.g. ``"nccl"`` on CUDA, ``"gloo"`` on CPU)."""
    backend: str = _private(_FABRIC_DISTRIBUTED, "_get_default_process_group_backend_for_device")(device)
    return backend


def init_dist_connection(cluster_environment: Any, backend: str, **kwargs: Any) -> None:
    """Create the default process group from the cluster environment's address, rank and world size."""
    _private(_FABRIC_DISTRIBUTED, "_init_dist_connection")(cluster_environment, backend, **kwargs)


def sync_ddp_if_available(tensor: Tensor, group: Any | None = None, reduce_op: Any | None = None) -> Tensor:
    """All-reduce ``tensor`` across processes with ``reduce_op`` (``"mean"``, ``"sum"``, ...) when distributed."""
    reduced: Tensor = _private(_FABRIC_DISTRIBUTED, "_sync_ddp_if_available")(tensor, group, reduce_op=reduce_op)
    return reduced


def materialize_distributed_module(module: nn.Module, device: torch.device) -> None:
    """Allocate a sharded module's meta-device parameters on ``device`` and run their ``reset_parameters``."""
    _private("lightning.fabric.utilities.init", "_materialize_distributed_module")(module, device)


def optimizers_to_device(optimizers: Iterable[Optimizer], device: torch.device) -> None:
    """Move the state tensors of every optimizer to ``device``."""
    _private("lightning.fabric.utilities.optimizer", "_optimizers_to_device")(optimizers, device)


def use_subprocess_launcher(strategy: Any) -> None:
    """Make ``strategy`` start its other processes by re-running the script (what ``devices=N`` does for DDP)."""
    launcher_cls = _private(*_LAUNCHER)
    strategy._launcher = launcher_cls(strategy.cluster_environment, strategy.num_processes, strategy.num_nodes)


def reset_optimizers_and_schedulers(strategy: Any) -> None:
    """Forget the strategy's optimizers and LR schedulers before ``setup_optimizers`` builds them again."""
    strategy._reset_optimizers_and_schedulers()


def strategy_precision_plugin(strategy: Any) -> Precision | None:
    """The precision plugin stored on ``strategy`` (``None`` before one is set; Lightning's connector reads it)."""
    plugin: Precision | None = strategy._precision_plugin
    return plugin


def set_strategy_precision_plugin(strategy: Any, plugin: Precision | None) -> None:
    """Store ``plugin`` where the ``Strategy.precision_plugin`` property and Lightning's connector look."""
    strategy._precision_plugin = plugin


def set_module_device_mesh(module: pl.LightningModule, mesh: Any) -> None:
    """Expose ``mesh`` as ``LightningModule.device_mesh`` (read in ``configure_model``)."""
    module._device_mesh = mesh


def flatten_mesh_dims(mesh: Any, dims: tuple[str, ...], name: str) -> Any:
    """Make ``mesh[name]`` the ranks of ``dims`` taken together (torch's private ``DeviceMesh._flatten``, which
    torchtitan uses for its data-parallel dim)."""
    return mesh[dims]._flatten(mesh_dim_name=name)


def after_closure(precision: Precision, model: pl.LightningModule, optimizer: Any) -> None:
    """Lightning's post-closure step of a precision plugin: ``on_before_optimizer_step`` hooks, then clipping."""
    precision._after_closure(model, optimizer)


# ---------------------------------------------------------------------------------------------- torch
def foreach_norm(tensors: list[Tensor], ord: float = 2.0, dtype: torch.dtype | None = None) -> tuple[Tensor, ...]:
    """The ``ord``-norm of each tensor of a list, fused (``torch._foreach_norm``), accumulated in ``dtype`` if given."""
    return torch._foreach_norm(tensors, ord, dtype=dtype)


def foreach_sub_(tensors: list[Tensor], others: list[Tensor]) -> None:
    """``tensors[i] -= others[i]`` for all i in one fused call (``torch._foreach_sub_``)."""
    torch._foreach_sub_(tensors, others)


def amp_update_scale_(
    scale: Tensor, growth_tracker: Tensor, found_inf: Tensor, growth_factor: float, backoff_factor: float, interval: int
) -> None:
    """torch's fused dynamic loss-scale update (``torch._amp_update_scale_``, what ``GradScaler.update`` runs)."""
    torch._amp_update_scale_(scale, growth_tracker, found_inf, growth_factor, backoff_factor, interval)


def foreach_mul_(tensors: list[Tensor], scalar: Tensor) -> None:
    """Multiply every tensor of a list in place by the 0-dim tensor ``scalar``, fused (``torch._foreach_mul_``)."""
    torch._foreach_mul_(tensors, scalar)


def dtensor_global_offset(tensor: Tensor) -> tuple[int, ...]:
    """Where a ``DTensor``'s local shard starts in the whole tensor, per dim (torch's own sharding arithmetic,
    uneven shards included; ``torch.distributed.tensor._utils.compute_local_shape_and_global_offset``)."""
    compute = _private("torch.distributed.tensor._utils", "compute_local_shape_and_global_offset")
    _, offset = compute(tensor.shape, tensor.device_mesh, tensor.placements)  # type: ignore[attr-defined]
    return tuple(offset)


def sparse_values(tensor: Tensor) -> Tensor:
    """The stored values of a sparse COO tensor, without coalescing (a view, no copy)."""
    return tensor._values()


def tensor_version(tensor: Tensor) -> int:
    """torch's count of the in-place writes to ``tensor`` (its version counter: a host integer, read without a
    sync)."""
    return int(tensor._version)


def in_backward() -> bool:
    """Whether autograd runs a backward pass on this thread now (a forward run then is activation checkpointing's
    recomputation of one already run); a host integer, no sync."""
    return bool(torch._C._current_graph_task_id() != -1)


def is_batchnorm(module: nn.Module) -> TypeGuard[nn.modules.batchnorm._BatchNorm]:
    """Whether ``module`` is a batch norm of any kind (``BatchNorm1d/2d/3d``, ``SyncBatchNorm``, lazy ones)."""
    return isinstance(module, _private("torch.nn.modules.batchnorm", "_BatchNorm"))


def privateuse1_backend_name() -> str:
    """The name of torch's out-of-tree ("privateuse1") device backend (``"privateuseone"`` unless renamed)."""
    return str(torch._C._get_privateuse1_backend_name())


def activation_checkpoint(module: nn.Module) -> None:
    """Recompute ``module``'s activations in backward (torch's composable, non-reentrant ``checkpoint``)."""
    _private("torch.distributed._composable", "checkpoint")(module)


@functools.cache
def cpu_amx_dtypes() -> frozenset[torch.dtype]:
    """The half-precision dtypes this CPU multiplies on AMX tiles, the only CPU units that run them faster than
    fp32: ``torch.bfloat16`` (AMX-BF16), ``torch.float16`` (AMX-FP16). Empty without AMX (AVX512-BF16 alone does not
    count: a bf16 step on it took 2.4x an fp32 one, ``benchmarks/README.md``'s ``preset_precision``) or where the
    operating system refuses this process the tiles.

    The flags are torch's public ``torch.cpu.get_capabilities()``; ``torch.cpu._init_amx()`` (private) asks the
    kernel for the tile state, as torch's own CPU code generation does before it uses AMX. Asked once a process.
    """
    flags = torch.cpu.get_capabilities()
    found = {dtype for key, dtype in (("amx_bf16", torch.bfloat16), ("amx_fp16", torch.float16)) if flags.get(key)}
    if not found or not flags.get("amx_tile") or not _private("torch.cpu", "_init_amx")():
        return frozenset()
    return frozenset(found)


#: the file ``torch.distributed.checkpoint``'s ``FileSystemWriter`` writes last into a checkpoint directory
#: (torch's private ``torch.distributed.checkpoint.filesystem._metadata_fn``; checked at strategy setup)
DCP_METADATA_FILE = ".metadata"


def step_supports_amp_scaling(optimizer: Any) -> bool:
    """Whether ``optimizer`` (fused Adam/AdamW/SGD) unscales and skips inside ``step()`` itself."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def scaler_optimizer_state(scaler: Any, optimizer: Optimizer) -> dict[str, Any] | None:
    """torch's per-optimizer GradScaler state (``stage``, ``found_inf_per_device``), if the optimizer has one."""
    states: dict[int, dict[str, Any]] = scaler._per_optimizer_states
    return states.get(id(optimizer))


def scaler_optimizer_state_by_id(scaler: Any, key: int) -> dict[str, Any] | None:
    """torch's per-optimizer GradScaler state under ``id(optimizer)``, without creating one."""
    states: dict[int, dict[str, Any]] = scaler._per_optimizer_states
    return states.get(key)


def scaler_found_inf(scaler: Any, optimizer: Optimizer) -> dict[torch.device, Tensor]:
    """The scaler's overflow flags of ``optimizer`` after ``unscale_`` (empty before it)."""
    state = scaler_optimizer_state(scaler, optimizer)
    return state["found_inf_per_device"] if state else {}


def scaler_is_ready(scaler: Any, optimizer: Optimizer) -> bool:
    """Whether ``unscale_`` has not yet run for ``optimizer`` in this step."""
    from torch.amp.grad_scaler import OptState

    state = scaler._per_optimizer_states[id(optimizer)]
    return state["stage"] is OptState.READY


def reset_scaler_optimizer_states(scaler: Any) -> None:
    """Forget every optimizer's scaler state for the next step, as ``GradScaler.update`` does at its end."""
    scaler._per_optimizer_states = defaultdict(_refresh_per_optimizer_state())


@functools.cache
def _refresh_per_optimizer_state() -> Any:
    return _private("torch.amp.grad_scaler", "_refresh_per_optimizer_state")


def scaler_scale(scaler: Any) -> Tensor | None:
    """The GradScaler's current scale as its device tensor (``get_scale()`` would read it on the host)."""
    scale: Tensor | None = scaler._scale
    return scale


def scaler_device(scaler: Any, default: str) -> str:
    """The device type a GradScaler was built for (``default`` for scalers that do not record one)."""
    return str(getattr(scaler, "_device", default))


# ---------------------------------------------------------------------------------------------- checks
_TORCH_OPS = ("_foreach_norm", "_foreach_mul_", "_foreach_sub_", "_amp_update_scale_")
#: what an enabled GradScaler must have (TunedGradScaler subclasses it and uses these too)
_SCALER_ATTRS = (
    "_per_optimizer_states",
    "_scale",
    "_init_scale",
    "_growth_factor",
    "_backoff_factor",
    "_growth_interval",
    "_enabled",
)
_SCALER_METHODS = (
    "_unscale_grads_",
    "_lazy_init_scale_growth_tracker",
    "_check_scale_growth_tracker",
    "_maybe_opt_step",
)


def _check_torch_ops() -> None:
    for name in _TORCH_OPS:
        _require_attr(torch, name, "torch")


def _check_scaler(scaler: Any) -> None:
    if scaler is None or not scaler.is_enabled():
        return
    for name in (*_SCALER_ATTRS, *_SCALER_METHODS):
        _require_attr(scaler, name, "GradScaler")
    _private("torch.amp.grad_scaler", "_refresh_per_optimizer_state")


def check_supported(trainer: pl.Trainer) -> None:
    """Raise one clear error at ``setup`` when a private name used here is missing."""
    loop = trainer.fit_loop.epoch_loop
    for name in ("_batches_that_stepped", "_accumulated_batches_reached"):
        if not hasattr(loop, name):
            raise _unsupported(f"the training epoch loop's `{name}`")
    if not hasattr(trainer, "_logger_connector"):
        raise _unsupported("the Trainer's `_logger_connector`")
    for name in ("_callback_metrics", "log_metrics", "update_train_step_metrics"):
        _require_attr(trainer._logger_connector, name, "the logger connector")
    _require_attr(pl.Callback, "_generate_state_key", "Callback")
    _check_torch_ops()
    _private("torch.nn.modules.batchnorm", "_BatchNorm")
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    _check_scaler(scaler)
    warn_if_untested()


def check_strategy_supported(strategy: Any) -> None:
    """Raise one clear error at ``StableFSDPStrategy`` setup when a private name the strategy uses is missing."""
    from lightning.pytorch.plugins.precision import Precision
    from lightning.pytorch.strategies import Strategy

    for name in (
        "_get_default_process_group_backend_for_device",
        "_init_dist_connection",
        "_sync_ddp_if_available",
    ):
        _private(_FABRIC_DISTRIBUTED, name)
    _private("lightning.fabric.utilities.init", "_materialize_distributed_module")
    _private("lightning.fabric.utilities.optimizer", "_optimizers_to_device")
    _private(*_LAUNCHER)
    for name in ("_configure_launcher", "_reset_optimizers_and_schedulers"):
        _require_attr(Strategy, name, "Lightning's Strategy")
    for name in ("_launcher", "_precision_plugin"):
        if name not in vars(strategy):
            raise _unsupported(f"Lightning's Strategy's `{name}`")
    _require_attr(Precision, "_after_closure", "Lightning's Precision plugin")
    if strategy.lightning_module is not None:
        _require_attr(strategy.lightning_module, "_device_mesh", "LightningModule")
    _private("torch.distributed._composable", "checkpoint")
    from torch.distributed.device_mesh import DeviceMesh

    _require_attr(DeviceMesh, "_flatten", "torch's DeviceMesh")
    if _private("torch.distributed.checkpoint.filesystem", "_metadata_fn") != DCP_METADATA_FILE:
        raise _unsupported(f"`{DCP_METADATA_FILE}` as the metadata file of torch.distributed.checkpoint")
    _check_torch_ops()
    _check_scaler(getattr(strategy_precision_plugin(strategy), "scaler", None))
    warn_if_untested()


# ---------------------------------------------------------------------------------------------- checkpoints
def dcp_file_writer_rank(name: str) -> int | None:
    """The rank that wrote the shard file ``name`` of a ``torch.distributed.checkpoint`` directory, or ``None``.

    ``FileSystemWriter`` names each rank's files ``__<rank>_<n>.distcp`` (the prefix its global plan gives each
    rank's plan, in rank order); a name of another form is no rank's.
    """
    match = re.fullmatch(r"__(\d+)_\d+\.distcp", name)
    return int(match.group(1)) if match else None


def dcp_file_extents(metadata: Any) -> dict[str, int]:
    """The files a ``torch.distributed.checkpoint`` directory's metadata references, each with the size it needs.

    ``FileSystemWriter`` records where every item lies in ``metadata.storage_data`` (torch's private
    ``_StorageInfo``: ``relative_path``, ``offset``, ``length``); a file shorter than its last item's end was
    cut short.
    """
    extents: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        if not all(hasattr(info, name) for name in ("relative_path", "offset", "length")):
            raise _unsupported("torch.distributed.checkpoint's per-item storage info (relative_path, offset, length)")
        end = int(info.offset) + int(info.length)
        extents[info.relative_path] = max(extents.get(info.relative_path, 0), end)
    return extents


def dcp_item_ranges(metadata: Any) -> dict[str, list[tuple[int, int]]]:
    """Where the items of a ``torch.distributed.checkpoint`` directory lie: ``{file: [(offset, length), ...]}``,
    from the same private ``_StorageInfo`` records as :func:`dcp_file_extents` (each tensor item is one
    ``torch.save`` archive; a bytes item is raw bytes)."""
    dcp_file_extents(metadata)  # the records' fields checked
    ranges: dict[str, list[tuple[int, int]]] = {}
    for info in (metadata.storage_data or {}).values():
        ranges.setdefault(info.relative_path, []).append((int(info.offset), int(info.length)))
    return {name: sorted(found) for name, found in ranges.items()}


def strategy_checkpoint_io(strategy: Any) -> Any:
    """The CheckpointIO a user gave ``strategy`` (``None`` if none: the ``checkpoint_io`` property would make one)."""
    return getattr(strategy, "_checkpoint_io", None)


# ---------------------------------------------------------------------------------------------- StableCheckpoint
#: the private ``ModelCheckpoint`` methods ``StableCheckpoint`` overrides or calls (each is where Lightning saves,
#: removes, names or finds a checkpoint; checked at its setup)
_MODEL_CHECKPOINT_METHODS = (
    "_save_topk_checkpoint",
    "_save_last_checkpoint",
    "_save_checkpoint",
    "_remove_checkpoint",
    "_find_last_checkpoints",
    "_monitor_candidates",
    "_get_metric_interpolated_filepath_name",
    "_ModelCheckpoint__resolve_ckpt_dir",
)
_SIGNAL_CONNECTOR = "lightning.pytorch.trainer.connectors.signal_connector"


def check_model_checkpoint_supported() -> None:
    """Raise one clear error at ``StableCheckpoint`` setup when a private Lightning name it relies on is missing."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    for name in _MODEL_CHECKPOINT_METHODS:
        _require_attr(ModelCheckpoint, name, "ModelCheckpoint")
    _private(_SIGNAL_CONNECTOR, "_HandlersCompose")
    connector = _private(_SIGNAL_CONNECTOR, "_SignalConnector")
    for name in ("_slurm_sigusr_handler_fn", "_sigterm_notifier_fn"):
        _require_attr(connector, name, "Lightning's signal connector")


def model_checkpoint_dir(callback: Any, trainer: pl.Trainer) -> str:
    """Where a ``ModelCheckpoint`` saves (its ``dirpath``, else derived from the logger), also before its setup."""
    return str(callback._ModelCheckpoint__resolve_ckpt_dir(trainer))


def model_checkpoint_saved_at(callback: Any) -> int:
    """The ``global_step`` of a ``ModelCheckpoint``'s last save (0 before any)."""
    return int(callback._last_global_step_saved)


def record_model_checkpoint_save(callback: Any, trainer: pl.Trainer, filepath: str) -> None:
    """What ``ModelCheckpoint._save_checkpoint`` records after writing ``filepath`` (the step and path of the last
    save; the loggers' ``after_save_checkpoint``), for a save written another way."""
    from weakref import proxy

    callback._last_global_step_saved = trainer.global_step
    callback._last_checkpoint_saved = filepath
    if trainer.is_global_zero:
        for logger in trainer.loggers:
            logger.after_save_checkpoint(proxy(callback))  # type: ignore[arg-type]  # as Lightning does


def dump_checkpoint(trainer: pl.Trainer) -> dict[str, Any]:
    """The checkpoint dict ``Trainer.save_checkpoint`` would write (every rank calls it: it may gather)."""
    checkpoint: dict[str, Any] = trainer._checkpoint_connector.dump_checkpoint(False)
    return checkpoint


def split_lightning_signal_handler(handler: Any) -> tuple[list[Callable[..., Any]], list[Callable[..., Any]]] | None:
    """Lightning's composed signal handler (``Trainer`` installs it at fit) as ``(requeue, others)``; else ``None``.

    ``requeue``: Lightning's SLURM auto-requeue handler (saves ``hpc_ckpt_<n>.ckpt``, runs ``scontrol requeue``).
    ``others``: the handlers that were installed before the Trainer's (a user's own). Lightning's SIGTERM
    notifier (it makes the loop raise ``SIGTERMException`` at the batch's end) and its SIGTERM bypass (a log
    line) are left out: a caller that stops the Trainer cleanly itself must not run them.
    """
    if not isinstance(handler, _private(_SIGNAL_CONNECTOR, "_HandlersCompose")):
        return None
    connector = _private(_SIGNAL_CONNECTOR, "_SignalConnector")
    requeue: list[Callable[..., Any]] = []
    others: list[Callable[..., Any]] = []
    for part in handler.signal_handlers:
        if isinstance(getattr(part, "__self__", None), connector):
            if getattr(part, "__name__", "") == "_slurm_sigusr_handler_fn":
                requeue.append(part)
        elif callable(part):
            others.append(part)
    return requeue, others


# ---------------------------------------------------------------------------------------------- fused per-tensor
# math of lightning_stability.precursors (torch's ``_foreach_*`` ops: one kernel per group of tensors on a GPU)
def foreach_pow(base: float, exponents: list[Tensor]) -> tuple[Tensor, ...]:
    """``base ** exponents[i]`` for all i (``torch._foreach_pow``), e.g. Adam's ``beta ** step``."""
    return torch._foreach_pow(base, exponents)


def foreach_sqrt(tensors: list[Tensor]) -> tuple[Tensor, ...]:
    """``sqrt(tensors[i])`` for all i (``torch._foreach_sqrt``)."""
    return torch._foreach_sqrt(tensors)


def foreach_div(tensors: list[Tensor], others: list[Tensor]) -> tuple[Tensor, ...]:
    """``tensors[i] / others[i]`` for all i (``torch._foreach_div``); ``others`` may be 0-dim tensors."""
    return torch._foreach_div(tensors, others)


def foreach_copy_(tensors: list[Tensor], sources: list[Tensor]) -> None:
    """``tensors[i].copy_(sources[i])`` for all i, in one fused call (``torch._foreach_copy_``)."""
    torch._foreach_copy_(tensors, sources)


def foreach_mul_scalars_(tensors: list[Tensor], scalars: list[float] | list[Tensor]) -> None:
    """``tensors[i] *= scalars[i]`` in place for all i (``torch._foreach_mul_``)."""
    torch._foreach_mul_(tensors, scalars)


def foreach_one_minus_(tensors: list[Tensor]) -> None:
    """``tensors[i] = 1 - tensors[i]`` in place for all i (``torch._foreach_sub_`` then ``_foreach_neg_``)."""
    torch._foreach_sub_(tensors, 1)
    torch._foreach_neg_(tensors)


def foreach_below_(tensors: list[Tensor], threshold: float) -> None:
    """In place: ``-1`` where ``tensors[i] < threshold``, else ``0`` (``_foreach_sub_``, ``_foreach_clamp_max_``,
    ``_foreach_sign_``): the 1-norm of the result counts the coordinates below ``threshold``."""
    torch._foreach_sub_(tensors, threshold)
    torch._foreach_clamp_max_(tensors, 0.0)
    torch._foreach_sign_(tensors)
