"""A tiny GPT-style LightningModule and helpers shared by the FSDP tests and their torchrun scripts."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import Logger
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

VOCAB, SEQ = 32, 8


def token_data(n: int = 80, seed: int = 0) -> TensorDataset:
    """Sequences ``x[t+1] = (a * x[t] + b) % VOCAB`` with one random step in four: learnable, not trivial."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, VOCAB, (n, 1), generator=g)
    a = torch.randint(1, 4, (n, 1), generator=g)
    seq = [start]
    for _ in range(SEQ):
        nxt = (a * seq[-1] + 3) % VOCAB
        noise = torch.randint(0, VOCAB, (n, 1), generator=g)
        seq.append(torch.where(torch.rand(n, 1, generator=g) < 0.25, noise, nxt))
    tokens = torch.cat(seq, dim=1)
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        # no bias: the key bias gets an exactly-zero gradient (softmax ignores it), whose rounding noise
        # Adam would blow up to learning-rate-sized steps that differ between any two summation orders
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.calls = 0  # forward executions, recomputation included

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, d: int = 16, layers: int = 2, heads: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d)
        self.pos = nn.Parameter(0.02 * torch.randn(1, SEQ, d))
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx) + self.pos[:, : idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class TinyLM(pl.LightningModule):
    """Next-token prediction on :func:`token_data`; records each step's local loss."""

    def __init__(
        self, d: int = 16, layers: int = 2, batch_size: int = 8, n: int = 80, lr: float = 3e-3, fused: bool = False
    ) -> None:
        super().__init__()
        self.model = TinyGPT(d, layers)
        self.batch_size = batch_size
        self.n = n
        self.lr = lr
        self.fused = fused
        self.losses: list[torch.Tensor] = []
        self.inject_inf_at: tuple[int, int] | None = None  # (global_step, rank): inf in that rank's shard

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), y.reshape(-1))
        self.losses.append(loss.detach().clone())
        return loss

    def on_after_backward(self) -> None:
        if self.inject_inf_at is not None and self.inject_inf_at == (self.global_step, self.global_rank):
            grad = self.model.head.weight.grad
            local = grad.to_local() if hasattr(grad, "to_local") else grad
            if local.numel():
                local.view(-1)[0] = float("inf")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01, fused=self.fused or None)

    def train_dataloader(self) -> DataLoader:
        # In order, split across ranks like DistributedSampler(shuffle=False): at any world size W with
        # batch_size = G / W, step k sees the same global batch of G sequences (Lightning's own sampler
        # would shuffle the training data).
        data = token_data(self.n)
        sampler = None
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            sampler = DistributedSampler(data, shuffle=False)
        return DataLoader(data, batch_size=self.batch_size, sampler=sampler, shuffle=False)


class SelfShardingLM(TinyLM):
    """Shards itself in ``configure_model``: the whole TinyGPT as one FSDP unit on the strategy's mesh."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import FSDPModule, fully_shard

        if not isinstance(self.model, FSDPModule):
            fully_shard(self.model, mesh=self.device_mesh)


class ListLogger(Logger):
    """Keeps every logged metric in memory: ``history[key] = [(step, value), ...]``."""

    def __init__(self) -> None:
        super().__init__()
        self.history: dict[str, list[tuple[int, float]]] = {}

    @property
    def name(self) -> str:
        return "list"

    @property
    def version(self) -> str:
        return "0"

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        for key, value in metrics.items():
            self.history.setdefault(key, []).append((int(step or 0), float(value)))


def full_weights(module: nn.Module) -> dict[str, torch.Tensor]:
    """Whole fp32 weights of a possibly sharded module (every rank must call; rank 0 gets them)."""
    from torch.distributed.tensor import DTensor

    return {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().float().cpu().clone()
        for name, p in module.named_parameters()
    }
