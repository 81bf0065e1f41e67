"""The demo's data and model: a character-level GPT on an embedded corpus, with no download.

The corpus is this package's own source text (every ``.py`` file under ``lightning_stability/``, about half a
megabyte), so it ships with the package. Two reference losses say how well a run did: ``uniform`` (guessing
every character alike, ``ln V``) and ``unigram`` (guessing by character frequency, the entropy of the
corpus's letter counts). A model that ends no better than ``unigram`` has learned nothing about the text.
"""

from __future__ import annotations

import gzip
import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import Dataset


@dataclass(frozen=True)
class Corpus:
    tokens: torch.Tensor  # int64 character ids
    vocab: int
    uniform_loss: float
    unigram_loss: float


#: The demo's text: this package's Python source as of 2026-12-04, frozen, so that the demo's numbers do not move
#: with every edit of the code (they did while the corpus was read from the installed source).
CORPUS_FILE = Path(__file__).with_name("corpus.txt.gz")


@lru_cache(maxsize=1)
def load_corpus() -> Corpus:
    """The demo's corpus (:data:`CORPUS_FILE`) as character ids, with the two reference losses."""
    with gzip.open(CORPUS_FILE, "rt", encoding="utf-8") as f:
        text = f.read()
    alphabet = sorted(set(text))
    index = {ch: i for i, ch in enumerate(alphabet)}
    tokens = torch.tensor([index[ch] for ch in text], dtype=torch.long)
    freq = torch.bincount(tokens, minlength=len(alphabet)).double()
    freq = freq[freq > 0] / freq.sum()
    return Corpus(tokens, len(alphabet), math.log(len(alphabet)), float(-(freq * freq.log()).sum()))


class CorpusWindows(Dataset[torch.Tensor]):
    """``size`` windows of ``length + 1`` characters at fixed pseudo-random offsets (the same for every run)."""

    def __init__(self, corpus: Corpus, size: int, length: int = 64, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.tokens, self.length = corpus.tokens, length
        self.starts = torch.randint(len(corpus.tokens) - length - 1, (size,), generator=generator)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, index: int) -> torch.Tensor:
        start = int(self.starts[index])
        return self.tokens[start : start + self.length + 1]


class CharGPT(pl.LightningModule):
    """A small decoder-only transformer: an ordinary LightningModule, nothing stability-specific in it.

    ``post_ln=True`` puts LayerNorm after each residual block (the original Transformer), which is known to need
    a warmup at high learning rates; ``nan_at_step`` makes one training step's loss NaN on purpose, the way a
    corrupted batch or an overflow would.
    """

    def __init__(
        self,
        vocab: int,
        d_model: int = 64,
        layers: int = 4,
        heads: int = 4,
        context: int = 64,
        lr: float = 1e-2,
        post_ln: bool = True,
        nan_at_step: int | None = None,
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.zeros(1, context, d_model))
        block = nn.TransformerEncoderLayer(
            d_model, heads, 4 * d_model, dropout=0.0, batch_first=True, norm_first=not post_ln
        )
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, vocab)
        self.lr, self.nan_at_step = lr, nan_at_step
        self.clean_loss: torch.Tensor | None = None  # this step's loss before the deliberate NaN (detached)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(length, device=tokens.device)
        return self.head(self.blocks(self.embed(tokens) + self.pos[:, :length], mask=mask, is_causal=True))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        logits = self(batch[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        self.clean_loss = loss.detach()
        if self.trainer.global_step == self.nan_at_step:
            loss = loss * float("nan")
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)
