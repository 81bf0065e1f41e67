"""Will it fit? Per-GPU memory of a transformer's training step from its size and the run's settings.

Pure arithmetic (no Lightning, no GPU; ``torch`` is imported only by :meth:`ModelShape.from_module`, to read a
module). :class:`ModelShape` describes the model; :func:`plan_memory` adds up, per GPU:

* **model states** by the ZeRO paper's accounting (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations
  Toward Training Trillion Parameter Models", Sec. 3.1 and 5): with mixed precision and Adam, ``2P`` bytes
  of 16-bit parameters, ``2P`` of 16-bit gradients and ``K*P = 12P`` of optimizer state (fp32 master
  weights, momentum, variance), ``16P`` in all for ``P`` parameters; stage 1 (``sharding="optimizer"``)
  divides the ``12P`` by the data-parallel degree ``N``, stage 2 (``"grad_op"``) the gradients too, stage 3
  (``"full"``, FSDP ``FULL_SHARD``) everything. fp32 training: ``4P + 4P + 8P``.
* **activations** by Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
  Sec. 4.1-4.3 and Table 2: per layer ``s*b*h*(34 + 5*a*s/h)`` bytes with 16-bit activations and 1-byte
  dropout masks; with tensor parallelism ``t`` ``s*b*h*(10 + 24/t + 5*a*s/(h*t))`` (layer norms, dropouts and
  the inputs of the first linears stay whole on every rank), with sequence parallelism too
  ``s*b*h*(34/t + 5*a*s/(h*t))``; the output layer ``4*s*b*h*(1 + v/h)`` (the final layer norm's and the
  projection's inputs, and the logits in fp32 for the loss; the logits split over ``t``). See :func:`activations`.
* **tensor and pipeline parallelism**: ``tensor_parallel=t`` splits each layer's weights over ``t`` GPUs of a
  node (Megatron-LM, Shoeybi et al. 2019), ``pipeline_parallel=p`` the layers into ``p`` stages (on paper
  only: Lightning has no pipeline strategy); the model states ZeRO shards are then ``P/(t*p)`` per GPU,
  sharded over the ``d = N/(t*p)`` data-parallel ranks.
* **buffers**, a stated allowance: under full sharding the gathered parameters of the largest unit twice
  (the one computing and the one prefetched) and its unsharded gradient once, in compute precision; plus
  ``overhead`` (CUDA context and allocator slack, 1 GiB by default; pass 0 for a CPU run). Left out, and said,
  when the unit is unknown (a parameter count alone that is no GPT-3 size).

A parameter count alone (no layers, hidden, heads, vocab) that is within 10% of a GPT-3 size takes that
model's shape (Brown et al. 2020, "Language Models are Few-Shot Learners", Table 2.1; :data:`GPT3_SHAPES`),
and the plan says so.

The parameter count of a GPT-style decoder from its shape (:meth:`ModelShape.decoder`) follows Narayanan
et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", Sec. 5.1:
``P = 12*l*h^2 * (1 + 13/(12h) + (V+s)/(12*l*h))``.

Not modelled: allocator fragmentation beyond ``overhead``; the few replicated parameters of tensor parallelism
(layer norms, biases: ``6h`` of a block's ``12h^2``); uneven pipeline stages (the embeddings on the first, the
head on the last); interleaved pipeline schedules; context and expert parallelism.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from lightning_stability.errors import check_bool, check_int, check_number, config_error

if TYPE_CHECKING:
    from torch import nn


__all__ = [
    "GPT3_SHAPES",
    "MemoryPlan",
    "ModelShape",
    "TensorParallelAdvice",
    "advise_tensor_parallel",
    "parse_memory",
    "plan_memory",
]

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
# GPT-3's sizes (Brown et al. 2020, Table 2.1): (name, parameters, layers, d_model, heads), all with a 2048-token
# context and GPT-2's 50257-token vocabulary. The table prints d_model 5140 for 13B, which its 40 heads of 128
# contradict: 5120 here. The XL row's 24 heads are as printed (they enter only the attention-score term).
GPT3_SHAPES: tuple[tuple[str, float, int, int, int], ...] = (
    ("GPT-3 Small", 125e6, 12, 768, 12),
    ("GPT-3 Medium", 350e6, 24, 1024, 16),
    ("GPT-3 Large", 760e6, 24, 1536, 16),
    ("GPT-3 XL", 1.3e9, 24, 2048, 24),
    ("GPT-3 2.7B", 2.7e9, 32, 2560, 32),
    ("GPT-3 6.7B", 6.7e9, 32, 4096, 32),
    ("GPT-3 13B", 13e9, 40, 5120, 40),
    ("GPT-3 175B", 175e9, 96, 12288, 96),
)
GPT3_VOCAB = 50257


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes per GPU of one training step, and whether they fit. :meth:`table` prints it with its formulas.

    ``activations_bytes`` is without and ``activations_checkpointed_bytes`` with full activation
    checkpointing (both at ``micro_batch``); ``total_bytes`` counts the one the plan was asked for.
    ``usable_bytes`` is the capacity less the headroom; ``fits``: ``total_bytes <= usable_bytes``, of the
    components counted: ``missing`` names those that could not be (the model's shape unknown), and then the
    real total is higher. ``max_micro_batch``: the largest micro-batch that fits (0: not even the model states
    and buffers; ``None``: unknown, the shape lacks ``layers``/``hidden``). ``accumulation``: gradient-accumulation
    steps to reach ``effective_batch`` over the ``data_parallel`` ranks (``None`` when it was not given).
    ``host_bytes``: CPU memory per GPU of the optimizer state offloaded by ``cpu_offload``. ``shape``: the shape
    planned, ``assumed_shape`` the GPT-3 size it was taken from when only a parameter count was given.
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
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    data_parallel: int = 1
    sequence_parallel: bool = False
    missing: tuple[str, ...] = ()
    assumed_shape: str | None = None
    shape: ModelShape | None = field(default=None, repr=False)
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
        if self.missing:
            lines.append(
                f"not counted: {', '.join(self.missing)} (the model's shape is unknown): the real total is higher; "
                "pass layers, hidden, heads, vocab (--layers ...) for a complete plan"
            )
        lines.append(f"max micro-batch: {'unknown' if self.max_micro_batch is None else self.max_micro_batch}")
        if self.accumulation is not None:
            batch = self.micro_batch * self.data_parallel
            ranks = (
                f"{self.world_size} GPUs"
                if self.data_parallel == self.world_size
                else f"{self.data_parallel} data-parallel ranks"
            )
            lines.append(
                f"gradient accumulation: {self.accumulation} steps (micro-batch {self.micro_batch} x "
                f"{ranks} x {self.accumulation} = {batch * self.accumulation} samples per step)"
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
    tensor_parallel: int = 1,
    sequence_parallel: bool = False,
    pipeline_parallel: int = 1,
    mixed_layout: Literal["zero", "autocast"] = "zero",
    headroom: float = 0.1,
    overhead: int | str = "1GiB",
) -> MemoryPlan:
    """Plan the per-GPU memory of training ``model`` (a :class:`ModelShape`, an ``nn.Module``, possibly on the
    ``meta`` device, or a parameter count) on ``nodes x gpus_per_node`` GPUs of ``gpu_memory`` each (a size with its
    unit, ``"80GiB"`` or ``"40GB"``, or bytes: a number under 1 MiB is refused as a unit left out).

    ``tensor_parallel=t`` splits each layer over ``t`` GPUs of a node (``StableFSDPStrategy(tensor_parallel=t)``;
    ``t`` must divide ``gpus_per_node``), ``sequence_parallel`` also splits the layer norms and dropouts over the
    sequence (Korthikanti et al. 2022), ``pipeline_parallel=p`` splits the layers into ``p`` stages run with the
    1F1B schedule (on paper: Lightning has no pipeline strategy). ``sharding`` then shards the model states over
    the ``d = N / (t*p)`` data-parallel ranks of ``N = nodes * gpus_per_node`` (ZeRO stages; see the module
    docstring). ``cpu_offload`` moves the optimizer state, fp32 master weights included, to host memory.
    ``mixed_layout`` (mixed precision only): ``"zero"`` is the paper's 16-bit parameters and gradients with
    fp32 master weights in the optimizer (DeepSpeed, Megatron); ``"autocast"`` keeps the parameters and
    gradients in fp32 and casts for compute (``torch.autocast`` under DDP, FSDP2's ``MixedPrecisionPolicy``):
    the same 16P for Adam, split 4/4/8, plus the 16-bit weight copies saved for backward (a buffer).
    ``flash_attention``: attention scores are recomputed, not stored. ``headroom``: the fraction of
    ``gpu_memory`` kept free. ``effective_batch``: global batch (samples) for the accumulation steps.
    A parameter count alone within 10% of a GPT-3 size plans that model's shape (:data:`GPT3_SHAPES`), said in
    the title and the notes; any other is planned without activations and gather buffers, named in ``missing``.
    Raises :class:`~lightning_stability.errors.StabilityConfigError` naming a bad argument.
    """
    shape = _shape(model)
    for name, value in (("nodes", nodes), ("gpus_per_node", gpus_per_node), ("seq_len", seq_len)):
        check_int(name, value)
    check_int("micro_batch", micro_batch)
    check_int("tensor_parallel", tensor_parallel, example="tensor_parallel=8 (GPUs splitting each layer; 1: none)")
    check_int("pipeline_parallel", pipeline_parallel, example="pipeline_parallel=4 (pipeline stages; 1: none)")
    for name, flag in (
        ("activation_checkpointing", activation_checkpointing),
        ("cpu_offload", cpu_offload),
        ("flash_attention", flash_attention),
        ("sequence_parallel", sequence_parallel),
    ):
        check_bool(name, flag)
    if effective_batch is not None:
        check_int("effective_batch", effective_batch)
    if headroom != 0:
        check_number("headroom", headroom, high=1.0, example="0.1")
    _choice("precision", precision, PRECISIONS)
    _choice("optimizer", optimizer, MOMENTS)
    _choice("sharding", sharding, SHARDINGS)
    _choice("mixed_layout", mixed_layout, {"zero": 0, "autocast": 0})
    capacity = parse_memory("gpu_memory", gpu_memory)
    if capacity < MIN_GPU_MEMORY:  # gpu_memory=80 is 80 bytes: a unit left out
        raise config_error(
            "gpu_memory",
            gpu_memory,
            f"is {capacity} bytes, less than any GPU has (a number without a unit is bytes)",
            'give the unit, e.g. gpu_memory="80GiB" or "40GB"',
        )
    fixed_overhead = parse_memory("overhead", overhead)
    shape, assumed = _standard_shape(shape)

    n, p, t, pp = nodes * gpus_per_node, shape.params, tensor_parallel, pipeline_parallel
    _check_model_parallel(shape, n, gpus_per_node, t, pp)
    d = n // (t * pp)
    width, master, moment = PRECISIONS[precision]
    compute = 4 if precision in ("32-true", "32") else 2
    autocast = master > 0 and mixed_layout == "autocast"
    if autocast:
        width, master = 4, 0
    shard_p, shard_g, shard_o, stage = SHARDINGS[sharding]
    split = f"/{t * pp}" if t * pp > 1 else ""  # TP and PP split the model before ZeRO shards it
    per = {True: (f"{split}/{d}" if d > 1 else split) if split else f"/{n}", False: split}
    notes: list[str] = []
    missing: list[str] = []
    if assumed is not None:
        notes.append(
            f"shape not given: {assumed}'s assumed (Brown et al. 2020, Table 2.1: {shape.layers} layers, d_model "
            f"{shape.hidden}, {shape.heads} heads; GPT-2's vocabulary of {shape.vocab}); pass layers/hidden/heads/"
            "vocab (--layers, --hidden, --heads, --vocab) to plan your model's own"
        )

    k = master + MOMENTS[optimizer] * moment
    k_text = " + ".join(filter(None, [f"{master} master" if master else "", _moments(optimizer, moment)])) or "none"
    optimizer_per_param = float(k)
    if optimizer == "adafactor":
        if shape.hidden is not None:
            optimizer_per_param += 2.0 * moment / shape.hidden
            k_text += f" + factored 2*{moment}/h"
        else:
            notes.append("adafactor: the factored second moment (~2*4*P/h bytes) is not counted (hidden unknown)")
    local = p / (t * pp)  # parameters of one GPU's tensor-parallel slice of its pipeline stage
    params_b = width * local / (d if shard_p else 1)
    grads_b = width * local / (d if shard_g else 1)
    optimizer_b = optimizer_per_param * local / (d if shard_o else 1)
    host_b = 0.0
    if cpu_offload:
        host_b, optimizer_b = optimizer_b, 0.0
        notes.append(f"cpu_offload: {host_b / GiB:.2f} GiB of optimizer state per GPU lives in host memory")

    whole = shape.unit_params()
    unit = None if whole is None else whole / t  # a tensor-parallel rank gathers its slice of the unit
    unit_text = "unit" if t == 1 else f"unit/{t}"
    buffers, parts = (
        float(fixed_overhead),
        [f"{fixed_overhead / GiB:.2f} GiB overhead (CUDA context, allocator: assumed)"],
    )
    if sharding in ("full", "grad_op") and unit is None:
        missing.append("FSDP gather buffers")
        notes.append(
            f"FSDP gather buffers not counted: the size of a unit (a block) is unknown without layers, and "
            f"{p / 1e9:.4g}B parameters are no GPT-3 size (125M-175B) within 10%"
        )
    elif sharding == "full" and unit is not None:
        buffers += 3.0 * compute * unit
        parts.insert(0, f"3 x {compute}B x {unit_text} of {unit:.3g} params (2 gathered + 1 unsharded grad)")
    elif sharding == "grad_op" and unit is not None:
        buffers += 1.0 * compute * unit
        parts.insert(0, f"{compute}B x {unit_text} of {unit:.3g} params (unsharded grad before reduce-scatter)")
    if autocast and sharding != "full":
        buffers += 2.0 * local
        parts.insert(0, f"2P{split} (16-bit weight copies saved for backward)")
    buffer_text = " + ".join(parts)

    acts = activations(
        shape,
        seq_len,
        compute,
        flash_attention,
        tensor_parallel=t,
        sequence_parallel=sequence_parallel,
        pipeline_parallel=pp,
    )
    if acts is None:
        full_a = ckpt_a = per_sample = 0.0
        missing.insert(0, "activations")
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
        accumulation = math.ceil(effective_batch / (micro_batch * d))
        if accumulation * micro_batch * d != effective_batch:
            notes.append(
                f"effective_batch={effective_batch} is not a multiple of micro_batch*d = {micro_batch * d} "
                f"(d = {d} data-parallel ranks): {accumulation} steps give {accumulation * micro_batch * d}"
            )
        if pp > 1 and accumulation < pp:
            notes.append(
                f"{accumulation} micro-batches per step on {pp} pipeline stages: the pipeline idles (the 1F1B "
                f"schedule wants >= {pp}, and the activations assume {pp} in flight)"
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
    if sharding == "none" and d > 1:
        notes.append("DDP without gradient_as_bucket_view=True holds a second copy of the gradients in its buckets")
    if acts is not None and not flash_attention:
        notes.append("eager attention: scores stored (5*a*s/h term); flash_attention=True drops it")
    if pp > 1:
        notes.append(
            f"pipeline_parallel={pp} is planned on paper only: Lightning (and StableFSDPStrategy) has no pipeline "
            "strategy; the first stage keeps its layers' activations for pp micro-batches (1F1B): L layers' worth"
        )

    rows: tuple[tuple[str, int, str, str], ...] = (
        ("params", round(params_b), f"{width}P{per[shard_p]}", ZERO),
        ("grads", round(grads_b), f"{width}P{per[shard_g]}", ZERO),
        (
            "optimizer",
            round(optimizer_b),
            f"{k:g}P{per[shard_o]} ({k_text}){', on host' if cpu_offload else ''}",
            ZERO,
        ),
    )
    if acts is not None:
        marks = (" (used)", "") if not activation_checkpointing else ("", " (used)")
        rows += (
            ("activations" + marks[0], round(full_a), acts.formula, f"{KORTHIKANTI} Sec. 4, Table 2"),
            ("activations ckpt" + marks[1], round(ckpt_a), acts.checkpointed_formula, f"{KORTHIKANTI} Sec. 5"),
        )
    rows += (("buffers", round(buffers), buffer_text, "allowance"),)
    layout = ""
    if t * pp > 1:
        layout = f", TP {t}{' + sequence parallel' if sequence_parallel else ''} x PP {pp} x DP {d}"
    title = (
        f"Memory plan per GPU: {p / 1e9:.4g}B params{f' (shape: {assumed} assumed)' if assumed else ''} on "
        f"{nodes} x {gpus_per_node} = {n} GPUs{layout}, {precision}, {optimizer}, sharding={sharding} ({stage}), "
        f"seq {seq_len}, micro-batch {micro_batch}"
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
        tensor_parallel=t,
        pipeline_parallel=pp,
        data_parallel=d,
        sequence_parallel=sequence_parallel,
        missing=tuple(missing),
        assumed_shape=assumed,
        shape=shape,
        notes=tuple(notes),
        title=title,
        rows=rows,
    )


def _check_model_parallel(shape: ModelShape, world: int, gpus_per_node: int, tp: int, pp: int) -> None:
    """Tensor parallelism within a node, dividing the heads; the model-parallel group dividing the GPUs."""
    if gpus_per_node % tp:
        raise config_error(
            "tensor_parallel",
            tp,
            f"does not divide gpus_per_node={gpus_per_node}",
            "pass a divisor of the GPUs per node: a tensor-parallel group communicates at every layer and stays "
            "within a node's fast links (as StableFSDPStrategy(tensor_parallel=...) requires)",
        )
    if shape.heads is not None and shape.heads % tp:
        raise config_error(
            "tensor_parallel",
            tp,
            f"does not divide the {shape.heads} attention heads",
            "pass a divisor of the heads: tensor parallelism gives each rank whole heads",
        )
    if shape.layers is not None and pp > shape.layers:
        raise config_error(
            "pipeline_parallel", pp, f"exceeds the {shape.layers} layers", f"pass at most {shape.layers} stages"
        )
    if world % (tp * pp):
        raise config_error(
            "pipeline_parallel",
            pp,
            f"times tensor_parallel={tp} does not divide the {world} GPUs",
            f"pass a pipeline_parallel that divides {world // tp if world % tp == 0 else world} (GPUs / TP)",
        )


def _standard_shape(shape: ModelShape) -> tuple[ModelShape, str | None]:
    """``shape``, or, when it is a parameter count alone within 10% of a GPT-3 size, that model's shape."""
    given = (shape.layers, shape.hidden, shape.heads, shape.vocab, shape.largest_unit)
    if any(value is not None for value in given):
        return shape, None
    for name, params, layers, hidden, heads in GPT3_SHAPES:
        if abs(shape.params / params - 1.0) <= 0.1:
            return ModelShape(shape.params, layers, hidden, heads, GPT3_VOCAB), name
    return shape, None


@dataclass(frozen=True)
class TensorParallelAdvice:
    """Whether sharding or tensor parallelism is needed to fit, and which: one plan per size tried.

    ``plans``: the plans at each tensor-parallel size tried (1, 2, 4, 8, ... up to the GPUs per node, those that
    divide the heads and the GPUs); ``smallest``: the smallest size whose plan fits (``None``: none fits).
    ``sharded``: asked without full sharding on several GPUs and not fitting, the plan with plain full sharding
    (FSDP, ZeRO-3) at TP 1, tried first; the larger TP sizes are planned with full sharding, as
    ``StableFSDPStrategy(tensor_parallel=...)`` runs them.
    """

    plans: tuple[MemoryPlan, ...]
    smallest: int | None
    also: tuple[str, ...] = ("offload", "more GPUs")
    sharded: MemoryPlan | None = None

    def text(self) -> str:
        """One line: not needed, sharding fits, TP needed (and which size fits), or nothing fits (and what to try)."""
        tried = ", ".join(f"TP {p.tensor_parallel}: {p.total_bytes / GiB:.2f}" for p in self.plans)
        usable = self.plans[0].usable_bytes / GiB
        partial = " (counting what is known: see 'not counted')" if self.plans[0].missing else ""
        if self.smallest == 1:
            return f"tensor parallel: not needed: TP 1 fits{partial} ({tried} GiB of {usable:.2f} usable)"
        if self.sharded is not None and self.sharded.fits:
            return (
                f"sharding: needed: plain full sharding fits{partial} ({self.sharded.total_bytes / GiB:.2f} GiB of "
                f"{usable:.2f} usable; unsharded {self.plans[0].total_bytes / GiB:.2f}); pass --sharding full "
                "(StableFSDPStrategy(), the preset field fsdp=True): no tensor parallelism needed"
            )
        if self.smallest is not None:
            sharded = " with full sharding" if self.sharded is not None else ""
            fsdp = " and fsdp=True" if self.sharded is not None else ""
            return (
                f"tensor parallel: needed: TP {self.smallest}{sharded} is the smallest size that fits{partial} "
                f"({tried} GiB of {usable:.2f} usable); pass --tensor-parallel {self.smallest} "
                f"(StableFSDPStrategy(tensor_parallel={self.smallest}), the preset fields "
                f"tensor_parallel={self.smallest}{fsdp})"
            )
        largest = self.plans[-1].tensor_parallel
        also = ", ".join(self.also[:-1]) + f" or {self.also[-1]}" if len(self.also) > 1 else "".join(self.also)
        return f"tensor parallel: no size up to TP {largest} fits ({tried} GiB of {usable:.2f} usable): try {also}"


def advise_tensor_parallel(model: ModelShape | nn.Module | float, **kwargs: Any) -> TensorParallelAdvice:
    """:func:`plan_memory` with plain full sharding first (when ``sharding`` is not ``"full"``), then at
    tensor-parallel sizes 1, 2, 4, 8, ... up to ``gpus_per_node`` (those that divide the GPUs per node, the heads,
    and the GPUs with ``pipeline_parallel``), the other arguments as given.

    Example::

        advice = advise_tensor_parallel(ModelShape(175e9), nodes=8, gpus_per_node=8, gpu_memory="40GiB")
        print(advice.text())  # "tensor parallel: needed: TP 2 is the smallest size that fits (...)"
    """
    kwargs.pop("tensor_parallel", None)
    first = plan_memory(model, **kwargs)  # checks every argument; also resolves the shape once
    shape = first.shape if first.shape is not None else _shape(model)
    gpus, world = first.world_size // max(1, kwargs.get("nodes", 1)), first.world_size
    pp = first.pipeline_parallel
    sharded = None
    if kwargs.get("sharding", "full") != "full" and not first.fits and world > 1:
        kwargs = {**kwargs, "sharding": "full"}  # sharding before tensor parallelism, which needs it here
        sharded = plan_memory(shape, **kwargs)
    plans = [first]
    size = 2
    while size <= gpus:
        if gpus % size == 0 and (shape.heads is None or shape.heads % size == 0) and world % (size * pp) == 0:
            plans.append(plan_memory(shape, tensor_parallel=size, **kwargs))
        size *= 2
    smallest = next((p.tensor_parallel for p in plans if p.fits), None)
    also = [
        "activation checkpointing" if not kwargs.get("activation_checkpointing") else "",
        "sequence parallelism" if not kwargs.get("sequence_parallel") else "",
        "a smaller micro-batch" if kwargs.get("micro_batch", 1) > 1 else "",
        "offloading the optimizer state" if not kwargs.get("cpu_offload") else "",
        "more GPUs",
    ]
    return TensorParallelAdvice(tuple(plans), smallest, tuple(filter(None, also)), sharded)


def _moments(optimizer: str, moment: int) -> str:
    count = MOMENTS[optimizer]
    return f"{count}x{moment} moments" if count else ""


def _shape(model: object) -> ModelShape:
    if isinstance(model, ModelShape):
        return model
    if isinstance(model, (int, float)) and not isinstance(model, bool):
        return ModelShape(check_number("model", model, example="7e9 (a parameter count)"))
    if hasattr(model, "parameters") and hasattr(model, "modules"):
        return ModelShape.from_module(model)  # type: ignore[arg-type]
    raise config_error(
        "model", type(model).__name__, "is not a model", "pass a ModelShape, an nn.Module or a parameter count"
    )


GiB = float(1 << 30)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS.update({"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40})
#: the smallest ``gpu_memory`` :func:`plan_memory` takes (1 MiB): a smaller one is a unit left out
MIN_GPU_MEMORY = 1 << 20
_MEMORY = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)(?:[eE]([+-]?\d+))?\s*([a-zA-Z]*)\s*$")


def parse_memory(argument: str, value: object) -> int:
    """Bytes in ``value``: an int or float of bytes, or a string such as ``"80GiB"``, ``"40GB"``, ``"512 MiB"``.

    ``GB`` is 10**9 bytes, ``GiB`` 2**30 (as ``nvidia-smi`` reports ``MiB``). Raises
    :class:`~lightning_stability.errors.StabilityConfigError` naming ``argument`` for anything else.
    """
    fix = 'pass bytes (an int) or a string with a unit, e.g. "80GiB" or "40GB"'
    if isinstance(value, bool):
        raise config_error(argument, value, "is not a memory size", fix)
    if isinstance(value, (int, float)):
        number = float(value)
    elif isinstance(value, str) and (match := _MEMORY.match(value)):
        mantissa, exponent, unit = match.groups()
        if unit.lower() not in _UNITS and unit != "":
            raise config_error(argument, value, f"has an unknown unit {unit!r}", f"use one of {sorted(_UNITS)}; {fix}")
        number = float(mantissa) * 10 ** int(exponent or 0) * _UNITS.get(unit.lower(), 1)
    else:
        raise config_error(argument, value, "is not a memory size", fix)
    if not math.isfinite(number) or number < 0:
        raise config_error(argument, value, "must be a finite size >= 0", fix)
    return int(number)


@dataclass(frozen=True)
class ModelShape:
    """What the planner needs to know about a decoder-only transformer.

    ``params`` alone gives the model states (parameters, gradients, optimizer state). ``layers``, ``hidden``
    (and ``heads`` for eager attention, ``vocab`` for the logits) give the activations. ``largest_unit`` is the
    parameter count of the largest piece FSDP/ZeRO-3 gathers at once (a block, or the root with the
    embeddings and the head); ``None`` derives it from the other fields (see :meth:`unit_params`).
    """

    params: float
    layers: int | None = None
    hidden: int | None = None
    heads: int | None = None
    vocab: int | None = None
    largest_unit: float | None = None

    def __post_init__(self) -> None:
        check_number("params", self.params, example="7e9")
        for name in ("layers", "hidden", "heads", "vocab"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name))
        if self.largest_unit is not None:
            check_number("largest_unit", self.largest_unit)

    @classmethod
    def decoder(cls, layers: int, hidden: int, heads: int, vocab: int, positions: int = 0) -> ModelShape:
        """A GPT-style decoder, its parameters counted by Narayanan et al. 2021 (Sec. 5.1):
        ``12*l*h^2 + 13*l*h`` in the blocks plus ``(V + positions)*h`` in the embeddings (``positions``:
        learned position embeddings, 0 for rotary). GPT-3 175B: ``decoder(96, 12288, 96, 51200, 2048)``."""
        for name, value in (("layers", layers), ("hidden", hidden), ("heads", heads), ("vocab", vocab)):
            check_int(name, value)
        check_int("positions", positions, minimum=0)
        params = layers * _block_params(hidden) + (vocab + positions) * hidden
        return cls(float(params), layers, hidden, heads, vocab)

    @classmethod
    def from_module(
        cls,
        module: nn.Module,
        *,
        layers: int | None = None,
        hidden: int | None = None,
        heads: int | None = None,
        vocab: int | None = None,
    ) -> ModelShape:
        """Count ``module``'s parameters (``numel`` only: a module on the ``meta`` device works and allocates
        nothing) and infer its shape; the keyword arguments override what is inferred.

        Inference, in order: a Hugging Face style ``config`` (``num_hidden_layers``/``n_layer``,
        ``hidden_size``/``n_embd``/``d_model``, ``num_attention_heads``/``n_head``, ``vocab_size``); else the
        blocks are the ``nn.ModuleList`` of same-type modules with the most parameters, ``hidden`` the
        ``embedding_dim`` of the largest ``nn.Embedding`` (or an ``nn.MultiheadAttention``'s ``embed_dim``),
        ``heads`` an ``nn.MultiheadAttention``'s ``num_heads`` or an int attribute ``num_heads``/``n_head``/
        ``n_heads``/``heads`` of a submodule, ``vocab`` the ``num_embeddings`` of the embedding a linear head
        maps back to (else of the largest embedding). What is not found stays ``None``.
        """
        from torch import nn

        params = sum(p.numel() for p in module.parameters())
        if params == 0:
            raise config_error("module", type(module).__name__, "has no parameters", "pass the model to be trained")
        config = getattr(module, "config", None)
        blocks = _find_blocks(module)
        embeddings = sorted(
            (m for m in module.modules() if isinstance(m, nn.Embedding)), key=lambda m: m.weight.numel()
        )
        attention = [m for m in module.modules() if isinstance(m, nn.MultiheadAttention)]
        found: dict[str, Any] = {
            "layers": _config(config, "num_hidden_layers", "n_layer", "num_layers") or (len(blocks) or None),
            "hidden": _config(config, "hidden_size", "n_embd", "d_model")
            or (embeddings[-1].embedding_dim if embeddings else None)
            or (attention[0].embed_dim if attention else None),
            "heads": _config(config, "num_attention_heads", "n_head", "num_heads")
            or (attention[0].num_heads if attention else None)
            or _attribute(module, "num_heads", "n_head", "n_heads", "heads"),
            "vocab": _config(config, "vocab_size") or _vocab(module, embeddings),
        }
        given = {"layers": layers, "hidden": hidden, "heads": heads, "vocab": vocab}
        shape = {name: given[name] if given[name] is not None else found[name] for name in given}
        unit = None
        if blocks:
            block_params = [sum(p.numel() for p in b.parameters()) for b in blocks]
            unit = float(max(max(block_params), params - sum(block_params)))
        return cls(float(params), largest_unit=unit, **shape)

    def unit_params(self) -> float | None:
        """Parameters of the largest unit gathered at once under full sharding (one FSDP unit per block
        assumed): ``largest_unit`` if given; else ``max(block, rest)`` with a block of ``12h^2 + 13h``
        parameters (or ``params/layers`` without ``hidden``); ``None`` without ``layers`` (unknown: not the
        whole model, which no FSDP wrapping of a transformer gathers at once)."""
        if self.largest_unit is not None:
            return self.largest_unit
        if self.layers is None:
            return None
        block = _block_params(self.hidden) if self.hidden is not None else self.params / self.layers
        return float(min(self.params, max(block, self.params - self.layers * block)))


def _block_params(hidden: int) -> int:
    """One transformer block (Narayanan et al. 2021): QKV + output projection ``4h^2 + 4h``, MLP ``8h^2 + 5h``,
    two layer norms ``4h``."""
    return 12 * hidden * hidden + 13 * hidden


def _config(config: object, *names: str) -> int | None:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _attribute(module: nn.Module, *names: str) -> int | None:
    for sub in module.modules():
        found = _config(sub, *names)
        if found is not None:
            return found
    return None


def _find_blocks(module: nn.Module) -> list[nn.Module]:
    from torch import nn

    best: list[nn.Module] = []
    best_params = 0
    for sub in module.modules():
        if isinstance(sub, nn.ModuleList) and len(sub) > 0 and len({type(m) for m in sub}) == 1:
            count = sum(p.numel() for p in sub.parameters())
            if count > best_params:
                best, best_params = list(sub), count
    return best


def _vocab(module: nn.Module, embeddings: list[nn.Embedding]) -> int | None:
    from torch import nn

    if not embeddings:
        return None
    sizes = {e.num_embeddings for e in embeddings}
    outputs = [m.out_features for m in module.modules() if isinstance(m, nn.Linear) and m.out_features in sizes]
    return max(outputs) if outputs else embeddings[-1].num_embeddings


@dataclass(frozen=True)
class Activations:
    """Activation bytes for one sample (``b = 1``: every term is linear in the micro-batch) on one GPU.

    ``layer``: one block's saved tensors; ``output``: the embedding dropout mask, the final norm's and the
    projection's inputs and the fp32 logits; ``full``: without checkpointing; ``checkpointed``: with full
    activation checkpointing (each block's input kept, one block recomputed at a time during backward); with
    pipeline stages, both are the larger of the first and the last stage. ``formula``,
    ``checkpointed_formula``: how ``full`` and ``checkpointed`` were added up, for the plan's table.
    """

    layer: float
    output: float
    full: float
    checkpointed: float
    notes: tuple[str, ...]
    formula: str = ""
    checkpointed_formula: str = ""


def activations(
    shape: ModelShape,
    seq_len: int,
    element: int,
    flash_attention: bool,
    *,
    tensor_parallel: int = 1,
    sequence_parallel: bool = False,
    pipeline_parallel: int = 1,
) -> Activations | None:
    """Korthikanti et al. 2022 for one sample, with ``element`` bytes per activation (2 for 16-bit, 4 for fp32)
    and 1-byte dropout masks; ``None`` when ``layers`` or ``hidden`` is unknown.

    Per layer: ``s*h*(16e + 2) + a*s^2*(2e + 1)`` (``e = 2``: the paper's ``s*h*(34 + 5*a*s/h)``): inputs of
    the two norms, QKV, the QK^T operands, V, the output projection, the MLP's two linears and its activation
    (``16e``), two dropout masks (``2``), and the softmax output, its dropout mask and dropout output
    (``a*s^2*(2e + 1)``). With FlashAttention the scores are recomputed, not stored: ``4*a*s`` (fp32
    logsumexp) instead. Output layer (Sec. 4.3): ``s*h*(2e + 1) + 4*s*v``.

    Tensor parallelism ``t`` (Sec. 4.2.1, Table 2): the two norms' inputs, the inputs of QKV and of the first
    MLP linear and the two dropout masks stay whole on every rank (``s*h*(4e + 2)``, the paper's ``10``); the
    rest and the scores split: ``s*h*(4e + 2 + 12e/t) + a*s^2*(2e + 1)/t``, i.e. ``s*h*(10 + 24/t +
    5*a*s/(h*t))``. Sequence parallelism (Sec. 4.2.2) splits the whole part over the sequence too:
    ``(s*h*(16e + 2) + a*s^2*(2e + 1))/t``, i.e. ``s*h*(34/t + 5*a*s/(h*t))``; the output layer's inputs split
    the same way, the logits over ``t`` in both (a vocabulary-parallel projection and loss, Megatron's and
    torch's ``loss_parallel``). Checkpointed, each layer keeps its input, ``s*h*e`` (Table 2's ``2sbh``), of which
    a rank holds ``1/t`` under sequence parallelism. Pipeline stages ``p`` (Sec. 4.2.3): a stage holds ``L/p``
    layers, and under the 1F1B schedule the first stage holds ``p`` micro-batches at once: ``L`` layers' worth,
    as without pipeline parallelism; the last stage holds one micro-batch and the output layer.
    """
    if shape.layers is None or shape.hidden is None:
        return None
    s, h, e = float(seq_len), float(shape.hidden), float(element)
    t, sp, pp = tensor_parallel, sequence_parallel, pipeline_parallel
    notes = []
    heads = shape.heads
    if heads is None and not flash_attention:
        heads = max(1, shape.hidden // 64)
        notes.append(f"heads unknown: assumed hidden/64 = {heads} (head dim 64) for the attention-score term")
    scores = (4.0 * (heads or 0) * s if flash_attention else (heads or 0) * s * s * (2 * e + 1)) / t
    whole = 1.0 / t if sp else 1.0  # the part tensor parallelism leaves whole, split by sequence parallelism
    layer = s * h * ((4 * e + 2) * whole + 12 * e / t) + scores
    kept = s * h * e * whole  # a checkpointed layer's input
    embedding = s * h * whole  # the embedding dropout mask
    head = s * h * 2 * e * whole  # the final norm's and the projection's inputs
    if shape.vocab is not None:
        head += 4.0 * s * shape.vocab / t
    else:
        notes.append("vocab unknown: the fp32 logits (4*s*b*v bytes) are not counted")
    output = embedding + head
    stage = math.ceil(shape.layers / pp)
    if pp == 1:
        full = shape.layers * layer + output
        checkpointed = shape.layers * kept + layer + output
    else:  # the first stage: pp micro-batches in flight; the last: one, and the output layer
        full = max(pp * (stage * layer + embedding), stage * layer + head)
        checkpointed = max(pp * (stage * kept + embedding) + layer, stage * kept + layer + head)
    split = f"/{t}" if t > 1 else ""
    if t == 1:
        per_layer = "L*s*b*h*(16e+2)"
    elif sp:
        per_layer = f"L*s*b*h*(16e+2)/{t}"
    else:
        per_layer = f"L*s*b*h*(4e+2 + 12e/{t})"
    scores_text = f"L*4*a*s*b{split}" if flash_attention else f"L*a*s^2*b*(2e+1){split}"
    out_split = split if sp else ""
    formula = f"{per_layer} + {scores_text} + s*b*h*(2e+1){out_split} + 4*s*b*v{split}, e={element}"
    ckpt = f"L*s*b*h*e{out_split} + one layer + output, e={element}"
    if pp > 1:
        formula = f"stage of L/{pp} layers x {pp} micro-batches (1F1B): {formula}"
        ckpt = f"stage of L/{pp} layers x {pp} micro-batches (1F1B): {ckpt}"
    return Activations(layer, output, full, checkpointed, tuple(notes), formula, ckpt)
