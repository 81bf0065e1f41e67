"""The precursors' hooks and per-step math inside a real Lightning fit: no host sync added to any step."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader

from lightning_stability.precursors import AttentionLogits, LogPartition, adam_eps_share
from tests.helpers import count_syncs_per_step, quiet_trainer


class TinyLM(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(12, 16)
        self.block = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True, norm_first=True)
        self.lm_head = nn.Linear(16, 12)

    def forward(self, tokens: Tensor) -> Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1])
        return self.lm_head(self.block(self.embed(tokens), src_mask=mask, is_causal=True))

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        logits = self(batch[:, :-1])
        return nn.functional.cross_entropy(logits.reshape(-1, 12), batch[:, 1:].reshape(-1))

    def train_dataloader(self) -> DataLoader[Tensor]:
        return DataLoader(torch.randint(12, (32, 9), generator=torch.Generator().manual_seed(0)), batch_size=4)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class Precursors(pl.Callback):
    """Reads every precursor each step, keeping device tensors only (what the ledger adapter will queue)."""

    def __init__(self, module: TinyLM) -> None:
        self.attention, self.log_z = AttentionLogits(module), LogPartition(module)
        self.rows: list[Tensor] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, *args: Any) -> None:
        z = self.log_z.end_step()
        assert z is not None
        share = adam_eps_share(trainer.optimizers[0], list(pl_module.parameters()))
        self.rows.append(torch.cat([self.attention.per_layer(), torch.stack(z), share.reshape(1)]))
        self.attention.reset()


def test_the_precursors_add_no_host_sync_to_any_step() -> None:
    torch.manual_seed(0)
    bare = count_syncs_per_step(quiet_trainer(max_steps=6), TinyLM())
    torch.manual_seed(0)
    module = TinyLM()
    precursors = Precursors(module)
    watched = count_syncs_per_step(quiet_trainer(max_steps=6, callbacks=[precursors]), module)
    assert watched == bare
    assert len(precursors.rows) == 6 and all(bool(torch.isfinite(r).all()) for r in precursors.rows)
