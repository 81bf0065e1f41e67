"""The largest pre-softmax attention logit, per layer and head, captured by forward hooks on the device.

Attention-logit growth is the first instability Wortsman et al. 2023 reproduce at small scale ("Small-scale
proxies for large-scale Transformer training instabilities", arXiv 2309.14322): the logits ``q . k / sqrt(d)``
grow until softmax saturates and the loss diverges. Kimi K2's QK-clip (arXiv 2507.20534) acts on the same
number: the maximum over the batch and over (query, key) positions of each head's logit.

:class:`AttentionLogits` attaches a forward hook to every attention module of a model it knows (below) and keeps,
per module, a ``(heads,)`` device tensor: the running maximum since :meth:`AttentionLogits.reset` (several
micro-batches, or a forward recomputed under activation checkpointing, fold into one maximum). No host sync: the
hook recomputes the query and key projections from the module's own inputs and weights under ``no_grad`` (one
extra ``q @ k^T`` per attention layer: switch it off with ``active = False`` on the steps that do not log), and the
model's code is left as it is. Masked pairs (a causal mask, ``attn_mask``, ``key_padding_mask``, a Hugging Face
``attention_mask``) are left out of the maximum, as they are left out of the softmax.

Known attention modules:

* ``torch.nn.MultiheadAttention`` (so ``nn.TransformerEncoderLayer.self_attn`` and the decoder's), packed or
  separate projections, ``batch_first`` either way; not ``add_bias_kv`` (refused). In training the layer calls
  ``self_attn``; its inference fast path (eval mode without autograd) does not, so nothing is captured there.
* Hugging Face transformers: ``GPT2Attention`` (self-attention), ``BertSelfAttention``, ``LlamaAttention``,
  ``MistralAttention``, ``Qwen2Attention``, ``Qwen3Attention`` (rotary embeddings applied with the model's own
  ``apply_rotary_pos_emb``, Qwen3's q/k norms, grouped-query heads; a sliding window is not applied, so the
  maximum is then over the full causal triangle, an upper bound).

Your own attention: :func:`register_attention` with a function that returns the module's query and key per head
(:class:`QueryKey`); the maximum, the masking and the bookkeeping are done for you.

The maxima are those of this rank's batch; :class:`~lightning_stability.precursors.callback.PrecursorMonitor`
max-reduces them over the data-parallel ranks (DDP, FSDP2: each rank holds every head). Under tensor parallelism
a module holds only some heads, which this module does not follow: PrecursorMonitor does not measure them there.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lightning_stability.errors import StabilityConfigError, config_error
from lightning_stability.known_modules import lookup


@dataclass
class QueryKey:
    """One attention call's queries and keys, as a registered function returns them.

    Attributes:
        query: ``(batch, heads, q_len, head_dim)``, after every transform the module applies before ``q . k``
            (rotary embeddings, q/k norms).
        key: ``(batch, heads or kv_heads, k_len, head_dim)``; kv heads are repeated to ``heads`` (grouped-query).
        scale: the logit is ``scale * q . k`` (usually ``head_dim ** -0.5``).
        causal: key ``j`` is masked for query ``i`` when ``j > i + (k_len - q_len)``.
        mask: optional, broadcastable to ``(batch, heads, q_len, k_len)``: bool (``True``: attended) or additive
            float (``-inf``: masked).
    """

    query: Tensor
    key: Tensor
    scale: float
    causal: bool = False
    mask: Tensor | None = None


#: ``fn(module, args, kwargs) -> QueryKey`` from a forward call's inputs; ``None``: nothing to measure this call.
QueryKeyFn = Callable[[nn.Module, tuple[Any, ...], dict[str, Any]], "QueryKey | None"]

#: ``projection(module) -> QKProjection`` (:mod:`.actions`): where QK-clip scales a registered module's heads.
ProjectionFn = Callable[[nn.Module], Any]

_REGISTRY: dict[type[nn.Module], QueryKeyFn] = {}
_PROJECTIONS: dict[type[nn.Module], ProjectionFn] = {}
_HF_BY_NAME: dict[str, QueryKeyFn] = {}


def register_attention(cls: type[nn.Module], fn: QueryKeyFn, projection: ProjectionFn | None = None) -> None:
    """Teach :class:`AttentionLogits` (and QK-clip) your attention module.

    Args:
        cls: the attention module's class; subclasses match too (the nearest registered class wins).
        fn: called in a forward hook as ``fn(module, args, kwargs)`` with the module's forward arguments; returns
            its :class:`QueryKey` (or ``None`` to skip this call). It runs under ``no_grad``.
        projection: for QK-clip: ``projection(module)`` returns the module's
            :class:`~lightning_stability.precursors.actions.QKProjection` (which tensors hold each head's query
            and key rows). Called once the strategy has wrapped the model. ``None``: the logits are measured,
            QK-clip refuses the module.

    Raises:
        StabilityConfigError: when ``cls`` is not an ``nn.Module`` subclass, or ``fn`` or ``projection`` is not
            callable.

    Example::

        from lightning_stability import QueryKey, register_attention
        from lightning_stability.precursors import HeadBlocks, QKProjection

        def my_qk(module, args, kwargs):
            x = args[0]  # (batch, seq, width)
            q = module.wq(x).unflatten(-1, (module.heads, -1)).transpose(1, 2)
            k = module.wk(x).unflatten(-1, (module.heads, -1)).transpose(1, 2)
            return QueryKey(q, k, scale=q.shape[-1] ** -0.5, causal=True)

        def my_heads(module):  # wq, wk: nn.Linear(width, heads * head_dim) without bias
            head_dim = module.wq.out_features // module.heads
            q, k = [HeadBlocks(module.wq.weight, 0, 0)], [HeadBlocks(module.wk.weight, 0, 0)]
            return QKProjection(q, k, module.heads, module.heads, head_dim)

        register_attention(MyAttention, my_qk, projection=my_heads)
    """
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise config_error("cls", cls, "is not an nn.Module subclass", "pass your attention module's class")
    if not callable(fn):
        raise config_error("fn", fn, "is not callable", "pass fn(module, args, kwargs) -> QueryKey")
    if projection is not None and not callable(projection):
        raise config_error("projection", projection, "is not callable", "pass projection(module) -> QKProjection")
    _REGISTRY[cls] = fn
    if projection is not None:
        _PROJECTIONS[cls] = projection
    else:
        _PROJECTIONS.pop(cls, None)


def registered_projection(module: nn.Module) -> ProjectionFn | None:
    """The ``projection`` :func:`register_attention` was given for ``module``'s class (nearest first), or ``None``."""
    for cls in type(module).__mro__:
        if cls in _REGISTRY:
            return _PROJECTIONS.get(cls)
    return None


def query_key_fn(module: nn.Module) -> QueryKeyFn | None:
    """The function that reads ``module``'s queries and keys, or ``None`` if it is not a known attention."""
    return lookup(module, _REGISTRY, _HF_BY_NAME)


def attention_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``(name, module)`` of every known attention module of ``model``, in ``named_modules`` order."""
    for name, module in model.named_modules():
        if query_key_fn(module) is not None:
            yield name, module


def max_logit_per_head(qk: QueryKey) -> Tensor:
    """``(heads,)``: the largest unmasked ``scale * q . k`` of each head over the batch and positions (fp32)."""
    query, key = qk.query.float(), qk.key.float()
    heads, kv_heads = query.shape[1], key.shape[1]
    if kv_heads != heads:
        key = key.repeat_interleave(heads // kv_heads, dim=1)
    logits = torch.matmul(query, key.transpose(-2, -1)) * qk.scale  # (batch, heads, q_len, k_len)
    q_len, k_len = logits.shape[-2:]
    if qk.causal:
        future = torch.ones(q_len, k_len, dtype=torch.bool, device=logits.device).triu(k_len - q_len + 1)
        logits = logits.masked_fill(future, -math.inf)
    if qk.mask is not None:
        mask = qk.mask
        logits = logits.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else logits + mask.float()
    return logits.amax(dim=(0, 2, 3))


class AttentionLogits:
    """Forward hooks keeping each attention module's largest logit per head, on the device.

    Args:
        model: the model; every known attention module inside it is hooked (:func:`attention_modules`).

    Raises:
        StabilityConfigError: when ``model`` has no known attention module (register yours with
            :func:`register_attention`).

    Example::

        logits = AttentionLogits(model)
        loss = model(batch).sum()
        per_layer = logits.per_layer()  # (layers,) device tensor, no sync
        logits.reset()
    """

    def __init__(self, model: nn.Module) -> None:
        self.modules = dict(attention_modules(model))
        if not self.modules:
            raise StabilityConfigError(
                f"{type(model).__name__} has no attention module AttentionLogits knows (nn.MultiheadAttention, "
                "Hugging Face GPT-2/BERT/Llama/Mistral/Qwen attention). Fix: register yours with "
                "lightning_stability.precursors.attention.register_attention(YourAttention, fn)."
            )
        for name, module in self.modules.items():
            if isinstance(module, nn.MultiheadAttention) and module.bias_k is not None:
                raise config_error(
                    name,
                    module,
                    "uses add_bias_kv=True, which AttentionLogits does not measure",
                    "use add_bias_kv=False",
                )
        self.active = True  #: False: the hooks return at once (steps that do not log nor clip)
        self.maxima: dict[str, Tensor] = {}  #: per module name, ``(heads,)``, since the last reset
        self._handles = [
            module.register_forward_hook(self._hook(name, module), with_kwargs=True)
            for name, module in self.modules.items()
        ]

    def _hook(self, name: str, module: nn.Module) -> Callable[..., None]:
        fn = query_key_fn(module)
        assert fn is not None

        def hook(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
            if not self.active:
                return
            with torch.no_grad():
                qk = fn(mod, args, kwargs)
                if qk is None:
                    return
                heads = max_logit_per_head(qk)
            seen = self.maxima.get(name)
            self.maxima[name] = heads if seen is None else torch.maximum(seen, heads)

        return hook

    def per_layer(self) -> Tensor:
        """``(modules,)``: each hooked module's largest logit over its heads, in hook order (``-inf`` if unseen)."""
        return torch.stack([self._of(name).amax() for name in self.modules])

    def _of(self, name: str) -> Tensor:
        seen = self.maxima.get(name)
        if seen is not None:
            return seen
        device = next(self.modules[name].parameters()).device
        return torch.full((1,), -math.inf, device=device)

    def reset(self) -> None:
        """Forget the maxima (start of the next step)."""
        self.maxima = {}

    def remove(self) -> None:
        """Remove the hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles = []


# ---------------------------------------------------------------------------------------------- known modules
def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], index: int, name: str) -> Any:
    return args[index] if len(args) > index else kwargs.get(name)


def _heads(x: Tensor, heads: int) -> Tensor:
    """``(batch, seq, heads * d)`` -> ``(batch, heads, seq, d)``."""
    return x.unflatten(-1, (heads, -1)).transpose(1, 2)


def _multihead_attention(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> QueryKey:
    assert isinstance(module, nn.MultiheadAttention)
    query, key = _arg(args, kwargs, 0, "query"), _arg(args, kwargs, 1, "key")
    batched = query.dim() == 3
    if not batched:
        query, key = (
            query.unsqueeze(1 if not module.batch_first else 0),
            key.unsqueeze(1 if not module.batch_first else 0),
        )
    if not module.batch_first:
        query, key = query.transpose(0, 1), key.transpose(0, 1)
    width = module.embed_dim
    if module.in_proj_weight is not None:
        w_q, w_k = module.in_proj_weight[:width], module.in_proj_weight[width : 2 * width]
    else:
        w_q, w_k = module.q_proj_weight, module.k_proj_weight
    bias = module.in_proj_bias
    b_q, b_k = (bias[:width], bias[width : 2 * width]) if bias is not None else (None, None)
    q = _heads(nn.functional.linear(query, w_q, b_q), module.num_heads)
    k = _heads(nn.functional.linear(key, w_k, b_k), module.num_heads)
    attn_mask = kwargs.get("attn_mask", args[5] if len(args) > 5 else None)
    padding = kwargs.get("key_padding_mask", args[3] if len(args) > 3 else None)
    mask = None
    if attn_mask is not None:
        mask = ~attn_mask if attn_mask.dtype == torch.bool else attn_mask.float()  # nn.MHA: True means masked
        if mask.dim() == 3:  # (batch * heads, L, S)
            mask = mask.view(q.shape[0], module.num_heads, *mask.shape[-2:])
    if padding is not None:
        keep = (~padding if padding.dtype == torch.bool else padding.float())[:, None, None, :]
        if mask is None:
            mask = keep
        elif mask.dtype == torch.bool and keep.dtype == torch.bool:
            mask = mask & keep
        else:
            mask = _additive(mask) + _additive(keep)
    causal = bool(kwargs.get("is_causal", False)) and attn_mask is None
    return QueryKey(q, k, module.head_dim**-0.5, causal, mask)


def _additive(mask: Tensor) -> Tensor:
    """A bool keep-mask as an additive float mask (``-inf`` where masked); a float mask as it is."""
    if mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, device=mask.device).masked_fill(~mask, -math.inf)


def _hf_mask(kwargs: dict[str, Any], args: tuple[Any, ...], index: int) -> Tensor | None:
    """A Hugging Face 4-D ``attention_mask`` (bool: ``True`` attended; float: additive) or ``None``."""
    mask = _arg(args, kwargs, index, "attention_mask")
    return mask if isinstance(mask, Tensor) and mask.dim() == 4 else None


def _gpt2_attention(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> QueryKey | None:
    if kwargs.get("encoder_hidden_states") is not None:
        return None  # cross-attention: not measured
    hidden = _arg(args, kwargs, 0, "hidden_states")
    q, k, _ = module.c_attn(hidden).split(module.split_size, dim=2)
    heads = module.num_heads
    return QueryKey(_heads(q, heads), _heads(k, heads), float(module.scaling), True, _hf_mask(kwargs, args, 2))


def _bert_self_attention(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> QueryKey | None:
    if kwargs.get("encoder_hidden_states") is not None:
        return None
    hidden = _arg(args, kwargs, 0, "hidden_states")
    heads = module.num_attention_heads
    q, k = _heads(module.query(hidden), heads), _heads(module.key(hidden), heads)
    return QueryKey(q, k, float(module.scaling), bool(module.is_causal), _hf_mask(kwargs, args, 1))


def _llama_like_attention(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> QueryKey:
    hidden = _arg(args, kwargs, 0, "hidden_states")
    shape = (*hidden.shape[:-1], -1, module.head_dim)
    q, k = module.q_proj(hidden).view(shape), module.k_proj(hidden).view(shape)
    if hasattr(module, "q_norm"):  # Qwen3: RMSNorm over the head dimension
        q, k = module.q_norm(q), module.k_norm(k)
    q, k = q.transpose(1, 2), k.transpose(1, 2)
    cos, sin = _arg(args, kwargs, 1, "position_embeddings")
    rotary = sys.modules[type(module).__module__].apply_rotary_pos_emb  # the model's own
    q, k = rotary(q, k, cos, sin)
    return QueryKey(q, k, float(module.scaling), True, _hf_mask(kwargs, args, 2))


register_attention(nn.MultiheadAttention, _multihead_attention)
_HF_BY_NAME.update(
    GPT2Attention=_gpt2_attention,
    BertSelfAttention=_bert_self_attention,
    **dict.fromkeys(("LlamaAttention", "MistralAttention", "Qwen2Attention", "Qwen3Attention"), _llama_like_attention),
)
