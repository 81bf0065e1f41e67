"""Named training recipes (clipping, LR schedule, precision, accumulation, sharding): one table, every value with
its source.

A :class:`Preset` is a complete, typed configuration of the package's callbacks and strategy. Variants derive
from a base with :func:`dataclasses.replace`, so a family (``gpt``) and a size (``over-10b``) do not multiply
into a table of combinations; ``StableTrainer.from_preset`` builds a Trainer from one and lets the user
override any field. Pure data: no Trainer is built here.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Collection
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal

from lightning_stability.errors import (
    check_bool,
    check_instance,
    check_int,
    check_length,
    check_number,
    check_ratio,
    config_error,
)
from lightning_stability.health.responses import RESPONSES, Response

Precision = Literal["16-mixed", "bf16-mixed", "32-true"]


@dataclass(frozen=True)
class Preset:
    """A recipe: the configuration of the callbacks and strategy ``StableTrainer.from_preset`` builds.

    Pass one to ``StableTrainer.from_preset`` or derive a variant with :meth:`derive`; every field is checked on
    construction. A part turned off can be replaced by a callback of your own in ``callbacks=[...]``.

    Attributes:
        name: the preset's name.
        description: one line on what it is for.
        max_norm: ``GradientNormMonitor(max_norm=...)``, the global gradient-norm clip; ``None``: no clipping
            (the norm is still measured).
        warmup: ``WarmupConstantCosineLR(warmup=...)``, a fraction of the run or a step count.
        decay: ``WarmupConstantCosineLR(decay=...)``, the cosine's length at the end of the run.
        min_lr_ratio: ``WarmupConstantCosineLR(min_lr_ratio=...)``, the floor of the decay as a fraction of the
            base LR.
        lr_schedule: attach ``WarmupConstantCosineLR``; ``False``: none (e.g. to keep the scheduler
            ``configure_optimizers`` returns).
        precision: ``"16-mixed"``, ``"bf16-mixed"`` or ``"32-true"``; ``"bf16-mixed"`` becomes ``"16-mixed"`` with
            a loss scaler on a GPU without bf16, and a mixed precision ``"32-true"`` on a CPU that does not run it
            faster than fp32 (no AMX tiles for it); a ``precision=`` you pass is kept.
        init_scale: ``LossScaleTuner(init_scale=...)`` (fp16 only).
        hysteresis: ``LossScaleTuner(hysteresis=...)`` (fp16 only).
        accumulation: ``GradientAccumulation(steps=...)``; 1: none.
        lr_scaling: ``GradientAccumulation(lr_scaling=...)``: ``"none"`` (the LR as configured), ``"linear"`` or
            ``"sqrt"``.
        batch_ramp: ``BatchRamp(max_factor=...)``: the accumulation grows from ``accumulation`` up to this while the
            measured critical batch is well above the batch (needs ``accumulation >= 2`` and ``lr_scaling``
            ``"sqrt"`` or ``"linear"``); ``None``: no ramp.
        effective_batch: the global batch the recipe was written for: samples per optimizer step over all
            data-parallel processes. The preset sets neither your DataLoader's ``batch_size`` nor the accumulation
            from it: at fit start a warning says when ``batch_size x accumulation x data-parallel processes``
            differs, and how to reach it; ``lightning-stability plan --preset`` plans the accumulation with it.
            ``None``: not checked.
        fsdp: shard with ``StableFSDPStrategy`` (full sharding).
        activation_checkpointing: the strategy's activation checkpointing (needs ``fsdp``).
        tensor_parallel: ``StableFSDPStrategy(tensor_parallel=...)``; 1: none (needs ``fsdp``, and a
            ``configure_model`` that applies a TP plan).
        num_nodes: the machines the recipe was written for (adapted to the job's).
        health: ``TrainingHealthMonitor(response=...)``; ``None``: no health monitor.
        skip_on: ``TrainingHealthMonitor(skip_on=...)`` under ``health="skip"``: ``"loss"``, an update is skipped
            on a loss spike (and a non-finite loss or gradient) and a gradient-norm spike alone is applied, clipped
            by ``max_norm``; ``"any"``: on either spike. Only ``health="skip"`` reads it (``"warn"`` and ``"clip"``
            skip no spike, ``"rollback"`` acts on either).
        lr_backoff: ``PrecursorMonitor(lr_backoff=LRBackoff("update_ratio", lr_backoff), other_optimizers="warn")``:
            while the update's norm exceeds this share of the weights' norm (measured every 4th step), the next
            updates' LR backs off (x0.5 per measurement past it; back up x1.02 per update once under), for any
            optimizer that reads its LR at each step; with ``Rprop`` it is off, with a warning. ``None``: no
            ``PrecursorMonitor``.
        per_layer: per-module figures on logging steps, under ``stability/<figure>_by_module/<module>``: ``True``,
            every module's gradient norm (``GradientNormMonitor(per_layer=True)``) and update-to-weight ratio
            (``TrainingHealthMonitor(top_modules=...)`` at least the module count); an int ``k``, the ``k``
            largest of each; ``False``, no gradient norm per module and the health monitor's 5 largest update
            ratios (its default). ``PrecursorMonitor`` logs each attention module's largest logit whatever this is.
        replay: attach ``StepReplay``: each step the health monitor flags is run again before its update and
            attributed (a transient fault is applied as replayed, bad data skipped and quarantined, a failing device
            named). Needs ``health``; refused under fp16 loss scaling.
        router: attach ``RouterHealthMonitor`` (each MoE layer's load, MaxVio, dead experts, routing entropy, router
            logits and z on logging steps); it refuses, at setup, a model with no router it can read.
        router_balance_bias: ``RouterHealthMonitor(balance_bias=...)``: the auxiliary-loss-free balancing bias's
            step (DeepSeek-V3's 1e-3), added to the scores that choose the experts and moved towards balance after
            each applied update; ``None``: off (the monitor only observes). Only ``router=True`` reads it; the
            monitor refuses, at setup, a router whose choice it cannot redo (Hugging Face Mixtral, Qwen2-MoE,
            Qwen3-MoE and OLMoE routers it can).
        router_z_loss: ``RouterHealthMonitor(z_loss=...)``: the router z-loss's coefficient (ST-MoE's 1e-3), added
            as a gradient on each router's logits; ``None``: off. Only ``router=True`` reads it.
        checkpoint: attach ``StableCheckpoint`` and ``AtomicCheckpointIO``; ``False``: neither (Lightning's
            ``ModelCheckpoint`` applies unless ``enable_checkpointing=False``).
        watchdog: with several processes, set the NCCL watchdog variables you have not set and a 10-minute
            process-group timeout for the preset's strategy; ``False``: leave both as they are.
        sources: where each field's value comes from (a paper, a framework's default, a recipe).

    Raises:
        StabilityConfigError: for a bad value, or ``activation_checkpointing``/``tensor_parallel`` without
            ``fsdp``.

    Example::

        from lightning_stability.presets import get_preset

        mine = get_preset("gpt").derive("my-gpt", "GPT with a longer warmup", {"warmup": "my runs"}, warmup=0.1)
        trainer = StableTrainer.from_preset(mine, max_steps=1000)
    """

    name: str
    description: str
    max_norm: float | None = 1.0
    warmup: float = 0.05
    decay: float = 0.20
    min_lr_ratio: float = 0.0
    lr_schedule: bool = True
    precision: Precision = "bf16-mixed"
    init_scale: float = 65536.0
    hysteresis: int = 2
    accumulation: int = 1
    lr_scaling: Literal["linear", "sqrt", "none"] = "none"
    batch_ramp: int | None = None
    effective_batch: int | None = None
    fsdp: bool = False
    activation_checkpointing: bool = False
    tensor_parallel: int = 1
    num_nodes: int = 1
    health: Response | None = "skip"
    skip_on: Literal["any", "loss"] = "loss"
    lr_backoff: float | None = 0.02
    per_layer: bool | int = False
    replay: bool = False
    router: bool = False
    router_balance_bias: float | None = None
    router_z_loss: float | None = None
    checkpoint: bool = True
    watchdog: bool = True
    sources: dict[str, str] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        for key in ("name", "description"):
            check_instance(key, getattr(self, key), str, "a str", "'my-recipe'")
        if not self.name:
            raise config_error("name", self.name, "is empty", "pass a name, e.g. 'my-recipe'")
        check_instance("sources", self.sources, dict, "a dict of field names to sources", "{}")
        if self.max_norm is not None:
            check_number("max_norm", self.max_norm, example="1.0 (or None: measure only, no clipping)")
        for key in ("warmup", "decay"):
            check_length(key, getattr(self, key))
        check_ratio("min_lr_ratio", self.min_lr_ratio, "0.0 or 0.1 (10% of the base LR)")
        if self.precision not in _PRECISIONS:
            raise config_error("precision", self.precision, "is not a preset precision", f"pass one of {_PRECISIONS}")
        check_number("init_scale", self.init_scale, example="65536.0 (2**16)")
        check_int("hysteresis", self.hysteresis, 1, "hysteresis=2")
        if self.health is not None and self.health not in RESPONSES:
            raise config_error(
                "health", self.health, "is not a response", f"pass one of {RESPONSES}, or None for no health monitor"
            )
        if self.skip_on not in ("any", "loss"):
            raise config_error(
                "skip_on", self.skip_on, "is not a choice", "pass 'loss' (loss spikes skip) or 'any' (either spike)"
            )
        if self.lr_backoff is not None:
            check_number("lr_backoff", self.lr_backoff, example="0.02 (or None: no LR back-off)")
        if self.router_balance_bias is not None:
            check_number("router_balance_bias", self.router_balance_bias, example="1e-3 (or None: no balancing bias)")
        if self.router_z_loss is not None:
            check_number("router_z_loss", self.router_z_loss, example="1e-3 (or None: no router z-loss)")
        if not isinstance(self.per_layer, bool):
            check_int("per_layer", self.per_layer, 1, "per_layer=True (every module), 5 (the 5 largest) or False")
        if self.lr_scaling not in ("linear", "sqrt", "none"):
            raise config_error(
                "lr_scaling", self.lr_scaling, "is not a scaling rule", "pass 'none', 'linear' or 'sqrt'"
            )
        for key, example in (("accumulation", "1 or 32"), ("num_nodes", "1 or 8"), ("tensor_parallel", "1 or 8")):
            check_int(key, getattr(self, key), 1, example)
        if self.effective_batch is not None:
            check_int("effective_batch", self.effective_batch, 1, "effective_batch=2048 (or None)")
        if self.batch_ramp is not None:
            check_int("batch_ramp", self.batch_ramp, 2, "batch_ramp=32 (or None: no ramp)")
            if self.accumulation < 2 or self.lr_scaling == "none" or self.batch_ramp < self.accumulation:
                raise config_error(
                    "batch_ramp",
                    self.batch_ramp,
                    f"grows the accumulation from {self.accumulation} with lr_scaling={self.lr_scaling!r}: it needs "
                    "accumulation >= 2, an lr_scaling the LR can follow and a bound >= accumulation",
                    "pass e.g. accumulation=2, lr_scaling='sqrt' (Adam) with batch_ramp=32, or batch_ramp=None",
                )
        for key in ("lr_schedule", "fsdp", "activation_checkpointing", "replay", "router", "checkpoint", "watchdog"):
            check_bool(key, getattr(self, key))
        if self.replay and self.health is None:
            raise config_error(
                "replay",
                self.replay,
                "needs the health monitor (its rule flags the steps to replay), and health=None",
                "pass health='skip' with replay=True, or replay=False",
            )
        for key, value in (
            ("tensor_parallel", self.tensor_parallel > 1),
            ("activation_checkpointing", self.activation_checkpointing),
        ):
            if value and not self.fsdp:
                raise config_error(
                    key,
                    getattr(self, key),
                    f"needs fsdp=True ({_NEEDS_FSDP[key]} runs in StableFSDPStrategy)",
                    f"pass fsdp=True too, or {key}={_OFF[key]}",
                )

    def derive(self, name: str, description: str, sources: dict[str, str] | None = None, **changes: Any) -> Preset:
        """A variant of this preset: ``changes`` applied, their ``sources`` added to the inherited ones."""
        return replace(self, name=name, description=description, sources={**self.sources, **(sources or {})}, **changes)

    def settings(self) -> dict[str, Any]:
        """Every configurable field and its value."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in _META}


_META = ("name", "description", "sources")
_NEEDS_FSDP = {
    "tensor_parallel": "tensor parallelism",
    "activation_checkpointing": "the preset's activation checkpointing",
}
_OFF = {"tensor_parallel": "1", "activation_checkpointing": "False"}
_PRECISIONS = ("16-mixed", "bf16-mixed", "32-true")
FIELDS = tuple(f.name for f in fields(Preset) if f.name not in _META)

_BASE = Preset(
    name="base",
    description="the defaults every preset starts from",
    sources={
        "max_norm": "a common recipe: BERT-like models clip the gradient norm at 1.0",
        "warmup": "a common recipe: linear warmup over the first 5% of the run (5-10% is usual)",
        "decay": "a common recipe for large models: constant after warmup, cosine decay over the last 20%",
        "precision": "bf16 where the accelerator has it (PyTorch's recommendation on Ampere+): no loss scaling; "
        "fp32 on a CPU without AMX-BF16, where bf16 autocast is slower (benchmarks/preset_precision.py)",
        "init_scale": "torch GradScaler's default init_scale (65536 = 2**16)",
        "hysteresis": "Megatron-LM's hysteresis=2",
        "health": "OLMo-core's skip-step optimizer; benchmarks/spikes.py (skip ends closest to clean runs)",
        "skip_on": "loss: on benchmarks/lr_sensitivity.py's clean runs skipping on either spike skipped up to 0.89% of "
        "the updates, all gradient-norm spikes without a loss spike (max_norm bounds them), on loss spikes none; "
        "benchmarks/spikes.py: every poisoned batch still skipped",
        "lr_backoff": "0.02: PrecursorMonitor's back-off past an update-to-weight ratio of 2% (Marin saw Adam "
        "update-norm spikes precede loss spikes) while the update per unit of LR is under 0.3 of the run's largest, "
        "or past 3%; benchmarks/lr_sensitivity.py, held-out seeds: LR sensitivity 0.195 (0.401 without it, as a "
        "Trainer with gradient_clip_val and a warmup; bare 0.469), every seed trains up to LR 0.0959 (0.0306); "
        "benchmarks/no_harm.py: equal to that Trainer at every LR where it trains well, on 5 Hugging Face families",
        "per_layer": "off: the totals, and the 5 largest per-module update ratios (a row per module and figure "
        "is costly to log for a large model)",
        "replay": "off: a flagged step is skipped whatever its cause; replay=True adds StepReplay (a flagged step run "
        "again: a transient fault applied as replayed, bad data quarantined; one host read a step, not under fp16)",
        "lr_schedule": "on: the recipe's schedule (lr_schedule=False keeps your configure_optimizers' scheduler)",
        "router": "off: a dense model has no router (moe: on)",
        "router_balance_bias": "off: read only with router=True (moe: 1e-3)",
        "router_z_loss": "off: read only with router=True (moe: 1e-3)",
        "checkpoint": "on: StableCheckpoint with atomic saves (checkpoint=False: Lightning's own checkpointing)",
        "watchdog": "on: PyTorch's NCCL watchdog variables and a 10-minute timeout (watchdog=False: yours as set)",
        "min_lr_ratio": "0: decay to zero, as transformers' linear and cosine schedules do",
        "lr_scaling": "your LR as configured; 'linear' is Goyal et al. 2017's linear scaling rule (lr * accumulation)",
        "accumulation": "1: no accumulation; the size presets (under-1b, 1b-10b, over-10b) set it",
        "effective_batch": "none: your DataLoader's batch",
        "batch_ramp": "off: the ramp's gain at equal samples is not yet measured on these recipes "
        "(benchmarks/batch_ramp.py); McCandlish et al. 2018's noise scale, Merrill et al. 2025's batch warmup",
        "fsdp": "off: one replica per device (DDP or one device); 1b-10b and larger shard (their model states, 16 "
        "bytes per parameter with Adam, exceed one 80 GiB GPU from 5B parameters on)",
        "activation_checkpointing": "off: 1b-10b and larger pair it with their heavy accumulation (with FSDP)",
        "tensor_parallel": "1: no tensor parallelism (the source's recipes shard with FSDP alone); "
        "`lightning-stability plan` says when a size is needed to fit",
        "num_nodes": "1",
    },
)

ROUTER_ACTIONS = (
    "1e-3 (DeepSeek-V3's bias rate, ST-MoE's z-loss coefficient), both on: on benchmarks/moe_collapse.py's collapse "
    "(a top-1 OLMoE, 8 small experts, 8 tables sharing 32 tokens, a skewed router start), bias and z-loss together "
    "end at held-out MaxVio 0.29 against 6.29 and held-out loss 0.953 against 1.022 (mean of 3 seeds), better than "
    "either alone"
)

_FP16 = {
    "precision": "a common 175B recipe: fp16 mixed precision with a loss scale (Micikevicius et al. 2018: fp16 "
    "forward and backward, fp32 master weights and update)"
}


def _table() -> dict[str, Preset]:
    tiny = _BASE.derive(
        "tiny",
        "a small model on one CPU or GPU: tests and the demo",
        {"precision": "fp32: nothing to gain from mixed precision at this size"},
        precision="32-true",
    )
    clip = "a common recipe: clip at 1.0 for BERT-like, 0.5 for GPT-like, 2.0 for mixture-of-experts models"
    bert = _BASE.derive("bert", "BERT-like encoders", {"max_norm": clip}, max_norm=1.0)
    gpt = _BASE.derive("gpt", "GPT-like decoders", {"max_norm": clip}, max_norm=0.5)
    moe = _BASE.derive(
        "moe",
        "mixture-of-experts models",
        {
            "max_norm": clip,
            "router": "on: the routers' load and logits (RouterHealthMonitor)",
            "router_balance_bias": ROUTER_ACTIONS,
            "router_z_loss": ROUTER_ACTIONS,
        },
        max_norm=2.0,
        router=True,
        router_balance_bias=1e-3,
        router_z_loss=1e-3,
    )
    size = "a common recipe by model size (<1B: 2-4 steps, batch 256-512; 1-10B: 8-16, 1024-2048; >10B: 32-64, 4096-8k)"
    under_1b = _BASE.derive(
        "under-1b",
        "models under 1B parameters",
        {"accumulation": size, "effective_batch": size},
        accumulation=4,
        effective_batch=512,
    )
    b1_10 = under_1b.derive(
        "1b-10b",
        "models of 1-10B parameters, sharded",
        {
            "activation_checkpointing": "a common pairing: heavy accumulation with activation checkpointing",
            "fsdp": "full sharding (FSDP; ZeRO-3, Rajbhandari et al. 2020): 10B parameters hold 160 GB of model "
            "states with Adam (16 bytes each), more than one GPU",
        },
        accumulation=16,
        effective_batch=2048,
        activation_checkpointing=True,
        fsdp=True,
    )
    over_10b = b1_10.derive(
        "over-10b",
        "models over 10B parameters, sharded",
        {},
        accumulation=32,
        effective_batch=4096,
    )
    b100 = over_10b.derive(
        "100b",
        "100B-scale: warmup, constant LR, cosine decay at the end",
        {
            "warmup": "a common recipe at 100B scale: linear warmup over 0-5% of the run",
            "decay": "a common recipe at 100B scale: constant over 5-80%, cosine over the last 20%",
        },
        warmup=0.05,
        decay=0.20,
    )
    b175 = over_10b.derive(
        "175b",
        "a common recipe for 175B-scale models",
        {
            "max_norm": "clip 1.0, as GPT-3 175B (Brown et al. 2020)",
            "warmup": "a common 175B recipe: cosine with 5% warmup",
            "decay": "a common 175B recipe: cosine over the rest of the run",
            "init_scale": "a common 175B recipe: initial loss scale 32768 (2**15)",
            **_FP16,
            "accumulation": "a common 175B recipe: accumulation 32",
            "fsdp": "a common 175B recipe: FSDP",
            "tensor_parallel": "1: a common 175B recipe shards with FSDP alone (Megatron's GPT-3 175B runs use TP 8, "
            "Narayanan et al. 2021)",
            "num_nodes": "a common 175B recipe: 8 nodes",
        },
        max_norm=1.0,
        warmup=0.05,
        decay=0.95,
        init_scale=32768.0,
        precision="16-mixed",
        accumulation=32,
        num_nodes=8,
    )
    return {p.name: p for p in (tiny, bert, gpt, moe, under_1b, b1_10, over_10b, b100, b175)}


PRESETS: dict[str, Preset] = _table()


@dataclass(frozen=True)
class Layout:
    """How a preset runs on given hardware: what ``StableTrainer.from_preset`` builds and what
    ``lightning-stability plan --preset`` plans. ``notes`` say what differs from the recipe, and how to change it.
    """

    fsdp: bool
    activation_checkpointing: bool
    tensor_parallel: int
    precision: str
    notes: tuple[str, ...] = ()

    @property
    def sharding(self) -> str:
        """The planner's name for the sharding: ``"full"`` (FSDP, ZeRO-3) or ``"none"`` (one replica per device)."""
        return "full" if self.fsdp else "none"


def layout(
    preset: Preset,
    *,
    world_size: int,
    devices_per_node: int,
    gpu: bool,
    bf16: bool = True,
    cpu_fast: Collection[str] | None = None,
    own_strategy: bool = False,
    own_precision: bool = False,
) -> Layout:
    """The preset's sharding, activation checkpointing, tensor parallelism and precision on ``world_size``
    devices (``devices_per_node`` per machine; ``gpu``: CUDA, ``bf16``: the GPU computes in bf16).

    ``cpu_fast``: the run is on CPUs, which run these mixed precisions (``"bf16-mixed"``, ``"16-mixed"``) faster
    than fp32 (on AMX tiles: ``_compat.cpu_amx_dtypes``); a preset's other mixed precision becomes ``"32-true"``.
    ``None``: not a CPU run. ``own_strategy``/``own_precision``: the user passed ``strategy=``/``precision=`` (or a
    precision plugin): the preset's strategy (sharding, checkpointing, TP) is not built / the precision is not
    adapted.
    """
    notes: list[str] = []
    fsdp = preset.fsdp and not own_strategy
    if fsdp and world_size < 2:
        fsdp = False
        notes.append("FSDP off (one device: nothing to shard)")
    checkpointing = preset.activation_checkpointing and fsdp
    if preset.activation_checkpointing and not fsdp:
        where = "your strategy= replaces the preset's" if own_strategy else "it comes with FSDP, off on one device"
        notes.append(f"activation checkpointing off ({where})")
    tensor_parallel = 1
    wanted = preset.tensor_parallel
    if wanted > 1 and not fsdp:
        why = "your strategy= replaces the preset's" if own_strategy else "one device"
        notes.append(f"tensor parallelism off ({why}; the recipe's tensor_parallel={wanted})")
    elif wanted > 1:
        tensor_parallel = math.gcd(wanted, devices_per_node)
        if tensor_parallel != wanted:
            state = f"-> {tensor_parallel}" if tensor_parallel > 1 else "-> 1: tensor parallelism off"
            notes.append(f"tensor_parallel {wanted} {state} (it must divide the {devices_per_node} devices per node)")
    precision = preset.precision
    if precision == "bf16-mixed" and gpu and not bf16 and not own_precision:
        precision = "16-mixed"
        notes.append("bf16-mixed -> 16-mixed with a loss scaler (this GPU has no bf16; precision='32-true' keeps fp32)")
    elif precision in CPU_UNITS and cpu_fast is not None and not own_precision:
        precision, note = cpu_precision(precision, precision in cpu_fast)
        notes.append(note)
    return Layout(fsdp, checkpointing, tensor_parallel, precision, tuple(notes))


#: a mixed precision -> its format and the CPU unit that runs it faster than fp32
CPU_UNITS: dict[Precision, tuple[str, str]] = {"bf16-mixed": ("bf16", "AMX-BF16"), "16-mixed": ("fp16", "AMX-FP16")}


def cpu_precision(precision: Precision, fast: bool) -> tuple[Precision, str]:
    """A preset's mixed ``precision`` on a CPU, and the note that says which and why: kept where the CPU runs it
    faster than fp32 (``fast``: on AMX tiles), else ``"32-true"``, with the override that keeps it."""
    kind, unit = CPU_UNITS[precision]
    if fast:
        return precision, f"{precision} kept on this CPU ({unit}: {kind} matmuls run faster than fp32)"
    keep = f"precision={precision!r} keeps {kind}" + (" with a loss scaler" if kind == "fp16" else "")
    return "32-true", (
        f"{precision} -> 32-true (this CPU has no {unit}: {kind} autocast runs slower than fp32 without it; {keep})"
    )


def batch_mismatch(
    preset: str, effective_batch: int, batch_size: int, accumulation: int, data_parallel: int
) -> str | None:
    """What to tell a run whose global batch (``batch_size x accumulation x data_parallel``) is not the
    ``effective_batch`` its preset was written for, with the settings that reach it; ``None`` when it is."""
    actual = batch_size * accumulation * data_parallel
    if actual == effective_batch:
        return None
    ways = []
    if effective_batch % (batch_size * data_parallel) == 0:
        ways.append(f"accumulation={effective_batch // (batch_size * data_parallel)}")
    if effective_batch % (accumulation * data_parallel) == 0:
        ways.append(f"a DataLoader batch_size of {effective_batch // (accumulation * data_parallel)}")
    reach = (
        " or ".join(ways) or f"a batch_size and an accumulation whose product is {effective_batch / data_parallel:g}"
    )
    return (
        f"Preset {preset!r} was written for a global batch of {effective_batch} samples per optimizer step "
        f"(effective_batch={effective_batch}); this run trains on {actual} = {batch_size} (the DataLoader's "
        f"batch_size) x {accumulation} (accumulation) x {data_parallel} (data-parallel processes). The preset sets "
        f"neither the batch size nor the accumulation from it. Fix: to reach {effective_batch}, {reach}; or pass "
        f"effective_batch={actual} (or None) to keep this run's batch and silence this."
    )


def list_presets() -> dict[str, str]:
    """Every preset's name and one-line description."""
    return {name: p.description for name, p in PRESETS.items()}


def get_preset(name: str, argument: str = "name") -> Preset:
    """The preset ``name``; an unknown name is an error (naming ``argument``) that lists the known ones and suggests
    the closest."""
    check_instance(argument, name, str, "a preset name or a Preset", "'gpt'")
    preset = PRESETS.get(name.lower())
    if preset is not None:
        return preset
    close = difflib.get_close_matches(name.lower(), PRESETS, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise config_error(
        argument,
        name,
        f"is not a preset.{hint} Known presets: {', '.join(PRESETS)}",
        "pass one of them (`lightning-stability presets` lists them)",
    )


def describe_preset(name: str | Preset) -> str:
    """Every setting of a preset, its value and its source, one per line."""
    preset = name if isinstance(name, Preset) else get_preset(name)
    width = max(len(k) for k in FIELDS)
    lines = [f"{preset.name}: {preset.description}"]
    for key, value in preset.settings().items():
        source = preset.sources.get(key, "")
        lines.append(f"  {key:<{width}}  {value!s:<12}  {source}".rstrip())
    return "\n".join(lines)
