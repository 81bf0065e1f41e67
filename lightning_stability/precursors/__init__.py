"""What comes before a loss spike, measured cheaply on the device, and the pure math of acting on it early.

Pure parts (the Lightning callback that logs them through the ledger and runs the actions comes on top):

* ``attention``: :class:`AttentionLogits`, the largest pre-softmax attention logit per layer and head (forward
  hooks; ``nn.MultiheadAttention``, Hugging Face GPT-2/BERT/Llama/Mistral/Qwen), :func:`register_attention`.
* ``logits``: :class:`LogPartition`, the LM head's mean log-sum-exp and its drift from an EMA.
* ``adam``: :func:`adam_update_stats`, each tensor's Adam step RMS and epsilon-dominated share.
* ``update_ratio``: per-layer update-to-weight ratios.
* ``actions``: QK-clip, StableAdamW's update clipping, a momentum reset that leaves the step count alone.
* ``scores``: the stability benchmark's figures (LR sensitivity, spike score, the largest LR that trains).
"""

from lightning_stability.precursors.actions import (
    QKProjection,
    apply_qk_clip_,
    clip_updates_,
    first_update_gain,
    qk_clip_factors,
    qk_projection,
    reset_moments_,
    update_clip_coefficients,
)
from lightning_stability.precursors.adam import AdamUpdateStats, adam_update_stats, is_adam_like
from lightning_stability.precursors.attention import AttentionLogits, QueryKey, register_attention
from lightning_stability.precursors.logits import LogPartition, log_partition
from lightning_stability.precursors.scores import lr_sensitivity, max_trainable_lr, spike_score
from lightning_stability.precursors.update_ratio import adam_update_norms, layer_groups, update_to_weight_ratios

__all__ = [
    "AdamUpdateStats",
    "AttentionLogits",
    "LogPartition",
    "QKProjection",
    "QueryKey",
    "adam_update_norms",
    "adam_update_stats",
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
    "reset_moments_",
    "spike_score",
    "update_clip_coefficients",
    "update_to_weight_ratios",
]
