"""StableTrainer: a ``lightning.Trainer`` built from a preset, with every callback and the strategy configured.

``StableTrainer.from_preset("175b", **overrides)`` takes the recipe's numbers and applies them on the user's
hardware: what cannot apply there (8 nodes on one machine, FSDP on one device, tensor parallelism on one device
or wider than a node, bf16 or fp16 on a CPU that runs them slower than fp32, fp16 on a CPU, which needs an explicit
loss-scaler plugin) is adapted and said in one info line. Overrides are any preset field or any ``Trainer``
argument; anything else is an error naming it.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.accelerators import CPUAccelerator, MPSAccelerator, XLAAccelerator
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, ProgressBar
from lightning.pytorch.plugins import MixedPrecision
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lightning_stability import _compat
from lightning_stability.accumulation.callback import GradientAccumulation
from lightning_stability.amp.callback import LossScaleTuner
from lightning_stability.checkpoint.callback import StableCheckpoint
from lightning_stability.checkpoint.io import local_path
from lightning_stability.cluster.watchdog import WatchdogSettings, watchdog_settings
from lightning_stability.critical_batch.callback import BatchRamp
from lightning_stability.errors import StabilityConfigError, check_instance, config_error
from lightning_stability.grad_norm import GradientNormMonitor
from lightning_stability.health.callback import TrainingHealthMonitor
from lightning_stability.ledger.callback import LedgerCallback
from lightning_stability.moe.callback import RouterHealthMonitor
from lightning_stability.precursors.callback import LRBackoff, PrecursorMonitor
from lightning_stability.presets import FIELDS, PRESETS, Preset, batch_mismatch, get_preset, layout
from lightning_stability.progress import stability_progress_bar
from lightning_stability.replay.callback import StepReplay
from lightning_stability.schedules.callback import WarmupConstantCosineLR
from lightning_stability.strategies import StableFSDPStrategy

_ALIASES = {"16": "16-mixed", "bf16": "bf16-mixed", "32": "32-true"}
_TRAINER_ARGS = frozenset(inspect.signature(pl.Trainer.__init__).parameters) - {"self"}


def _nodes_in_environment() -> int:
    """Machines this job runs on, as far as the launcher says (SLURM, torchrun); 1 otherwise."""
    if os.environ.get("SLURM_NNODES", "").isdigit():
        return int(os.environ["SLURM_NNODES"])
    world, local = os.environ.get("WORLD_SIZE", ""), os.environ.get("LOCAL_WORLD_SIZE", "")
    if world.isdigit() and local.isdigit() and int(local) > 0:
        return max(1, int(world) // int(local))
    return 1


def _devices_per_node(devices: Any, gpu: bool) -> int:
    if isinstance(devices, int) and devices > 0:
        return devices
    if isinstance(devices, (list, tuple)):
        return len(devices)
    if isinstance(devices, str) and devices.isdigit():
        return int(devices)
    return torch.cuda.device_count() if gpu else 1


class StableTrainer(pl.Trainer):
    """A ``lightning.Trainer`` that can be built from a preset: :meth:`from_preset` in Python, or
    ``preset=`` / ``preset_overrides=`` as constructor arguments (so ``LightningCLI(trainer_class=StableTrainer)``
    takes ``--trainer.preset 175b``). Without a preset it is a plain Trainer. ``preset`` holds the recipe used.

    Args:
        preset: a preset name (``lightning-stability presets`` lists them), or ``None``.
        preset_overrides: preset fields to change, e.g. ``{"max_norm": 0.3}``.
        **kwargs: any ``lightning.Trainer`` argument; ``callbacks`` come after the preset's.
    """

    def __init__(
        self,
        *args: Any,
        preset: str | Preset | None = None,
        preset_overrides: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        recipe = None
        if preset_overrides is not None:
            check_instance("preset_overrides", preset_overrides, dict, "a dict of preset fields", '{"max_norm": 0.3}')
        if preset is not None:
            recipe, kwargs = _preset_arguments(preset, dict(preset_overrides or {}), kwargs)
        elif preset_overrides:
            raise StabilityConfigError(
                f"StableTrainer(preset_overrides={preset_overrides}) without a preset. Fix: pass preset=NAME too."
            )
        super().__init__(*args, **kwargs)
        self.preset: Preset | None = recipe

    @classmethod
    def from_preset(cls, name: str | Preset, **overrides: Any) -> StableTrainer:
        """The Trainer of preset ``name`` with ``overrides`` (preset fields or Trainer arguments) applied, adapted
        to this machine (what it changes is said in one info line).

        Args:
            name: a preset name (``lightning-stability presets`` lists them) or a
                :class:`~lightning_stability.presets.Preset`.
            **overrides: any preset field (``max_norm=0.3``, ``accumulation=8``, ...) or ``lightning.Trainer``
                argument. These turn a part off, to be replaced by a callback of your own if you want:
                ``lr_schedule=False`` (no ``WarmupConstantCosineLR``), ``max_norm=None`` (no clipping; the norm is
                still measured), ``health=None`` (no ``TrainingHealthMonitor``), ``lr_backoff=None`` (no
                ``PrecursorMonitor``: no LR back-off, no precursor metrics), ``accumulation=1`` (no
                ``GradientAccumulation``), ``checkpoint=False`` (no ``StableCheckpoint``: Lightning's
                checkpointing applies), ``watchdog=False`` (the NCCL watchdog
                variables and the process-group timeout left as they are). ``callbacks=[...]`` come after the
                preset's.

        Raises:
            StabilityConfigError: for no preset (``None``: a Trainer without a preset is ``lightning.Trainer`` or
                ``StableTrainer()``), an unknown preset, override or bad value; for a callback in ``callbacks``
                of a kind the preset already attaches (the error names the field to change, or the override that
                turns the preset's off); for ``gradient_clip_val`` while the preset clips (``max_norm``).

        Example::

            trainer = StableTrainer.from_preset("175b", accelerator="cpu", devices=2, max_steps=10)
            trainer = StableTrainer.from_preset("gpt", health=None, callbacks=[TrainingHealthMonitor(spike_z=4.0)])
        """
        if not isinstance(name, (str, Preset)):
            # from_preset(config.get("preset")) with the key unset: a Trainer with no stability callbacks, unnoticed
            raise config_error(
                "name",
                name,
                f"is not a preset: from_preset builds one of {', '.join(PRESETS)}",
                "pass a preset's name, e.g. StableTrainer.from_preset('gpt') (`lightning-stability presets` lists "
                "them) or a Preset; for a Trainer without a preset, build lightning.Trainer(...) or StableTrainer(...)",
            )
        preset_name = name.name if isinstance(name, Preset) else name
        unknown = sorted(set(overrides) - set(FIELDS) - _TRAINER_ARGS)
        if unknown:
            raise StabilityConfigError(
                f"StableTrainer.from_preset({preset_name!r}) got unknown override(s) {unknown}. Fix: pass a preset "
                f"field ({', '.join(FIELDS)}) or a lightning.Trainer argument."
            )
        fields = {k: v for k, v in overrides.items() if k in FIELDS}
        return cls(preset=name, preset_overrides=fields, **{k: v for k, v in overrides.items() if k not in FIELDS})


def _preset_arguments(
    name: str | Preset, fields: dict[str, Any], args: dict[str, Any]
) -> tuple[Preset, dict[str, Any]]:
    """The preset with ``fields`` applied (and adapted to this hardware), and the Trainer arguments that build it."""
    preset = name if isinstance(name, Preset) else get_preset(name, "preset")
    unknown = sorted(set(fields) - set(FIELDS))
    if unknown:
        raise StabilityConfigError(
            f"preset_overrides has unknown preset field(s) {unknown}. Fix: use one of {', '.join(FIELDS)}."
        )
    args = dict(args)
    if args.get("precision", "") is None:  # Lightning's default (LightningCLI passes every argument)
        del args["precision"]
    if "precision" in args:  # a preset field too: the recipe adapts it to the hardware (e.g. fp16 on a CPU)
        fields.setdefault("precision", args.pop("precision"))
    chosen = "precision" in fields  # the user's precision: kept as given (fp16 on a CPU gets a scaler plugin)
    if "precision" in fields:  # Lightning's short spellings
        fields["precision"] = _ALIASES.get(str(fields["precision"]), fields["precision"])
    preset = replace(preset, **fields)
    _check_clipping(preset, args.get("gradient_clip_val"))
    extra = args.pop("callbacks", None) or []
    extra = [extra] if isinstance(extra, Callback) else list(extra)
    notes: list[str] = []
    preset, hardware = _hardware(preset, args, notes, chosen)
    args.update(hardware)
    callbacks = _callbacks(preset, args)
    _check_duplicates(preset, callbacks, extra)
    checkpoint = _stable_checkpoint(preset, args, extra)
    if checkpoint is not None:
        callbacks.append(checkpoint)
    if args.get("enable_progress_bar") is not False and not any(isinstance(cb, ProgressBar) for cb in extra):
        callbacks.append(stability_progress_bar())  # the stability metrics beside the loss
    if notes:
        rank_zero_info(f"StableTrainer preset {preset.name!r} on this hardware: " + "; ".join(notes) + ".")
    args["callbacks"] = [*callbacks, *extra]
    return preset, args


def _check_clipping(preset: Preset, clip: Any) -> None:
    """``gradient_clip_val`` beside the preset's clipping (``max_norm``) would clip twice: refused here, naming the
    preset's override, rather than by the ``GradientNormMonitor`` the user never built."""
    if not clip or preset.max_norm is None:
        return
    raise StabilityConfigError(
        f"StableTrainer.from_preset({preset.name!r}) clips the gradient norm at max_norm={preset.max_norm} (its "
        f"GradientNormMonitor), and Trainer(gradient_clip_val={clip}) would clip a second time. Fix: keep one: "
        f"StableTrainer.from_preset({preset.name!r}, max_norm=None, gradient_clip_val={clip}) clips with "
        f"Lightning's (the norm is still measured and logged), or drop gradient_clip_val and pass "
        f"max_norm={clip} to clip at your value with the preset's. (StableTrainer(preset=...) and LightningCLI: "
        "preset_overrides={'max_norm': None}.)"
    )


def _hardware(preset: Preset, args: dict[str, Any], notes: list[str], chosen: bool) -> tuple[Preset, dict[str, Any]]:
    """The preset as it runs on this machine, and its nodes, strategy and precision; ``notes`` say what differs
    from the recipe. ``chosen``: the precision is the user's (not adapted)."""
    out: dict[str, Any] = {}
    own_plugin = any(isinstance(p, MixedPrecision) for p in _plugins(args))
    accelerator = args.get("accelerator", "auto")
    gpu = torch.cuda.is_available() and str(accelerator) in ("auto", "gpu", "cuda")
    nodes = args.get("num_nodes")
    if nodes is None:
        nodes = min(preset.num_nodes, _nodes_in_environment())
        if nodes != preset.num_nodes:
            notes.append(
                f"num_nodes {preset.num_nodes} -> {nodes} (the job runs on {nodes} machine(s); num_nodes= sets it)"
            )
        out["num_nodes"] = nodes
    per_node = _devices_per_node(args.get("devices", "auto"), gpu)
    world = nodes * per_node
    plan = layout(
        preset,
        world_size=world,
        devices_per_node=per_node,
        gpu=gpu,
        bf16=gpu and torch.cuda.is_bf16_supported(),
        cpu_fast=_cpu_fast(accelerator) if not gpu else None,
        own_strategy="strategy" in args,
        own_precision=chosen or own_plugin,
    )
    notes.extend(plan.notes)
    preset = replace(preset, precision=plan.precision)  # type: ignore[arg-type]
    fsdp = plan.fsdp
    watchdog = _watchdog(preset, world, fsdp, notes)
    if fsdp:
        mixed = {"16-mixed": True, "bf16-mixed": torch.bfloat16, "32-true": False}[preset.precision]
        out["strategy"] = StableFSDPStrategy(
            mixed_precision=None if own_plugin else mixed,
            activation_checkpointing=plan.activation_checkpointing,
            tensor_parallel=plan.tensor_parallel,
            timeout=watchdog.timeout if watchdog is not None else default_pg_timeout,
        )
    if own_plugin or fsdp:
        return preset, out
    if preset.precision == "16-mixed" and not gpu:
        # Lightning turns precision="16-mixed" on a CPU into bf16; an explicit scaler plugin keeps fp16
        out["plugins"] = [
            *out.get("plugins", _plugins(args)),
            MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu")),
        ]
        notes.append("fp16 on the CPU through an explicit loss-scaler plugin")
    else:
        out["precision"] = preset.precision
    return preset, out


def _cpu_fast(accelerator: Any) -> frozenset[str] | None:
    """The mixed precisions this run's CPU runs faster than fp32 (on AMX tiles); ``None`` when the run is not on
    the CPU (``accelerator="auto"`` picks MPS or a TPU where there is one: their precision is left as it is)."""
    on_cpu = str(accelerator) == "cpu" or isinstance(accelerator, CPUAccelerator)
    if str(accelerator) == "auto":
        on_cpu = not (MPSAccelerator.is_available() or XLAAccelerator.is_available())
    if not on_cpu:
        return None
    dtypes = _compat.cpu_amx_dtypes()
    return frozenset(name for name, dtype in _CPU_DTYPES.items() if dtype in dtypes)


_CPU_DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


def _watchdog(preset: Preset, world: int, fsdp: bool, notes: list[str]) -> WatchdogSettings | None:
    """For a run of several processes, unless ``watchdog=False``: the NCCL watchdog variables a long run wants,
    set in ``os.environ`` where the user has not set them (before the process group exists, so they act), and the
    shorter process-group timeout for the preset's own FSDP strategy. Said in the info line."""
    if world < 2 or not preset.watchdog:
        return None
    settings = watchdog_settings(os.environ)
    os.environ.update(settings.env)
    # else the strategy is Lightning's or yours: its timeout
    notes.append(settings.describe(timeout_applied=fsdp) + "; watchdog=False leaves them as they are")
    return settings if fsdp else None


def _plugins(args: dict[str, Any]) -> list[Any]:
    """The user's ``plugins=`` as a list (Lightning also takes one plugin on its own)."""
    plugins = args.get("plugins") or []
    return list(plugins) if isinstance(plugins, (list, tuple)) else [plugins]


def _fp16(preset: Preset, args: dict[str, Any]) -> bool:
    plugins = [p for p in args.get("plugins") or [] if isinstance(p, MixedPrecision)]
    if plugins:  # the user's (or the CPU fp16) plugin decides
        return any(str(p.precision) == "16-mixed" for p in plugins)
    return str(args.get("precision", preset.precision)) in ("16-mixed", "16")


@dataclass(frozen=True)
class _Part:
    """One callback a preset attaches: how it is built from the preset (``None``: turned off), the preset fields
    that configure it, and the override that turns it off (``None``: none does)."""

    kind: type[Callback]
    build: Callable[[Preset, dict[str, Any]], Callback | None]
    fields: str
    off: str | None = None


class EffectiveBatchCheck(Callback):
    """Says once at fit start when the run's global batch is not the preset's ``effective_batch``.

    The global batch is the training DataLoader's ``batch_size`` x the accumulation the Trainer runs
    (``GradientAccumulation``'s, else ``accumulate_grad_batches``) x the data-parallel processes (the strategy's
    ``distributed_sampler_kwargs``). Nothing is changed: a warning names the settings that reach the preset's
    batch (:func:`~lightning_stability.presets.batch_mismatch`). A loader without a ``batch_size`` (a batch
    sampler of its own, several loaders) is said in an info line, unchecked.

    Args:
        preset: the preset's name (in the message).
        effective_batch: the global batch it was written for.
    """

    def __init__(self, preset: str, effective_batch: int) -> None:
        self.preset, self.effective_batch = preset, effective_batch

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        loader = trainer.train_dataloader
        batch_size = getattr(loader, "batch_size", None) or getattr(
            getattr(loader, "batch_sampler", None), "batch_size", None
        )
        if not isinstance(batch_size, int):
            rank_zero_info(
                f"StableTrainer preset {self.preset!r} was written for a global batch of {self.effective_batch}; "
                "this run's is not checked (its training loader has no batch_size)."
            )
            return
        sampler = getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {}
        data_parallel = int(sampler.get("num_replicas", 1) or 1)
        message = batch_mismatch(
            self.preset, self.effective_batch, batch_size, trainer.accumulate_grad_batches, data_parallel
        )
        if message is not None:
            rank_zero_warn(message)


#: ``top_modules`` for ``per_layer=True``: more than any model's module count, so every module's ratio is logged
EVERY_MODULE = 2**31 - 1


def _health(preset: Preset) -> TrainingHealthMonitor | None:
    """The preset's health monitor; its ``top_modules`` follows ``per_layer`` (``False``: the monitor's default)."""
    if preset.health is None:
        return None
    kwargs: dict[str, Any] = {"skip_on": preset.skip_on if preset.health == "skip" else "any"}
    if preset.per_layer is not False:
        kwargs["top_modules"] = EVERY_MODULE if preset.per_layer is True else int(preset.per_layer)
    return TrainingHealthMonitor(response=preset.health, **kwargs)


def _replay(preset: Preset, args: dict[str, Any]) -> StepReplay | None:
    """``StepReplay`` with ``replay=True``; refused at once under fp16 loss scaling (where it cannot run)."""
    if not preset.replay:
        return None
    if _fp16(preset, args):
        raise config_error(
            "replay",
            True,
            "cannot run under fp16 loss scaling (the scaler judged the original gradients before a replay could run)",
            "pass precision='bf16-mixed' (or '32-true') with replay=True, or replay=False",
        )
    return StepReplay()


#: the preset's callbacks, in the order they are attached
_PARTS = (
    _Part(
        GradientNormMonitor,
        lambda p, a: GradientNormMonitor(max_norm=p.max_norm, per_layer=p.per_layer),
        "max_norm, per_layer",
    ),
    _Part(
        WarmupConstantCosineLR,
        lambda p, a: (
            WarmupConstantCosineLR(warmup=p.warmup, decay=p.decay, min_lr_ratio=p.min_lr_ratio)
            if p.lr_schedule
            else None
        ),
        "warmup, decay, min_lr_ratio",
        "lr_schedule=False",
    ),
    _Part(
        GradientAccumulation,
        lambda p, a: (
            GradientAccumulation(steps=p.accumulation, lr_scaling=p.lr_scaling) if p.accumulation > 1 else None
        ),
        "accumulation, lr_scaling",
        "accumulation=1",
    ),
    _Part(
        BatchRamp,
        lambda p, a: BatchRamp(max_factor=p.batch_ramp) if p.batch_ramp is not None else None,
        "batch_ramp",
        "batch_ramp=None",
    ),
    _Part(
        LossScaleTuner,
        lambda p, a: LossScaleTuner(init_scale=p.init_scale, hysteresis=p.hysteresis) if _fp16(p, a) else None,
        "init_scale, hysteresis",
    ),
    _Part(
        TrainingHealthMonitor,
        lambda p, a: _health(p),
        "health, skip_on, per_layer",
        "health=None",
    ),
    _Part(
        StepReplay,
        lambda p, a: _replay(p, a),
        "replay",
        "replay=False",
    ),
    _Part(
        PrecursorMonitor,
        lambda p, a: (
            PrecursorMonitor(lr_backoff=LRBackoff("update_ratio", p.lr_backoff), other_optimizers="warn")
            if p.lr_backoff is not None
            else None
        ),
        "lr_backoff",
        "lr_backoff=None",
    ),
    _Part(
        RouterHealthMonitor,
        lambda p, a: (
            RouterHealthMonitor(balance_bias=p.router_balance_bias, z_loss=p.router_z_loss) if p.router else None
        ),
        "router, router_balance_bias, router_z_loss",
        "router=False",
    ),
    _Part(
        EffectiveBatchCheck,
        lambda p, a: EffectiveBatchCheck(p.name, p.effective_batch) if p.effective_batch is not None else None,
        "effective_batch",
        "effective_batch=None",
    ),
)


def _callbacks(preset: Preset, args: dict[str, Any]) -> list[Callback]:
    built = (part.build(preset, args) for part in _PARTS)
    return [callback for callback in built if callback is not None]


#: a preset run of known length saves every 10% of it, and at least every 500 optimizer steps (torchtitan's default
#: checkpoint interval), so that a crash costs at most that much
SAVE_FRACTION, SAVE_EVERY_MAX = 0.1, 500


def checkpoint_interval(max_steps: Any) -> int | None:
    """The preset's ``every_n_train_steps`` for a run of ``max_steps`` optimizer steps; ``None`` when the length is
    not given (``max_steps=-1``, ``max_epochs`` only): then a save at each epoch end, Lightning's default."""
    if isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps <= 0:
        return None
    return min(SAVE_EVERY_MAX, max(1, int(max_steps * SAVE_FRACTION)))


def _stable_checkpoint(preset: Preset, args: dict[str, Any], extra: list[Callback]) -> StableCheckpoint | None:
    """The preset's ``StableCheckpoint`` in ``<default_root_dir>/checkpoints`` (the same directory in every run, so
    ``ckpt_path="last"`` finds it), every :func:`checkpoint_interval` steps and at the end; none with
    ``checkpoint=False``, ``enable_checkpointing=False``, a ``ModelCheckpoint`` of the user's, or a remote
    ``default_root_dir`` (Lightning's own ``ModelCheckpoint`` then applies)."""
    if not preset.checkpoint or args.get("enable_checkpointing") is False:
        return None
    if any(isinstance(cb, ModelCheckpoint) for cb in extra):
        return None
    root = local_path(args.get("default_root_dir") or os.getcwd())
    if root is None:
        return None
    every = checkpoint_interval(args.get("max_steps"))
    return StableCheckpoint(dirpath=root / "checkpoints", every_n_train_steps=every, save_at_end=every is not None)


def _check_duplicates(preset: Preset, ours: list[Callback], extra: list[Callback]) -> None:
    for cb in extra:
        if not isinstance(cb, LedgerCallback):
            continue
        clash = next((o for o in ours if isinstance(o, LedgerCallback) and isinstance(cb, o.kind())), None)
        if clash is not None:
            kind = clash.kind()
            part = next(p for p in _PARTS if type(clash) is p.kind)  # `ours` holds only the parts' callbacks
            fields, off = part.fields, part.off
            keep = f"; or turn the preset's off with {off} and keep yours" if off else ""
            raise StabilityConfigError(
                f"StableTrainer.from_preset({preset.name!r}) already attaches a {kind.__name__}, and callbacks= "
                f"adds another ({type(cb).__name__}). Fix: override the preset's instead ({fields}=...), e.g. "
                f"StableTrainer.from_preset({preset.name!r}, {fields.split(',')[0]}=...){keep}."
            )
