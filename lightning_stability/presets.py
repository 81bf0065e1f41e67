"""Named training recipes (clipping, LR schedule, precision, accumulation, sharding): one table, every value with
its source.

A :class:`Preset` is a complete, typed configuration of the package's callbacks and strategy. Variants derive
from a base with :func:`dataclasses.replace`, so a family (``gpt``) and a size (``over-10b``) do not multiply
into a table of combinations; ``StableTrainer.from_preset`` builds a Trainer from one and lets the user
override any field. Pure data: no Trainer is built here.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal

from lightning_stability.errors import StabilityConfigError, check_int, config_error

Precision = Literal["16-mixed", "bf16-mixed", "32-true"]
Response = Literal["warn", "clip", "skip", "rollback"]


@dataclass(frozen=True)
class Preset:
    """A recipe. ``sources`` maps a field to where its value comes from (a paper, a framework's default, a recipe).

    Fields:
        max_norm: ``GradientNormMonitor(max_norm=...)``: the global gradient-norm clip (``None``: measure only).
        warmup, decay, min_lr_ratio: ``WarmupConstantCosineLR`` (fractions of the run, or step counts).
        precision: ``"16-mixed"`` (fp16 compute, fp32 master weights and update), ``"bf16-mixed"`` or ``"32-true"``.
        init_scale, hysteresis: ``LossScaleTuner`` (fp16 only).
        accumulation: ``GradientAccumulation(steps=...)`` (1: none).
        lr_scaling: how the LR follows the accumulation (``"linear"``: ``lr * steps``; ``"none"``).
        effective_batch: the global batch the recipe aims at (documentation and the memory planner).
        fsdp: shard with ``StableFSDPStrategy``; activation_checkpointing: its activation checkpointing.
        tensor_parallel: ``StableFSDPStrategy(tensor_parallel=...)``: GPUs of a node splitting each layer (1:
            none; needs ``fsdp``, and a ``configure_model`` that applies a TP plan). Adapted to the devices per
            node; ``lightning-stability plan`` says which size fits.
        num_nodes: machines the recipe was written for (adapted to the user's).
        health: ``TrainingHealthMonitor(response=...)``.
    """

    name: str
    description: str
    max_norm: float | None = 1.0
    warmup: float = 0.05
    decay: float = 0.20
    min_lr_ratio: float = 0.0
    precision: Precision = "bf16-mixed"
    init_scale: float = 65536.0
    hysteresis: int = 2
    accumulation: int = 1
    lr_scaling: Literal["linear", "sqrt", "none"] = "none"
    effective_batch: int | None = None
    fsdp: bool = False
    activation_checkpointing: bool = False
    tensor_parallel: int = 1
    num_nodes: int = 1
    health: Response = "skip"
    sources: dict[str, str] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if self.precision not in _PRECISIONS:
            raise config_error("precision", self.precision, "is not a preset precision", f"pass one of {_PRECISIONS}")
        if self.health not in _RESPONSES:
            raise config_error("health", self.health, "is not a response", f"pass one of {_RESPONSES}")
        if self.lr_scaling not in ("linear", "sqrt", "none"):
            raise config_error(
                "lr_scaling", self.lr_scaling, "is not a scaling rule", "pass 'linear', 'sqrt' or 'none'"
            )
        for key, example in (("accumulation", "1 or 32"), ("num_nodes", "1 or 8"), ("tensor_parallel", "1 or 8")):
            check_int(key, getattr(self, key), 1, example)
        for key in ("fsdp", "activation_checkpointing"):
            if not isinstance(getattr(self, key), bool):
                raise config_error(key, getattr(self, key), "must be True or False", "pass a bool")
        if self.tensor_parallel > 1 and not self.fsdp:
            raise config_error(
                "tensor_parallel",
                self.tensor_parallel,
                "needs fsdp=True (tensor parallelism runs in StableFSDPStrategy, which shards the rest over the "
                "data-parallel ranks)",
                "pass fsdp=True too, or tensor_parallel=1",
            )

    def derive(self, name: str, description: str, sources: dict[str, str] | None = None, **changes: Any) -> Preset:
        """A variant of this preset: ``changes`` applied, their ``sources`` added to the inherited ones."""
        return replace(self, name=name, description=description, sources={**self.sources, **(sources or {})}, **changes)

    def settings(self) -> dict[str, Any]:
        """Every configurable field and its value."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in _META}


_META = ("name", "description", "sources")
_PRECISIONS = ("16-mixed", "bf16-mixed", "32-true")
_RESPONSES = ("warn", "clip", "skip", "rollback")
FIELDS = tuple(f.name for f in fields(Preset) if f.name not in _META)

_BASE = Preset(
    name="base",
    description="the defaults every preset starts from",
    sources={
        "max_norm": "a common recipe: BERT-like models clip the gradient norm at 1.0",
        "warmup": "a common recipe: linear warmup over the first 5% of the run (5-10% is usual)",
        "decay": "a common recipe for large models: constant after warmup, cosine decay over the last 20%",
        "precision": "bf16 where fp16's loss scaling is not asked for (PyTorch's recommendation on Ampere+)",
        "init_scale": "torch GradScaler's default init_scale (65536 = 2**16)",
        "hysteresis": "Megatron-LM's hysteresis=2",
        "health": "OLMo-core's skip-step optimizer; benchmarks/spikes.py (skip ends closest to clean runs)",
        "min_lr_ratio": "0: decay to zero, as transformers' linear and cosine schedules do",
        "lr_scaling": "your LR as configured; 'linear' is Goyal et al. 2017's linear scaling rule (lr * accumulation)",
        "accumulation": "1: no accumulation; the size presets (under-1b, 1b-10b, over-10b) set it",
        "effective_batch": "none: your DataLoader's batch",
        "fsdp": "off: one replica per device (DDP or one device); over-10b and larger shard",
        "activation_checkpointing": "off: 1b-10b and larger pair it with their heavy accumulation",
        "tensor_parallel": "1: no tensor parallelism (the source's recipes shard with FSDP alone); "
        "`lightning-stability plan` says when a size is needed to fit",
        "num_nodes": "1",
    },
)

_FP16 = {"precision": "Micikevicius et al. 2018 (fp16 forward and backward, fp32 master weights and update)"}


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
    moe = _BASE.derive("moe", "mixture-of-experts models", {"max_norm": clip}, max_norm=2.0)
    size = "a common recipe by model size (<1B: 2-4 steps, batch 256-512; 1-10B: 8-16, 1024-2048; >10B: 32-64, 4096-8k)"
    under_1b = _BASE.derive(
        "under-1b",
        "models under 1B parameters",
        {"accumulation": size, "effective_batch": size, **_FP16},
        accumulation=4,
        effective_batch=512,
        precision="16-mixed",
    )
    b1_10 = under_1b.derive(
        "1b-10b",
        "models of 1-10B parameters",
        {"activation_checkpointing": "a common pairing: heavy accumulation with activation checkpointing"},
        accumulation=16,
        effective_batch=2048,
        activation_checkpointing=True,
    )
    over_10b = b1_10.derive(
        "over-10b",
        "models over 10B parameters, sharded",
        {"fsdp": "full sharding (FSDP; ZeRO-3, Rajbhandari et al. 2020) for models that do not fit one device"},
        accumulation=32,
        effective_batch=4096,
        fsdp=True,
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
        accumulation=32,
        num_nodes=8,
    )
    return {p.name: p for p in (tiny, bert, gpt, moe, under_1b, b1_10, over_10b, b100, b175)}


PRESETS: dict[str, Preset] = _table()


def list_presets() -> dict[str, str]:
    """Every preset's name and one-line description."""
    return {name: p.description for name, p in PRESETS.items()}


def get_preset(name: str) -> Preset:
    """The preset ``name``; an unknown name is an error that lists the known ones and suggests the closest."""
    preset = PRESETS.get(str(name).lower())
    if preset is not None:
        return preset
    close = difflib.get_close_matches(str(name).lower(), PRESETS, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise StabilityConfigError(
        f"Unknown preset {name!r}.{hint} Known presets: {', '.join(PRESETS)}. "
        "Fix: pass one of them (`lightning-stability presets` lists them)."
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
