"""Will it fit? Per-GPU memory of a transformer's training step from its size and the run's settings.

Pure arithmetic (no Lightning, no GPU). :func:`plan_memory` adds up, per GPU:

* **model states** by the ZeRO paper's accounting (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations
  Toward Training Trillion Parameter Models", Sec. 3.1 and 5): with mixed precision and Adam, ``2P`` bytes
  of 16-bit parameters, ``2P`` of 16-bit gradients and ``K*P = 12P`` of optimizer state (fp32 master
  weights, momentum, variance), ``16P`` in all for ``P`` parameters; stage 1 (``sharding="optimizer"``)
  divides the ``12P`` by the data-parallel degree ``N``, stage 2 (``"grad_op"``) the gradients too, stage 3
  (``"full"``, FSDP ``FULL_SHARD``) everything. fp32 training: ``4P + 4P + 8P``.
* **activations** by Korthikanti et al. 2022 (see :func:`~lightning_stability.planner_model.activations`).
* **buffers**, a stated allowance: under full sharding the gathered parameters of the largest unit twice
  (the one computing and the one prefetched) and its unsharded gradient once, in compute precision; plus
  ``overhead`` (CUDA context and allocator slack, 1 GiB by default; pass 0 for a CPU run).

Not modelled: tensor, sequence and pipeline parallelism; allocator fragmentation beyond ``overhead``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from lightning_stability.errors import config_error
from lightning_stability.planner_model import GiB, ModelShape, activations, check_int, check_number, parse_memory

if TYPE_CHECKING:
    from torch import nn

__all__ = ["MemoryPlan", "ModelShape", "parse_memory", "plan_memory"]

Precision = Literal["32-true", "32", "bf16-mixed", "16-mixed", "bf16-true", "16-true"]
Optimizer = Literal["adamw", "adam", "sgd", "sgd_momentum", "adafactor"]
Sharding = Literal["full", "grad_op", "optimizer", "none"]

# precision -> (bytes of a parameter and of a gradient, of the fp32 master copy, of one optimizer moment)
PRECISIONS: dict[str, tuple[int, int, int]] = {
    "32-true": (4, 0, 4),
    "32": (4, 0, 4),
    "bf16-mixed": (2, 4, 4),
    "16-mixed": (2, 4, 4),
    "bf16-true": (2, 0, 2),
    "16-true": (2, 0, 2),
}
MOMENTS = {"adamw": 2, "adam": 2, "sgd": 0, "sgd_momentum": 1, "adafactor": 0}
# sharding -> (params, grads, optimizer state) divided by N, and its name
SHARDINGS: dict[str, tuple[bool, bool, bool, str]] = {
    "none": (False, False, False, "no sharding (DDP)"),
    "optimizer": (False, False, True, "ZeRO-1"),
    "grad_op": (False, True, True, "ZeRO-2 / FSDP SHARD_GRAD_OP"),
    "full": (True, True, True, "ZeRO-3 / FSDP FULL_SHARD"),
}
ZERO = "ZeRO, Rajbhandari et al. 2020"
KORTHIKANTI = "Korthikanti et al. 2022"


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes per GPU of one training step, and whether they fit. :meth:`table` prints it with its formulas.

    ``activations_bytes`` is without and ``activations_checkpointed_bytes`` with full activation
    checkpointing (both at ``micro_batch``); ``total_bytes`` counts the one the plan was asked for.
    ``usable_bytes`` is the capacity less the headroom; ``fits``: ``total_bytes <= usable_bytes``.
    ``max_micro_batch``: the largest micro-batch that fits (0: not even the model states and buffers;
    ``None``: unknown, the shape lacks ``layers``/``hidden``). ``accumulation``: gradient-accumulation steps
    to reach ``effective_batch`` (``None`` when it was not given). ``host_bytes``: CPU memory per GPU of the
    optimizer state offloaded by ``cpu_offload``.
    """

    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    activations_bytes: int
    activations_checkpointed_bytes: int
    buffers_bytes: int
    total_bytes: int
    capacity_bytes: int
    usable_bytes: int
    fits: bool
    max_micro_batch: int | None
    accumulation: int | None
    host_bytes: int = 0
    micro_batch: int = 1
    world_size: int = 1
    notes: tuple[str, ...] = ()
    title: str = ""
    rows: tuple[tuple[str, int, str, str], ...] = field(default=(), repr=False)

    def table(self) -> str:
        """A readable report: one row per component in GiB with its formula and source, the verdict, notes."""
        lines = [self.title, f"{'component':<24}{'GiB/GPU':>9}  formula  [source]"]
        lines += [f"{name:<24}{n / GiB:>9.2f}  {formula}  [{source}]" for name, n, formula, source in self.rows]
        verdict = "fits" if self.fits else "DOES NOT FIT"
        lines.append(
            f"{'total':<24}{self.total_bytes / GiB:>9.2f}  {verdict} in {self.usable_bytes / GiB:.2f} GiB usable "
            f"of {self.capacity_bytes / GiB:.2f} GiB"
        )
        lines.append(f"max micro-batch: {'unknown' if self.max_micro_batch is None else self.max_micro_batch}")
        if self.accumulation is not None:
            batch = self.micro_batch * self.world_size
            lines.append(
                f"gradient accumulation: {self.accumulation} steps (micro-batch {self.micro_batch} x "
                f"{self.world_size} GPUs x {self.accumulation} = {batch * self.accumulation} samples per step)"
            )
        lines += [f"note: {note}" for note in self.notes]
        return "\n".join(lines)


def _choice(argument: str, value: object, options: Mapping[str, object]) -> str:
    if not isinstance(value, str) or value not in options:
        raise config_error(argument, value, "is not supported", f"pass one of {', '.join(map(repr, options))}")
    return value


def plan_memory(
    model: ModelShape | nn.Module | float,
    *,
    nodes: int = 1,
    gpus_per_node: int = 1,
    gpu_memory: int | str = "80GiB",
    precision: Precision = "bf16-mixed",
    optimizer: Optimizer = "adamw",
    sharding: Sharding = "full",
    seq_len: int = 2048,
    micro_batch: int = 1,
    activation_checkpointing: bool = False,
    effective_batch: int | None = None,
    cpu_offload: bool = False,
    flash_attention: bool = False,
    mixed_layout: Literal["zero", "autocast"] = "zero",
    headroom: float = 0.1,
    overhead: int | str = "1GiB",
) -> MemoryPlan:
    """Plan the per-GPU memory of training ``model`` (a :class:`ModelShape`, an ``nn.Module``, possibly on the
    ``meta`` device, or a parameter count) on ``nodes x gpus_per_node`` GPUs of ``gpu_memory`` each.

    ``sharding`` shards model states over all ``N = nodes * gpus_per_node`` GPUs (ZeRO stages; see the module
    docstring). ``cpu_offload`` moves the optimizer state, fp32 master weights included, to host memory.
    ``mixed_layout`` (mixed precision only): ``"zero"`` is the paper's 16-bit parameters and gradients with
    fp32 master weights in the optimizer (DeepSpeed, Megatron); ``"autocast"`` keeps the parameters and
    gradients in fp32 and casts for compute (``torch.autocast`` under DDP, FSDP2's ``MixedPrecisionPolicy``):
    the same 16P for Adam, split 4/4/8, plus the 16-bit weight copies saved for backward (a buffer).
    ``flash_attention``: attention scores are recomputed, not stored. ``headroom``: the fraction of
    ``gpu_memory`` kept free. ``effective_batch``: global batch (samples) for the accumulation steps.
    Raises :class:`~lightning_stability.errors.StabilityConfigError` naming a bad argument.
    """
    shape = _shape(model)
    for name, value in (("nodes", nodes), ("gpus_per_node", gpus_per_node), ("seq_len", seq_len)):
        check_int(name, value)
    check_int("micro_batch", micro_batch)
    if effective_batch is not None:
        check_int("effective_batch", effective_batch)
    if headroom != 0:
        check_number("headroom", headroom, high=1.0, example="0.1")
    _choice("precision", precision, PRECISIONS)
    _choice("optimizer", optimizer, MOMENTS)
    _choice("sharding", sharding, SHARDINGS)
    _choice("mixed_layout", mixed_layout, {"zero": 0, "autocast": 0})
    capacity = parse_memory("gpu_memory", gpu_memory)
    if capacity == 0:
        raise config_error("gpu_memory", gpu_memory, "must be > 0", 'pass e.g. gpu_memory="80GiB"')
    fixed_overhead = parse_memory("overhead", overhead)

    n, p = nodes * gpus_per_node, shape.params
    width, master, moment = PRECISIONS[precision]
    compute = 4 if precision in ("32-true", "32") else 2
    autocast = master > 0 and mixed_layout == "autocast"
    if autocast:
        width, master = 4, 0
    shard_p, shard_g, shard_o, stage = SHARDINGS[sharding]
    per = {True: f"/{n}", False: ""}
    notes: list[str] = []

    k = master + MOMENTS[optimizer] * moment
    k_text = " + ".join(filter(None, [f"{master} master" if master else "", _moments(optimizer, moment)])) or "none"
    optimizer_per_param = float(k)
    if optimizer == "adafactor":
        if shape.hidden is not None:
            optimizer_per_param += 2.0 * moment / shape.hidden
            k_text += f" + factored 2*{moment}/h"
        else:
            notes.append("adafactor: the factored second moment (~2*4*P/h bytes) is not counted (hidden unknown)")
    params_b = width * p / (n if shard_p else 1)
    grads_b = width * p / (n if shard_g else 1)
    optimizer_b = optimizer_per_param * p / (n if shard_o else 1)
    host_b = 0.0
    if cpu_offload:
        host_b, optimizer_b = optimizer_b, 0.0
        notes.append(f"cpu_offload: {host_b / GiB:.2f} GiB of optimizer state per GPU lives in host memory")

    unit = shape.unit_params()
    buffers, parts = (
        float(fixed_overhead),
        [f"{fixed_overhead / GiB:.2f} GiB overhead (CUDA context, allocator: assumed)"],
    )
    if sharding == "full":
        buffers += 3.0 * compute * unit
        parts.insert(0, f"3 x {compute}B x unit of {unit:.3g} params (2 gathered + 1 unsharded grad)")
    elif sharding == "grad_op":
        buffers += 1.0 * compute * unit
        parts.insert(0, f"{compute}B x unit of {unit:.3g} params (unsharded grad before reduce-scatter)")
    if autocast and sharding != "full":
        buffers += 2.0 * p
        parts.insert(0, "2P (16-bit weight copies saved for backward)")
    buffer_text = " + ".join(parts)

    acts = activations(shape, seq_len, compute, flash_attention)
    if acts is None:
        full_a = ckpt_a = per_sample = 0.0
        notes.append("activations not counted: the model shape lacks layers/hidden (pass a ModelShape or module)")
    else:
        full_a, ckpt_a = acts.full * micro_batch, acts.checkpointed * micro_batch
        per_sample = acts.checkpointed if activation_checkpointing else acts.full
        notes += acts.notes
    used = ckpt_a if activation_checkpointing else full_a
    fixed = params_b + grads_b + optimizer_b + buffers
    total = fixed + used
    usable = capacity * (1.0 - headroom)
    fits = total <= usable
    max_micro = None if acts is None else max(0, math.floor((usable - fixed) / per_sample))

    accumulation = None
    if effective_batch is not None:
        accumulation = math.ceil(effective_batch / (micro_batch * n))
        if accumulation * micro_batch * n != effective_batch:
            notes.append(
                f"effective_batch={effective_batch} is not a multiple of micro_batch*N = {micro_batch * n}: "
                f"{accumulation} steps give {accumulation * micro_batch * n}"
            )
    if not fits and acts is not None and not activation_checkpointing and fixed + ckpt_a <= usable:
        notes.append("activation_checkpointing=True would fit")
    if fixed > usable:
        notes.append("model states and buffers alone do not fit: shard more, offload, or add GPUs")
    if sharding == "full" and master > 0:
        notes.append(
            "PyTorch FSDP2 mixed precision keeps fp32 sharded params and grads: the same 16P/N for Adam split "
            "4/4/8 (mixed_layout='autocast'), plus the gathered units in buffers"
        )
    if sharding == "none" and n > 1:
        notes.append("DDP without gradient_as_bucket_view=True holds a second copy of the gradients in its buckets")
    if acts is not None and not flash_attention:
        notes.append("eager attention: scores stored (5*a*s/h term); flash_attention=True drops it")

    act = "L*s*b*h*(16e+2)" + (" + L*4*a*s*b" if flash_attention else " + L*a*s^2*b*(2e+1)")
    act += f" + s*b*h*(2e+1) + 4*s*b*v, e={compute}"
    ckpt = f"L*s*b*h*e + one layer + output, e={compute}"
    marks = (" (used)", "") if not activation_checkpointing else ("", " (used)")
    on_host = ", on host" if cpu_offload else ""
    rows: tuple[tuple[str, int, str, str], ...] = (
        ("params", round(params_b), f"{width}P{per[shard_p]}", ZERO),
        ("grads", round(grads_b), f"{width}P{per[shard_g]}", ZERO),
        ("optimizer", round(optimizer_b), f"{k:g}P{per[shard_o]} ({k_text}){on_host}", ZERO),
        ("activations" + marks[0], round(full_a), act, f"{KORTHIKANTI} Sec. 4"),
        ("activations ckpt" + marks[1], round(ckpt_a), ckpt, f"{KORTHIKANTI} Sec. 5"),
        ("buffers", round(buffers), buffer_text, "allowance"),
    )
    if acts is None:
        rows = rows[:3] + rows[5:]
    title = (
        f"Memory plan per GPU: {p / 1e9:.4g}B params on {nodes} x {gpus_per_node} = {n} GPUs, {precision}, "
        f"{optimizer}, sharding={sharding} ({stage}), seq {seq_len}, micro-batch {micro_batch}"
    )
    return MemoryPlan(
        params_bytes=round(params_b),
        grads_bytes=round(grads_b),
        optimizer_bytes=round(optimizer_b),
        activations_bytes=round(full_a),
        activations_checkpointed_bytes=round(ckpt_a),
        buffers_bytes=round(buffers),
        total_bytes=round(total),
        capacity_bytes=capacity,
        usable_bytes=round(usable),
        fits=fits,
        max_micro_batch=max_micro,
        accumulation=accumulation,
        host_bytes=round(host_b),
        micro_batch=micro_batch,
        world_size=n,
        notes=tuple(notes),
        title=title,
        rows=rows,
    )


def _moments(optimizer: str, moment: int) -> str:
    count = MOMENTS[optimizer]
    return f"{count}x{moment} moments" if count else ""


def _shape(model: object) -> ModelShape:
    if isinstance(model, ModelShape):
        return model
    if isinstance(model, (int, float)) and not isinstance(model, bool):
        return ModelShape(float(model))
    if hasattr(model, "parameters") and hasattr(model, "modules"):
        return ModelShape.from_module(model)  # type: ignore[arg-type]
    raise config_error(
        "model", type(model).__name__, "is not a model", "pass a ModelShape, an nn.Module or a parameter count"
    )
