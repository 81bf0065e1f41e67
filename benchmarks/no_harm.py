"""Benchmark: does a preset cost anything where a plain or a careful Trainer already trains well?

Models nobody here wrote, built from tiny configs of Hugging Face ``transformers``: GPT-2 (``GPT2LMHeadModel``),
Llama (``LlamaForCausalLM``), BERT with a masked-LM head (``BertForMaskedLM``; 15% of the characters masked, the
masks drawn per batch from a fixed seed, the held-out masks fixed), and two MoEs: Qwen2-MoE
(``Qwen2MoeForCausalLM``, 4 experts, 2 per token, a shared expert) and Mixtral (``MixtralForCausalLM``, 4 experts,
2 per token); each 2 layers wide 64 with 4 heads, on the demo's character-level corpus (102 symbols; the first 90%
for training, the last 10% held out). AdamW (weight decay 0.01), ``--steps`` updates of ``--batch`` windows of
``--context`` characters, the same data order and initial weights in every arm.

Arms, each over an LR grid (``--lrs``); ``clip`` is the preset's norm (0.5 for the dense models' ``gpt`` preset,
2.0 for the MoEs' ``moe`` preset):

* **plain** -- a plain Lightning user: ``Trainer(gradient_clip_val=clip)``, a constant LR;
* **careful** -- a careful one: the same with the preset's LR shape (5% linear warmup, constant, cosine to 0 over
  the last 20%) as a ``LambdaLR`` stepped every update;
* **preset** -- ``StableTrainer.from_preset("gpt")`` (``"moe"`` for the MoEs) with ``precision="32-true"``, as
  shipped (the clip, the schedule, ``TrainingHealthMonitor(skip_on="loss")``, ``PrecursorMonitor``'s LR back-off,
  and the ``moe`` preset's ``RouterHealthMonitor``);
* **preset-backoff** -- the same with ``lr_backoff=None``: what the back-off itself does.

Printed per family and arm: the held-out loss after 60 updates and at the end, at each LR; then the verdicts (no
harm: <= +0.01 nats): at the LR where the plain arm ends best, the preset's held-out loss minus plain's, after 60
updates and at the end; at every LR where the careful arm trains (final held-out loss finite and below the corpus's
unigram loss), the preset's final held-out loss minus careful's.

Run: ``python -m benchmarks.no_harm`` (3 LRs x 4 arms x 5 families); ``--quick``: 2 LRs, 30 updates, two families
(a smoke run, seconds).
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
from lightning_stability.presets import get_preset

FAMILIES = ("gpt2", "llama", "bert-mlm", "qwen2-moe", "mixtral")
MOES = ("qwen2-moe", "mixtral")
ARMS = ("plain", "careful", "preset", "preset-backoff")
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
    if family == "mixtral":
        config = transformers.MixtralConfig(
            max_position_embeddings=context, num_key_value_heads=4, num_local_experts=4, num_experts_per_tok=2, **small
        )
        return transformers.MixtralForCausalLM(config)
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
    module = HFModule(family, corpus.vocab, args.context, lr, args.steps if arm == "careful" else None)
    preset = "moe" if family in MOES else "gpt"
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
        if arm in ("plain", "careful"):
            clip = get_preset(preset).max_norm
            trainer = pl.Trainer(gradient_clip_val=clip, default_root_dir=root, **common)
        else:
            extra = {"lr_backoff": None} if arm == "preset-backoff" else {}
            trainer = StableTrainer.from_preset(
                preset, precision="32-true", checkpoint=False, watchdog=False, default_root_dir=root, **common, **extra
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
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
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
        for arm in args.arms:
            results[arm] = {lr: run(family, arm, lr, args, corpus, held) for lr in args.lrs}
            cells = "  ".join(f"{lr:g}: {a:.3f} / {b:.3f}" for lr, (a, b) in results[arm].items())
            print(f"{family:<10} {arm:<15} {cells}")
        if not {"plain", "careful"} <= set(results):
            continue  # the verdicts need both references
        finals = {lr: b for lr, (_, b) in results["plain"].items() if math.isfinite(b)}
        best = min(finals, key=finals.__getitem__)
        for arm in [a for a in ("preset", "preset-backoff") if a in results]:
            delta = results[arm][best][1] - results["plain"][best][1]
            early = results[arm][best][0] - results["plain"][best][0]
            harm = "no harm" if delta <= 0.01 and early <= 0.01 else "HARM"
            verdicts.append(
                f"  {family} {arm}: at plain's best LR {best:g}, final {delta:+.3f} nats, after {EARLY} updates "
                f"{early:+.3f} ({harm})"
            )
            trained = [lr for lr, (_, b) in results["careful"].items() if b < corpus.unigram_loss]
            deltas = {lr: results[arm][lr][1] - results["careful"][lr][1] for lr in trained}
            worst = max(deltas.values(), default=math.nan)
            cells = ", ".join(f"{lr:g}: {d:+.3f}" for lr, d in deltas.items())
            verdicts.append(
                f"  {family} {arm}: against careful at every LR it trains ({cells}): worst {worst:+.3f} "
                f"({'no harm' if worst <= 0.01 else 'HARM'})"
            )
    print("verdicts (the arm's held-out loss minus plain's or careful's; no harm: <= +0.01 nats)")
    print("\n".join(verdicts))
    print(f"wall time of the whole benchmark: {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
