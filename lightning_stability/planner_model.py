"""The model side of the memory planner: a transformer's shape, memory sizes and the activation formula.

Pure arithmetic: ``torch`` is imported only by :meth:`ModelShape.from_module`, to read a module.

Sources:

* Parameter count of a GPT-style decoder: Narayanan et al. 2021, "Efficient Large-Scale Language Model
  Training on GPU Clusters Using Megatron-LM", Sec. 5.1: ``P = 12*l*h^2 * (1 + 13/(12h) + (V+s)/(12*l*h))``.
* Activations: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
  Sec. 4.1-4.3 (no tensor or sequence parallelism, no pipeline): per layer ``s*b*h*(34 + 5*a*s/h)`` bytes
  with 16-bit activations and 1-byte dropout masks; the output layer ``4*s*b*h*(1 + v/h)`` (the final
  layer norm's and the projection's inputs, and the logits in fp32 for the loss).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lightning_stability.errors import config_error

if TYPE_CHECKING:
    from torch import nn

GiB = float(1 << 30)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS.update({"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40})
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


def check_int(argument: str, value: object, minimum: int = 1) -> int:
    """``value`` if it is an int >= ``minimum`` (``bool`` is not accepted), else a config error naming it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise config_error(argument, value, f"must be an int >= {minimum}", f"pass e.g. {argument}={max(minimum, 1)}")
    return value


def check_number(argument: str, value: object, low: float = 0.0, high: float = math.inf, example: str = "1") -> float:
    """``value`` as a float if it is a finite number in ``(low, high)`` (``low`` excluded), else a config error."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (low < value < high and value < math.inf):
        bounds = f"> {low}" if high == math.inf else f"in ({low}, {high})"
        raise config_error(argument, value, f"must be a finite number {bounds}", f"pass e.g. {argument}={example}")
    return float(value)


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

    def unit_params(self) -> float:
        """Parameters of the largest unit gathered at once under full sharding (one FSDP unit per block
        assumed): ``largest_unit`` if given; else ``max(block, rest)`` with a block of ``12h^2 + 13h``
        parameters (or ``params/layers`` without ``hidden``); else the whole model."""
        if self.largest_unit is not None:
            return self.largest_unit
        if self.layers is None:
            return self.params
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
    """Activation bytes for one sample (``b = 1``: every term is linear in the micro-batch).

    ``layer``: one block's saved tensors; ``output``: the embedding dropout mask, the final norm's and the
    projection's inputs and the fp32 logits; ``full``: without checkpointing; ``checkpointed``: with full
    activation checkpointing (each block's input kept, one block recomputed at a time during backward).
    """

    layer: float
    output: float
    full: float
    checkpointed: float
    notes: tuple[str, ...]


def activations(shape: ModelShape, seq_len: int, element: int, flash_attention: bool) -> Activations | None:
    """Korthikanti et al. 2022 for one sample, with ``element`` bytes per activation (2 for 16-bit, 4 for fp32)
    and 1-byte dropout masks; ``None`` when ``layers`` or ``hidden`` is unknown.

    Per layer: ``s*h*(16e + 2) + a*s^2*(2e + 1)`` (``e = 2``: the paper's ``s*h*(34 + 5*a*s/h)``): inputs of
    the two norms, QKV, the QK^T operands, V, the output projection, the MLP's two linears and its activation
    (``16e``), two dropout masks (``2``), and the softmax output, its dropout mask and dropout output
    (``a*s^2*(2e + 1)``). With FlashAttention the scores are recomputed, not stored: ``4*a*s`` (fp32
    logsumexp) instead. Output layer (Sec. 4.3): ``s*h*(2e + 1) + 4*s*v``.
    """
    if shape.layers is None or shape.hidden is None:
        return None
    s, h, e = float(seq_len), float(shape.hidden), float(element)
    notes = []
    heads = shape.heads
    if heads is None and not flash_attention:
        heads = max(1, shape.hidden // 64)
        notes.append(f"heads unknown: assumed hidden/64 = {heads} (head dim 64) for the attention-score term")
    scores = 4.0 * (heads or 0) * s if flash_attention else (heads or 0) * s * s * (2 * e + 1)
    layer = s * h * (16 * e + 2) + scores
    output = s * h * (2 * e + 1)
    if shape.vocab is not None:
        output += 4.0 * s * shape.vocab
    else:
        notes.append("vocab unknown: the fp32 logits (4*s*b*v bytes) are not counted")
    full = shape.layers * layer + output
    checkpointed = shape.layers * s * h * e + layer + output
    return Activations(layer, output, full, checkpointed, tuple(notes))
