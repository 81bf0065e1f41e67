"""Benchmark: does the "gpt" preset cost anything where a careful plain Trainer already trains well?

Models nobody here wrote, built from tiny configs of Hugging Face ``transformers``: GPT-2 (``GPT2LMHeadModel``),
Llama (``LlamaForCausalLM``), BERT with a masked-LM head (``BertForMaskedLM``; 15% of the characters masked, the
masks drawn per batch from a fixed seed, the held-out masks fixed), and an MoE (``Qwen2MoeForCausalLM``, 4 experts,
2 per token), each 2 layers wide 64 with 4 heads, on the demo's character-level corpus (102 symbols; the first 90%
for training, the last 10% held out). AdamW (weight decay 0.01), ``--steps`` updates of ``--batch`` windows of
``--context`` characters, the same data order and initial weights in every arm.

Arms, each over an LR grid (``--lrs``):

* **plain** -- a careful plain Lightning user: ``Trainer(gradient_clip_val=0.5)`` and the same warmup-constant-cosine
  shape the preset uses (5% warmup, cosine to 0 over the last 20%), as a ``LambdaLR`` stepped every update;
* **preset** -- ``StableTrainer.from_preset("gpt", precision="32-true")`` as shipped (clip 0.5, the schedule,
  ``TrainingHealthMonitor(skip_on="loss")``, ``PrecursorMonitor``'s LR back-off);
* **preset-backoff** -- the same with ``lr_backoff=None``: what the back-off itself does.

Printed per family and arm: the held-out loss after 60 updates and at the end, at each LR, and the verdict at the LR
where the plain arm ends best: the preset's final held-out loss minus the plain arm's (no harm: <= +0.01 nats).

Run: ``python -m benchmarks.no_harm`` (3 LRs x 3 arms x 4 families, ~10 minutes on 2 cores);
``--quick``: 2 LRs, 30 updates, two families (a smoke run, seconds).
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import platform
import tempfile
import time
import warnings
from datetime import datetime, timezone
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.utils.data import DataLoader

from lightning_stability import StableTrainer, WarmupConstantCosineSchedule
from lightning_stability.demo.model import Corpus, CorpusWindows, load_corpus

FAMILIES = ("gpt2", "llama", "bert-mlm", "qwen2-moe")
ARMS = ("plain", "preset", "preset-backoff")
EARLY = 60  # the held-out loss is also read after this many updates
EVAL_WINDOWS, EVAL_SEED, MASK = 128, 10**6, 0.15


def build(family: str, vocab: int, context: int) -> torch.nn.Module:
    import transformers

    common: dict[str, Any] = dict(vocab_size=vocab + 1)  # + [MASK]
    if family == "gpt2":
        config: Any = transformers.GPT2Config(
            n_layer=2, n_embd=64, n_head=4, n_positions=context, bos_token_id=None, eos_token_id=None, **common
        )
        return transformers.GPT2LMHeadModel(config)
    small = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256, **common)
    if family == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(max_position_embeddings=context, **small))
    if family == "bert-mlm":
        return transformers.BertForMaskedLM(transformers.BertConfig(max_position_embeddings=context, **small))
    if family == "qwen2-moe":
        config = transformers.Qwen2MoeConfig(
            max_position_embeddings=context,
            num_key_value_heads=4,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=128,
            shared_expert_intermediate_size=128,
            **small,
        )
        return transformers.Qwen2MoeForCausalLM(config)
    raise ValueError(f"family={family!r}: pass one of {', '.join(FAMILIES)}")


def loss_of(model: torch.nn.Module, family: str, batch: Tensor, seed: int, vocab: int) -> Tensor:
    """The model's own loss: next-character for the causal LMs, masked characters for BERT."""
    tokens = batch[:, :-1]
    if family != "bert-mlm":
        return model(input_ids=tokens, labels=tokens).loss
    generator = torch.Generator().manual_seed(seed)
    masked = torch.rand(tokens.shape, generator=generator) < MASK
    labels = torch.where(masked, tokens, torch.full_like(tokens, -100))
    return model(input_ids=torch.where(masked, torch.full_like(tokens, vocab), tokens), labels=labels).loss


class HFModule(pl.LightningModule):
    def __init__(self, family: str, vocab: int, context: int, lr: float, plain_schedule: int | None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = build(family, vocab, context)
        self.family, self.vocab, self.lr, self.plain_schedule = family, vocab, lr, plain_schedule

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        return loss_of(self.model, self.family, batch, batch_idx, self.vocab)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)
        if self.plain_schedule is None:
            return optimizer
        shape = WarmupConstantCosineSchedule(warmup=0.05, decay=0.20, min_lr_ratio=0.0)
        total = self.plain_schedule
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda n: shape(min(n, total), total))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class HeldOut(pl.Callback):
    """The held-out loss after ``EARLY`` updates (and, read by the caller, at the end)."""

    def __init__(self, batch: Tensor) -> None:
        self.batch, self.early = batch, math.nan

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, *args: Any) -> None:
        if trainer.global_step == EARLY:
            self.early = evaluate(pl_module, self.batch)


def evaluate(module: HFModule, batch: Tensor) -> float:
    with torch.no_grad():
        module.model.eval()
        loss = float(loss_of(module.model, module.family, batch, EVAL_SEED, module.vocab))
        module.model.train()
    return loss if math.isfinite(loss) else math.nan


def split(corpus: Corpus, start: float, end: float) -> Corpus:
    n = len(corpus.tokens)
    return Corpus(corpus.tokens[int(start * n) : int(end * n)], corpus.vocab, corpus.uniform_loss, corpus.unigram_loss)


def run(
    family: str, arm: str, lr: float, args: argparse.Namespace, corpus: Corpus, held: Tensor
) -> tuple[float, float]:
    data = DataLoader(CorpusWindows(split(corpus, 0.0, 0.9), args.steps * args.batch, args.context, 0), args.batch)
    module = HFModule(family, corpus.vocab, args.context, lr, args.steps if arm == "plain" else None)
    early = HeldOut(held)
    common: dict[str, Any] = dict(
        accelerator="cpu",
        max_steps=args.steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        callbacks=[early],
    )
    with tempfile.TemporaryDirectory() as root:
        if arm == "plain":
            trainer = pl.Trainer(gradient_clip_val=0.5, default_root_dir=root, **common)
        else:
            extra = {"lr_backoff": None} if arm == "preset-backoff" else {}
            trainer = StableTrainer.from_preset(
                "gpt", precision="32-true", checkpoint=False, watchdog=False, default_root_dir=root, **common, **extra
            )
            for callback in trainer.callbacks:  # type: ignore[attr-defined]
                if hasattr(callback, "report"):
                    callback.report = False
        trainer.fit(module, data)
    return early.early, evaluate(module, held)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", nargs="+", choices=FAMILIES, default=list(FAMILIES))
    parser.add_argument("--lrs", nargs="+", type=float, default=[1e-3, 3e-3, 1e-2])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="2 LRs, 30 updates, GPT-2 and BERT: a smoke run")
    args = parser.parse_args()
    if args.quick:
        args.lrs, args.steps, args.families = [1e-3, 1e-2], 30, ["gpt2", "bert-mlm"]
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    import transformers

    transformers.logging.set_verbosity_error()
    corpus = load_corpus()
    windows = CorpusWindows(split(corpus, 0.9, 1.0), EVAL_WINDOWS, args.context, EVAL_SEED)
    held = torch.stack([windows[i] for i in range(len(windows))])
    started = time.perf_counter()
    print(
        f"{datetime.now(timezone.utc):%a %b %d %H:%M UTC %Y}; {os.cpu_count()} CPUs ({platform.machine()}), load "
        f"average {os.getloadavg()[0]:.1f} at the start; torch {torch.__version__}, lightning {pl.__version__}, "
        f"{args.threads} torch thread(s); {args.steps} updates of {args.batch} x {args.context} characters"
    )
    print("held-out loss (nats) after 60 updates / at the end, per LR")
    verdicts = []
    for family in args.families:
        results: dict[str, dict[float, tuple[float, float]]] = {}
        for arm in ARMS:
            results[arm] = {lr: run(family, arm, lr, args, corpus, held) for lr in args.lrs}
            cells = "  ".join(f"{lr:g}: {a:.3f} / {b:.3f}" for lr, (a, b) in results[arm].items())
            print(f"{family:<10} {arm:<15} {cells}")
        finals = {lr: b for lr, (_, b) in results["plain"].items() if math.isfinite(b)}
        best = min(finals, key=finals.__getitem__)
        for arm in ("preset", "preset-backoff"):
            delta = results[arm][best][1] - results["plain"][best][1]
            early = results[arm][best][0] - results["plain"][best][0]
            verdicts.append(
                f"  {family} {arm}: at plain's best LR {best:g}, final {delta:+.3f} nats "
                f"({'no harm' if delta <= 0.01 else 'HARM'}), after {EARLY} updates {early:+.3f}"
            )
    print("verdict (the arm's held-out loss minus plain's; no harm: final <= +0.01)")
    print("\n".join(verdicts))
    print(f"wall time of the whole benchmark: {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
