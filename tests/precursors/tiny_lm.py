"""A tiny pre-LN language model for PrecursorMonitor's tests: one ``nn.TransformerEncoderLayer`` and an LM head."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, DistributedSampler

VOCAB, WIDTH, LENGTH = 12, 16, 9


class TinyLM(pl.LightningModule):
    """One pre-LN encoder layer with a causal mask and an LM head. ``spikes`` maps a step to a factor on that
    step's loss (a spike the health monitor sees). ``bias=False``: the layer without biases (the key bias gets an
    exactly-zero gradient, whose rounding noise Adam blows up to LR-sized steps that differ between any two
    summation orders: what a comparison across world sizes must leave out)."""

    def __init__(
        self,
        lr: float = 1e-2,
        weight_decay: float = 0.0,
        batches: int = 8,
        batch_size: int = 4,
        bias: bool = True,
        **optimizer: Any,
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.block = nn.TransformerEncoderLayer(WIDTH, 2, 32, dropout=0.0, batch_first=True, norm_first=True, bias=bias)
        self.lm_head = nn.Linear(WIDTH, VOCAB)
        self.lr, self.weight_decay, self.batches, self.optimizer_kwargs = lr, weight_decay, batches, optimizer
        self.batch_size = batch_size  # per process: a fit on N processes takes batches of N * batch_size
        self.spikes: dict[int, float] = {}

    def forward(self, tokens: Tensor) -> Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1])
        return self.lm_head(self.block(self.embed(tokens), src_mask=mask, is_causal=True))

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        logits = self(batch[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
        return loss * self.spikes.get(self.trainer.global_step, 1.0)

    def train_dataloader(self) -> DataLoader[Tensor]:
        data = torch.randint(VOCAB, (4 * self.batches, LENGTH), generator=torch.Generator().manual_seed(0))
        # in order, split across ranks (Lightning's own sampler would shuffle): on N processes with batches of
        # 4 / N, step k sees the 4 sequences one process sees at step k with batches of 4
        sampler = None
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            sampler = DistributedSampler(data, shuffle=False)  # type: ignore[arg-type]
        return DataLoader(data, batch_size=self.batch_size, sampler=sampler)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=self.weight_decay, **self.optimizer_kwargs)


def fresh(seed: int = 0, **kwargs: Any) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM(**kwargs)


#: the Hugging Face families the attention hooks know, each built tiny by :func:`hf_config`
HF_FAMILIES = ("bert", "gpt2", "llama", "mistral", "qwen2", "qwen3")


def hf_config(family: str, layers: int = 2) -> Any:
    """A tiny Hugging Face config: width 32, 4 heads (grouped-query: 2 key heads, Mistral 1), a vocabulary of 50."""
    import transformers

    if family == "gpt2":
        return transformers.GPT2Config(n_layer=layers, n_embd=32, n_head=4, vocab_size=50, n_positions=16)
    common: dict[str, Any] = dict(num_hidden_layers=layers, hidden_size=32, num_attention_heads=4, intermediate_size=64)
    if family == "bert":
        return transformers.BertConfig(vocab_size=50, **common)
    kv_heads = 1 if family == "mistral" else 2
    config = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config"}
    extra = {"head_dim": 8} if family == "qwen3" else {}
    return getattr(transformers, config[family])(vocab_size=50, num_key_value_heads=kv_heads, **common, **extra)
