"""Tiny Hugging Face mixtures of experts (transformers 5) for RouterHealthMonitor's tests, in a LightningModule."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, DistributedSampler

VOCAB, LENGTH, EXPERTS, TOP_K = 32, 8, 4, 2
#: the families built from configs; the first three are trained in the tests, the others found and read
FAMILIES = ("mixtral", "qwen2_moe", "olmoe", "qwen3_moe", "deepseek_v2", "deepseek_v3")


def build(family: str) -> nn.Module:
    """A 2-layer causal LM of ``family`` with 4 experts, top-2, hidden size 16."""
    import transformers

    small: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        num_experts_per_tok=TOP_K,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    moe = dict(num_experts=EXPERTS, moe_intermediate_size=16)
    deepseek = dict(
        n_routed_experts=EXPERTS,
        moe_intermediate_size=16,
        first_k_dense_replace=0,
        kv_lora_rank=8,
        q_lora_rank=None,
        qk_rope_head_dim=4,
        qk_nope_head_dim=4,
        v_head_dim=8,
        n_group=1,
        topk_group=1,
    )
    if family == "mixtral":
        return transformers.MixtralForCausalLM(transformers.MixtralConfig(num_local_experts=EXPERTS, **small))
    if family == "qwen2_moe":
        config = transformers.Qwen2MoeConfig(shared_expert_intermediate_size=16, **moe, **small)
        return transformers.Qwen2MoeForCausalLM(config)
    if family == "olmoe":
        return transformers.OlmoeForCausalLM(transformers.OlmoeConfig(**moe, **small))
    if family == "qwen3_moe":
        return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(head_dim=8, **moe, **small))
    if family == "deepseek_v2":
        return transformers.DeepseekV2ForCausalLM(transformers.DeepseekV2Config(**deepseek, **small))
    if family == "deepseek_v3":
        return transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**deepseek, **small))
    raise ValueError(f"family={family!r}: pass one of {', '.join(FAMILIES)}")


def gates(model: nn.Module) -> dict[str, nn.Module]:
    """The routers by name (``...mlp.gate`` in every family here)."""
    return {name: m for name, m in model.named_modules() if name.endswith("mlp.gate")}


class MoELM(pl.LightningModule):
    """A tiny HF MoE LM on random tokens, in order (``batches`` batches of ``batch_size`` sequences per process;
    on N processes each takes every N-th sequence, so step k sees what one process sees at step k with batches of
    N * ``batch_size``)."""

    def __init__(self, family: str = "mixtral", batches: int = 4, batch_size: int = 4, lr: float = 3e-2) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = build(family)
        self.batches, self.batch_size, self.lr = batches, batch_size, lr

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        return self.model(input_ids=batch, labels=batch).loss

    def train_dataloader(self) -> DataLoader[Tensor]:
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        data = torch.randint(
            VOCAB, (self.batches * self.batch_size * world, LENGTH), generator=torch.Generator().manual_seed(0)
        )
        sampler = DistributedSampler(data, shuffle=False) if world > 1 else None  # type: ignore[arg-type]
        return DataLoader(data, batch_size=self.batch_size, sampler=sampler)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def by_hand(outputs: list[tuple[Tensor, Tensor]], sigmoid: bool = False) -> dict[str, Any]:
    """The figures of one router over the calls whose ``(logits, experts)`` are given, written out from their
    definitions (``lightning_stability/moe/load.py``'s table), in float64."""
    logits = torch.cat([lg.detach().reshape(-1, lg.shape[-1]) for lg, _ in outputs]).double()
    experts = torch.cat([ex.reshape(-1) for _, ex in outputs])
    counts = nn.functional.one_hot(experts, logits.shape[-1]).sum(dim=0).double()
    p = torch.sigmoid(logits) if sigmoid else torch.softmax(logits, dim=-1)
    p = p / p.sum(dim=-1, keepdim=True)
    entropy = -torch.where(p > 0, p * p.log(), torch.zeros_like(p)).sum(dim=-1)
    return {
        "load_share": (counts / counts.sum()).tolist(),
        "max_vio": float(counts.max() / counts.mean() - 1),
        "dead_experts": float((counts == 0).sum()),
        "entropy": float(entropy.mean()),
        "logit_max": float(logits.max()),
        "z_loss": float((torch.logsumexp(logits, dim=-1) ** 2).mean()),
    }
