"""What comes before a loss spike, measured cheaply on the device, and the pure math of acting on it early.

The Lightning callback, :class:`PrecursorMonitor` (``callback``), logs them through the ledger as
``stability/...`` metrics on logging steps and runs the opt-in early actions (an LR back-off configured by
:class:`LRBackoff`, through the step's update scale; QK-clip, update clipping and a moment reset, edits right
after the update). Its pure parts:

* ``attention``: :class:`AttentionLogits`, the largest pre-softmax attention logit per layer and head (forward
  hooks; ``nn.MultiheadAttention``, Hugging Face GPT-2/BERT/Llama/Mistral/Qwen), :func:`register_attention`.
* ``logits``: :class:`LogPartition`, the LM head's mean log-sum-exp and its drift from an EMA.
* ``adam``: :func:`is_adam`, :func:`adam_eps_share`: the share of Adam's coordinates where epsilon dominates.
* ``actions``: QK-clip, StableAdamW's update clipping, a momentum reset that leaves the step count alone.
"""

from lightning_stability.precursors.actions import (
    HeadBlocks,
    QKProjection,
    apply_qk_clip_,
    clip_updates_,
    first_update_gain,
    qk_clip_factors,
    qk_projection,
    reset_moments_,
    scale_heads_,
    update_clip_coefficients,
)
from lightning_stability.precursors.adam import adam_eps_share, is_adam
from lightning_stability.precursors.attention import AttentionLogits, QueryKey, register_attention
from lightning_stability.precursors.callback import LRBackoff, PrecursorMonitor
from lightning_stability.precursors.logits import LogPartition, log_partition

__all__ = [
    "AttentionLogits",
    "HeadBlocks",
    "LRBackoff",
    "LogPartition",
    "PrecursorMonitor",
    "QKProjection",
    "QueryKey",
    "adam_eps_share",
    "apply_qk_clip_",
    "clip_updates_",
    "first_update_gain",
    "is_adam",
    "log_partition",
    "qk_clip_factors",
    "qk_projection",
    "register_attention",
    "reset_moments_",
    "scale_heads_",
    "update_clip_coefficients",
]
