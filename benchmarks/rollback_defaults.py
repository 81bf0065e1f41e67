"""Benchmark: ``StableTrainer.from_preset("gpt", health="rollback")`` with every default, on issue 22's case.

A Hugging Face GPT-2 with a tiny config (2 layers, 2 heads, width 64, 64 positions, 256 token ids, of which the
corpus uses 102) learns the demo's corpus (this package's source text, ``lightning_stability/demo/corpus.txt.gz``)
for ``--steps`` optimizer steps (batch 16 x 64 tokens, AdamW at 3e-3), on the CPU in fp32. Every run starts from the
same weights and sees the same batches. Scenarios:

* ``clean``  -- no fault (the reference);
* ``spike``  -- at step ``--at`` the loss (hence the gradient) is multiplied by 100: one bad batch;
* ``damage`` -- before step ``--at`` every weight gets Gaussian noise of 3 times its tensor's standard deviation:
  damage that got into the weights without a spike of its own (the next steps spike on the damaged weights).

Each runs with the preset's defaults and with PaLM's fixed ``snapshot_every=100, skip_batches=200`` (the defaults
before they were scaled to the run). Prints, per run: the held-out loss (mean cross-entropy over 64 fixed held-out
windows of the corpus's last 10%), its ratio to the clean run's, the updates applied, and the rollbacks.

Run: ``python -m benchmarks.rollback_defaults [--steps 200] [--at 120]``.
"""

from __future__ import annotations

import argparse
import logging
import warnings
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_stability import StableTrainer, StepLedger, TrainingHealthMonitor
from lightning_stability.demo.model import load_corpus

SEQ, BATCH, VOCAB = 64, 16, 256
DAMAGE = 3.0  # the noise added to every weight, in units of its tensor's standard deviation


def windows(ids: torch.Tensor, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(ids) - SEQ - 1, (n,), generator=g)
    return torch.stack([ids[s : s + SEQ] for s in starts.tolist()])


class TinyGPT2(pl.LightningModule):
    def __init__(self, fault: str, at: int) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(
            vocab_size=VOCAB, n_positions=SEQ, n_embd=64, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0
        )
        self.model = GPT2LMHeadModel(config)
        self.fault, self.at = fault, at

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.fault == "damage" and self.global_step == self.at:
            g = torch.Generator().manual_seed(1)
            with torch.no_grad():
                for p in self.model.parameters():
                    p.add_(torch.randn(p.shape, generator=g) * DAMAGE * (p.std() if p.numel() > 1 else 1.0))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        loss = self.model(input_ids=x, labels=x).loss
        return loss * 100 if self.fault == "spike" and self.global_step == self.at else loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def held_out_loss(module: TinyGPT2, data: torch.Tensor) -> float:
    module.eval()
    with torch.no_grad():
        return float(module.model(input_ids=data, labels=data).loss)


def run(fault: str, fixed: bool, train: torch.Tensor, held_out: torch.Tensor, args: argparse.Namespace) -> dict:
    pl.seed_everything(0, verbose=False)
    module = TinyGPT2(fault, args.at)
    trainer = StableTrainer.from_preset(
        "gpt",
        health="rollback",
        accelerator="cpu",
        devices=1,
        precision="32-true",
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=args.root,
    )
    if fixed:  # the preset's monitor, with PaLM's fixed numbers instead of the scaled defaults
        fixed_monitor = TrainingHealthMonitor(response="rollback", snapshot_every=100, skip_batches=200)
        trainer.callbacks = [  # type: ignore[attr-defined]
            fixed_monitor if isinstance(cb, TrainingHealthMonitor) else cb
            for cb in trainer.callbacks  # type: ignore[attr-defined]
        ]
    loader = DataLoader(TensorDataset(train), batch_size=BATCH, shuffle=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, loader)
    counts = StepLedger.of(trainer).record_of().counts.tolist()
    rollbacks = trainer.callback_metrics.get("stability/rollbacks")
    return {
        "loss": held_out_loss(module, held_out),
        "applied": int(counts[0]),
        "rollbacks": None if rollbacks is None else int(rollbacks),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--at", type=int, default=120)
    parser.add_argument("--root", default="/tmp/rollback_defaults")
    args = parser.parse_args()
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    ids = load_corpus().tokens
    split = int(len(ids) * 0.9)
    train, held_out = windows(ids[:split], args.steps * BATCH, 0), windows(ids[split:], 64, 1)
    clean = run("clean", False, train, held_out, args)
    print(f"{'scenario':<8} {'defaults':<22} {'held-out':>9} {'vs clean':>9} {'applied':>8} {'rollbacks':>9}")
    print(
        f"{'clean':<8} {'scaled to the run':<22} {clean['loss']:>9.4f} {1.0:>9.3f} {clean['applied']:>8} "
        f"{clean['rollbacks']!s:>9}"
    )
    for fault in ("spike", "damage"):
        for fixed in (False, True):
            r = run(fault, fixed, train, held_out, args)
            name = "fixed 100 / 200" if fixed else "scaled to the run"
            print(
                f"{fault:<8} {name:<22} {r['loss']:>9.4f} {r['loss'] / clean['loss']:>9.3f} {r['applied']:>8} "
                f"{r['rollbacks']!s:>9}"
            )


if __name__ == "__main__":
    main()
