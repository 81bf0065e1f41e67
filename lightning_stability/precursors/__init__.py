"""What comes before a loss spike, measured cheaply on the device, and the pure math of acting on it early.

The Lightning callback, :class:`PrecursorMonitor` (``callback``), logs them through the ledger as
``stability/...`` metrics on logging steps and runs the opt-in early actions (QK-clip, update clipping, an LR
back-off configured by :class:`LRBackoff`, a moment reset on a spike). Its pure parts:

* ``attention``: :class:`AttentionLogits`, the largest pre-softmax attention logit per layer and head (forward
  hooks; ``nn.MultiheadAttention``, Hugging Face GPT-2/BERT/Llama/Mistral/Qwen), :func:`register_attention`.
* ``logits``: :class:`LogPartition`, the LM head's mean log-sum-exp and its drift from an EMA.
* ``adam``: :func:`adam_updates`, the step Adam just applied to each tensor and its norm; :func:`adam_update_stats`,
  each tensor's Adam step RMS and epsilon-dominated share.
* ``update_ratio``: per-layer update-to-weight ratios.
* ``actions``: QK-clip, StableAdamW's update clipping, a copy-free rescaling of the Adam update just applied, a
  momentum reset that leaves the step count alone.
* ``scores``: the stability benchmark's figures (LR sensitivity, spike score, the largest LR that trains).
"""

from lightning_stability.precursors.actions import (
    HeadBlocks,
    QKProjection,
    apply_qk_clip_,
    clip_updates_,
    first_update_gain,
    qk_clip_factors,
    qk_projection,
    rescale_adam_updates_,
    reset_moments_,
    scale_heads_,
    update_clip_coefficients,
)
from lightning_stability.precursors.adam import (
    AdamUpdates,
    AdamUpdateStats,
    adam_update_stats,
    adam_updates,
    is_adam_like,
)
from lightning_stability.precursors.attention import AttentionLogits, QueryKey, register_attention
from lightning_stability.precursors.callback import LRBackoff, PrecursorMonitor
from lightning_stability.precursors.logits import LogPartition, log_partition
from lightning_stability.precursors.scores import lr_sensitivity, max_trainable_lr, spike_score
from lightning_stability.precursors.update_ratio import layer_groups, update_to_weight_ratios

__all__ = [
    "AdamUpdateStats",
    "AdamUpdates",
    "AttentionLogits",
    "HeadBlocks",
    "LRBackoff",
    "LogPartition",
    "PrecursorMonitor",
    "QKProjection",
    "QueryKey",
    "adam_update_stats",
    "adam_updates",
    "apply_qk_clip_",
    "clip_updates_",
    "first_update_gain",
    "is_adam_like",
    "layer_groups",
    "log_partition",
    "lr_sensitivity",
    "max_trainable_lr",
    "qk_clip_factors",
    "qk_projection",
    "register_attention",
    "rescale_adam_updates_",
    "reset_moments_",
    "scale_heads_",
    "spike_score",
    "update_clip_coefficients",
    "update_to_weight_ratios",
]
