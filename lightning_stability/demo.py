"""The demo: a small transformer language model trained with the stability callbacks on CPU or GPU.

The task is synthetic and needs no download: continue a sequence of tokens drawn from a fixed random
bigram table. One step gets a NaN loss on purpose, so the demo shows a step being skipped without
harming the weights, and the loss still falls.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_stability.callbacks.grad_norm import GradientNormMonitor
from lightning_stability.callbacks.lr_schedule import WarmupConstantCosineLR
from lightning_stability.ledger import Outcome, StepLedger


class BigramSequences(Dataset):
    """Token sequences sampled from a fixed random bigram distribution (deterministic per index)."""

    def __init__(self, vocab: int = 64, length: int = 32, size: int = 2048, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        logits = torch.randn(vocab, vocab, generator=g) * 3.0
        self.table = torch.softmax(logits, dim=-1)
        self.vocab, self.length, self.size, self.seed = vocab, length, size, seed

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        tokens = [int(torch.randint(self.vocab, (1,), generator=g))]
        for _ in range(self.length):
            tokens.append(int(torch.multinomial(self.table[tokens[-1]], 1, generator=g)))
        return torch.tensor(tokens)


class TinyGPT(pl.LightningModule):
    """A decoder-only transformer of a few layers: an ordinary LightningModule, nothing stability-specific."""

    def __init__(
        self,
        vocab: int = 64,
        d_model: int = 64,
        layers: int = 2,
        heads: int = 4,
        lr: float = 3e-3,
        nan_at_step: int = -1,
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.zeros(1, 64, d_model))
        block = nn.TransformerEncoderLayer(d_model, heads, 4 * d_model, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, vocab)
        self.lr = lr
        self.nan_at_step = nan_at_step
        self.losses: list[float] = []

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=tokens.device)
        h = self.blocks(self.embed(tokens) + self.pos[:, :t], mask=mask, is_causal=True)
        return self.head(h)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        logits = self(batch[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        self.losses.append(float(loss.detach()))  # the demo's own record; a real run would self.log it
        if self.global_step == self.nan_at_step:
            loss = loss * float("nan")  # a deliberately broken step
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)


@dataclass
class DemoResult:
    steps: int
    applied: int
    skipped_nonfinite: int
    first_loss: float
    last_loss: float
    weights_finite: bool
    grad_norms: list[float] = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)


class _Trace(pl.Callback):
    """Records the gradient norm and the LR each update used (the demo prints them)."""

    def __init__(self) -> None:
        self.norms: list[Any] = []
        self.lrs: list[float] = []

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self.norms.append(StepLedger.of(trainer).record.get("grad_norm"))
        self.lrs.append(float(optimizer.param_groups[0]["lr"]))


def run_demo(
    steps: int = 60, max_norm: float = 1.0, nan_at_step: int = 20, batch_size: int = 16, seed: int = 0
) -> DemoResult:
    """Train :class:`TinyGPT` for ``steps`` optimizer steps with the stability callbacks; return a summary."""
    pl.seed_everything(seed, verbose=False)
    model = TinyGPT(nan_at_step=nan_at_step)
    data = DataLoader(BigramSequences(seed=seed), batch_size=batch_size, shuffle=True)
    trace = _Trace()
    trainer = pl.Trainer(
        max_steps=steps,
        accelerator="auto",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[GradientNormMonitor(max_norm=max_norm), WarmupConstantCosineLR(warmup=0.1, decay=0.3), trace],
    )
    trainer.fit(model, data)
    ledger = StepLedger.of(trainer)
    counts = ledger.counts.tolist()
    window = max(1, min(10, steps // 4))
    finite_losses = [x for x in model.losses if math.isfinite(x)]
    return DemoResult(
        steps=ledger.steps,
        applied=counts[Outcome.APPLIED],
        skipped_nonfinite=counts[Outcome.SKIPPED_NONFINITE],
        first_loss=sum(finite_losses[:window]) / window,
        last_loss=sum(finite_losses[-window:]) / window,
        weights_finite=all(bool(torch.isfinite(p).all()) for p in model.parameters()),
        grad_norms=[float(n) for n in trace.norms if n is not None],
        lrs=trace.lrs,
    )
