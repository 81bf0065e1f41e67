"""Benchmark: how much the final loss of a pre-LN transformer LM depends on its learning rate, per arm.

The figure of merit of Wortsman et al. 2023 ("Small-scale proxies for large-scale Transformer training
instabilities", arXiv 2309.14322): train the same small model over a log-spaced LR grid; the **LR sensitivity** is
the mean over the grid of min(final loss, initial loss) minus the best final loss of the grid
(``benchmarks.scores``). Arms, each over every LR and seed with the same data and initial
weights per seed:

* **bare** -- a plain ``lightning.pytorch.Trainer``: the model's AdamW at the grid's LR, no callbacks of the package.
* **careful** -- what a careful Lightning user sets without the package: ``Trainer(gradient_clip_val=0.5)`` (the
  "gpt" preset's ``max_norm``) and the preset's LR shape (5% linear warmup, constant, cosine to 0 over the last 20%)
  as a ``LambdaLR`` the module returns, stepped every optimizer step.
* **preset** -- the "gpt" preset without its early action: ``StableTrainer.from_preset("gpt", precision="32-true",
  lr_backoff=None)``: ``GradientNormMonitor(max_norm=0.5)``, ``WarmupConstantCosineLR`` (5% warmup, constant, cosine
  to 0 over the last 20%), ``TrainingHealthMonitor(response="skip", skip_on="loss")`` (the preset's own: a loss
  spike or a non-finite value skips, a gradient-norm spike alone is clipped and applied); the same optimizer and LR
  (only the callbacks differ). The "gpt" preset is the one for GPT-like decoders; fp32 because bf16 autocast on a
  CPU would change the arithmetic, not the callbacks. ``checkpoint=False``, ``watchdog=False`` and no end-of-fit
  report: they do not touch training.
* **preset+early** -- the "gpt" preset as shipped: the above plus its ``PrecursorMonitor(lr_backoff=LRBackoff(
  "update_ratio", 0.02))`` (``lightning_stability.precursors``): while the update's norm exceeds 2% of the
  weights' norm (measured every 4th step), the next updates' LR backs off (x0.5 per measurement past it; back
  up x1.02 per update once under, floor 0.01).
* **preset+early+qk** -- the same plus Kimi K2's QK-clip (``qk_clip=100.0``: tau 100, alpha 0.5), in a
  ``PrecursorMonitor`` of its own in place of the preset's.

The task: a character-level LM on the demo's corpus (``lightning_stability.demo.model``: this package's frozen
source text, 102 symbols), the first 90% of the text for training (``--batch`` random windows of ``--context``
characters per step), the last 10% for evaluation (``EVAL_WINDOWS`` fixed windows). The model: token and learned
position embeddings, ``--layers`` ``nn.TransformerEncoderLayer(norm_first=True)`` blocks (pre-LN; width
``--width``, 4 heads, feed-forward 4x, no dropout) with a causal mask, a final LayerNorm, a linear head; torch's
default initialisation, or with ``--init gpt2`` GPT-2's (every weight N(0, 0.02), biases 0: smaller weights, so a
larger update-to-weight ratio at one LR). AdamW (weight decay 0.01, torch's other defaults), ``--steps`` steps.

Figures, per arm:

* ``LR sens.``: the LR sensitivity above. A run's final loss is its evaluation loss after training; the initial
  loss the evaluation loss of the untrained model (mean over seeds, ~ln 102 = 4.62); per LR, the mean over seeds
  of min(final, initial), a NaN/inf final loss counting as the initial loss.
* ``best``: the lowest of those per-LR means.
* ``max LR trained``: the largest LR of the grid at which **every seed trains**: its final loss is finite and
  below the held-out **bigram loss** (about 2.54 nats: a character-bigram model counted on the training text, with
  add-one smoothing, scored on the evaluation windows; the best a model can do that looks at the previous
  character only, so a run above it is not using its context; attention-entropy collapse at a high LR ends
  there). The column ``< unigram`` gives the same with the looser unigram loss (3.31 nats: each character by
  its frequency alone) as the bar. ``none`` when no LR trains.
* ``spike score``: OLMo 2's, on each run's training loss: the share of steps more than 6 standard deviations above
  the rolling mean of the 50 steps before (``--spike-window``; OLMo 2 rolls over 1,000 steps of far longer
  runs), the mean over the arm's runs.
* ``skipped``: the share of the arm's updates not applied (batches trained minus AdamW's own step counter, pooled
  over every run of the arm; no fault is injected in this benchmark, so every skip is a false alarm or a
  genuine divergence).

Run: ``python -m benchmarks.lr_sensitivity`` (6 LRs x 3 seeds x 5 arms = 90 runs, ~10 s each on a 2-core machine
with a load average of 3, so about 15 minutes),
``--quick`` for a smoke run (2 LRs, 1 seed, a tiny model: seconds). ``--help`` lists every option.
"""

from __future__ import annotations

import argparse
import logging
import math
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader

from benchmarks.scores import best_final_loss, lr_sensitivity, max_trainable_lr, spike_score
from lightning_stability import (
    StableTrainer,
    TrainingDivergedError,
    TrainingHealthMonitor,
    WarmupConstantCosineSchedule,
)
from lightning_stability.demo.model import Corpus, CorpusWindows, load_corpus
from lightning_stability.precursors.callback import LRBackoff, PrecursorMonitor
from lightning_stability.presets import get_preset

#: 1e-3 to 3e-1, six log-spaced points (ratio 300 ** (1/5) ~ 3.13).
LRS = tuple(float(f"{1e-3 * 300 ** (k / 5):.3g}") for k in range(6))
EVAL_WINDOWS, EVAL_SEED, HEADS = 256, 10**6, 4


# ---------------------------------------------------------------------------------------------- the model
class PreLNLM(pl.LightningModule):
    """A decoder-only pre-LN transformer LM; nothing stability-specific in it."""

    def __init__(
        self,
        vocab: int,
        width: int,
        layers: int,
        context: int,
        lr: float,
        init: str = "torch",
        schedule_steps: int | None = None,
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.pos = nn.Parameter(torch.zeros(1, context, width))
        block = nn.TransformerEncoderLayer(width, HEADS, 4 * width, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, norm=nn.LayerNorm(width), enable_nested_tensor=False)
        self.head = nn.Linear(width, vocab)
        self.lr, self.schedule_steps = lr, schedule_steps
        if init == "gpt2":  # GPT-2's: every weight N(0, 0.02), biases 0 (torch's defaults are wider)
            for name, p in self.named_parameters():
                if p.dim() > 1 and name != "pos":
                    nn.init.normal_(p, 0.0, 0.02)
                elif name.endswith("bias"):
                    nn.init.zeros_(p)

    def forward(self, tokens: Tensor) -> Tensor:
        length = tokens.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(length, device=tokens.device)
        return self.head(self.blocks(self.embed(tokens) + self.pos[:, :length], mask=mask, is_causal=True))

    def loss(self, batch: Tensor) -> Tensor:
        logits = self(batch[:, :-1])
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        return self.loss(batch)

    def configure_optimizers(self) -> Any:
        """AdamW; with ``schedule_steps``, also the "gpt" preset's LR shape over that many steps, as a ``LambdaLR``."""
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)
        if self.schedule_steps is None:
            return optimizer
        gpt = get_preset("gpt")
        shape = WarmupConstantCosineSchedule(warmup=gpt.warmup, decay=gpt.decay, min_lr_ratio=gpt.min_lr_ratio)
        total = self.schedule_steps
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda n: shape(min(n, total), total))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class Recorder(pl.Callback):
    """Every training loss, kept on the device and read once after fit."""

    def __init__(self) -> None:
        self.losses: list[Tensor] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, *_: Any) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(loss.detach().float())


# ---------------------------------------------------------------------------------------------- the data
def split(corpus: Corpus, start: float, end: float) -> Corpus:
    """The share ``[start, end)`` of the corpus's text, with the whole corpus's reference losses."""
    n = len(corpus.tokens)
    return Corpus(corpus.tokens[int(start * n) : int(end * n)], corpus.vocab, corpus.uniform_loss, corpus.unigram_loss)


# ---------------------------------------------------------------------------------------------- the arms
def bare_trainer(common: dict[str, Any]) -> pl.Trainer:
    return pl.Trainer(**common)


def careful_trainer(common: dict[str, Any]) -> pl.Trainer:
    """Lightning's own clipping at the "gpt" preset's norm; the schedule is the module's (:data:`OWN_SCHEDULE`)."""
    return pl.Trainer(gradient_clip_val=get_preset("gpt").max_norm, **common)


def preset_trainer(common: dict[str, Any], **overrides: Any) -> pl.Trainer:
    """The "gpt" preset without its early action (``lr_backoff=None``); ``overrides``: other preset fields."""
    trainer = StableTrainer.from_preset(
        "gpt", precision="32-true", checkpoint=False, watchdog=False, **{"lr_backoff": None, **overrides}, **common
    )
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        if isinstance(callback, TrainingHealthMonitor):
            callback.report = False  # the end-of-fit report files: no effect on training
    return trainer


def preset_early_trainer(common: dict[str, Any]) -> pl.Trainer:
    """The "gpt" preset as shipped: its own ``PrecursorMonitor`` backs the update off past an update ratio of 0.02."""
    return preset_trainer(common, lr_backoff=get_preset("gpt").lr_backoff)


def preset_early_qk_trainer(common: dict[str, Any]) -> pl.Trainer:
    """The preset's back-off and Kimi K2's QK-clip (tau 100, alpha 0.5), in one ``PrecursorMonitor`` of this arm's."""
    monitor = PrecursorMonitor(qk_clip=100.0, lr_backoff=LRBackoff("update_ratio", 0.02))
    return preset_trainer({**common, "callbacks": [*common["callbacks"], monitor]})


#: Each arm's Trainer factory.
ARMS: dict[str, Callable[[dict[str, Any]], pl.Trainer]] = {
    "bare": bare_trainer,
    "careful": careful_trainer,
    "preset": preset_trainer,
    "preset+early": preset_early_trainer,
    "preset+early+qk": preset_early_qk_trainer,
}
#: the arms whose module returns its own LR scheduler
OWN_SCHEDULE = frozenset({"careful"})


@dataclass
class Run:
    initial: float  # evaluation loss before training
    final: float  # after training (inf: stopped by TrainingDivergedError)
    losses: list[float]  # training loss of every batch
    skipped: int  # batches whose update was not applied


@dataclass
class Arm:
    name: str
    runs: dict[float, list[Run]] = field(default_factory=dict)  # per LR, one per seed


def applied_updates(optimizer: torch.optim.Optimizer) -> int:
    """AdamW's own step counter: the updates actually applied (a skipped step leaves it unchanged)."""
    return max((int(s["step"]) for s in optimizer.state.values() if "step" in s), default=0)


def evaluate(model: PreLNLM, batch: Tensor) -> float:
    with torch.no_grad():
        model.eval()
        loss = model.loss(batch).item()
        model.train()
    return loss


def run_once(
    arm: str,
    lr: float,
    seed: int,
    train: Corpus,
    eval_batch: Tensor,
    args: argparse.Namespace,
    root: str,
) -> Run:
    """Train one seed at one LR in one arm; the same initial weights and batches in every arm."""
    pl.seed_everything(seed, verbose=False)
    schedule = args.steps if arm in OWN_SCHEDULE else None
    model = PreLNLM(train.vocab, args.width, args.layers, args.context, lr, args.init, schedule)
    initial = evaluate(model, eval_batch)
    data = DataLoader(CorpusWindows(train, args.steps * args.batch, args.context, seed), batch_size=args.batch)
    recorder = Recorder()
    common: dict[str, Any] = dict(
        accelerator="cpu",
        devices=1,
        max_steps=args.steps,
        max_epochs=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=root,
        callbacks=[recorder],
    )
    trainer = ARMS[arm](common)
    try:
        trainer.fit(model, data)
        final = evaluate(model, eval_batch)
    except TrainingDivergedError:
        final = math.inf
    losses = torch.stack(recorder.losses).tolist() if recorder.losses else []
    skipped = len(losses) - applied_updates(trainer.optimizers[0])
    return Run(initial, final, losses, skipped)


# ---------------------------------------------------------------------------------------------- the report
def bigram_loss(train: Corpus, eval_batch: Tensor) -> float:
    """The held-out loss of a character-bigram model counted on ``train`` (add-one smoothing) on ``eval_batch``."""
    tokens = torch.as_tensor(train.tokens, dtype=torch.int64)
    counts = torch.ones(train.vocab, train.vocab)
    counts.index_put_((tokens[:-1], tokens[1:]), torch.ones(len(tokens) - 1), accumulate=True)
    log_p = (counts / counts.sum(dim=1, keepdim=True)).log()
    return float(-log_p[eval_batch[:, :-1], eval_batch[:, 1:]].mean())


def summarize(arm: Arm, threshold: float, spike_window: int, unigram: float = math.inf) -> dict[str, Any]:
    """The arm's figures (see the module's docstring)."""
    lrs = sorted(arm.runs)
    finals = [[r.final for r in arm.runs[lr]] for lr in lrs]
    runs = [r for lr in lrs for r in arm.runs[lr]]
    initial = sum(r.initial for r in runs) / len(runs)
    batches = sum(len(r.losses) for r in runs)
    return {
        "initial": initial,
        "sensitivity": lr_sensitivity(finals, initial),
        "best": best_final_loss(finals, initial),
        "max_lr": max_trainable_lr(lrs, finals, threshold),
        "max_lr_unigram": max_trainable_lr(lrs, finals, unigram),
        "spike_score": sum(spike_score(r.losses, spike_window) for r in runs) / len(runs),
        "skipped": sum(r.skipped for r in runs) / batches if batches else 0.0,
        "per_lr": {lr: [r.final for r in arm.runs[lr]] for lr in lrs},
    }


def table(arms: Sequence[Arm], args: argparse.Namespace, threshold: float, unigram: float) -> list[str]:
    lines = [
        f"LR sensitivity, pre-LN LM (width {args.width}, {args.layers} layers, {args.init} init, context "
        f"{args.context}, batch {args.batch}, {args.steps} steps), {args.seeds} seed(s) per arm and LR, LRs "
        f"{', '.join(map(str, args.lrs))}",
        f"trains: every seed's final eval loss finite and < {threshold:.3f} (held-out bigram loss; < unigram: "
        f"{unigram:.3f}); spike score: share of steps > 6 std above the rolling mean of the {args.spike_window} before",
        "",
        f"{'arm':<16}{'LR sens.':>10}{'best':>8}{'max LR trained':>16}{'< unigram':>11}{'spike score':>13}"
        f"{'skipped':>10}",
    ]
    per_lr: list[str] = []
    initials: list[float] = []
    for arm in arms:
        s = summarize(arm, threshold, args.spike_window, unigram)
        initials.append(s["initial"])
        max_lr = "none" if s["max_lr"] is None else f"{s['max_lr']:g}"
        loose = "none" if s["max_lr_unigram"] is None else f"{s['max_lr_unigram']:g}"
        lines.append(
            f"{arm.name:<16}{s['sensitivity']:>10.3f}{s['best']:>8.3f}{max_lr:>16}{loose:>11}{s['spike_score']:>13.4f}"
            f"{s['skipped']:>10.2%}"
        )
        for lr, finals in s["per_lr"].items():
            shown = " ".join(f"{x:.3f}" if math.isfinite(x) else "nan/inf" for x in finals)
            per_lr.append(f"{arm.name:<16}{lr:>8g}   {shown}")
    if not per_lr:
        return lines
    return [*lines, "", f"final eval loss per seed (initial loss {min(initials):.3f}-{max(initials):.3f}):", *per_lr]


def main(argv: list[str] | None = None) -> dict[str, dict[str, Any]]:
    """Run the sweep, print the table; return each built arm's figures."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--lrs", default=",".join(map(str, LRS)), help=f"the LR grid, comma-separated (default {LRS})")
    add("--seeds", type=int, default=3, help="seeds per arm and LR (3)")
    add("--first-seed", type=int, default=0, help="the first seed (0): --first-seed 3 runs seeds 3, 4, 5")
    add("--steps", type=int, default=300, help="optimizer steps per run (300)")
    add("--width", type=int, default=64, help="model width (64)")
    add("--layers", type=int, default=4, help="transformer blocks (4)")
    add("--context", type=int, default=64, help="characters per training window (64)")
    add("--batch", type=int, default=16, help="windows per batch (16)")
    add("--spike-window", type=int, default=50, help="spike score: steps of the rolling mean (50)")
    add("--arms", default=",".join(ARMS), help=f"arms to run, comma-separated (default {','.join(ARMS)})")
    add("--threads", type=int, default=1, help="torch CPU threads (1)")
    add("--init", choices=("torch", "gpt2"), default="torch", help="weights: torch's defaults, or GPT-2's N(0, 0.02)")
    add("--quick", action="store_true", help="smoke run: LRs 1e-3,3e-1, 1 seed, 30 steps, width 32, context 32")
    args = parser.parse_args(argv)
    if args.quick:
        args.lrs, args.seeds, args.steps, args.width, args.context, args.spike_window = "1e-3,3e-1", 1, 30, 32, 32, 10
    try:
        args.lrs = [float(x) for x in str(args.lrs).split(",")]
    except ValueError:
        parser.error(f"--lrs must be numbers separated by commas, got {args.lrs!r}")
    names = [a for a in str(args.arms).split(",") if a]
    unknown = sorted(set(names) - set(ARMS))
    if unknown:
        parser.error(f"--arms: unknown arm(s) {unknown}; choose from {', '.join(ARMS)}")
    torch.set_num_threads(args.threads)
    for name in ("lightning.pytorch", "lightning.fabric", "lightning_stability"):
        logging.getLogger(name).setLevel(logging.ERROR)

    corpus = load_corpus()
    train = split(corpus, 0.0, 0.9)
    held_out = CorpusWindows(split(corpus, 0.9, 1.0), EVAL_WINDOWS, args.context, EVAL_SEED)
    eval_batch = torch.stack([held_out[i] for i in range(len(held_out))])
    arms = [Arm(name) for name in names]
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as root:
        for seed in range(
            args.first_seed, args.first_seed + args.seeds
        ):  # seeds outermost, arms back to back: drift on a shared machine hits all
            for lr in args.lrs:
                for arm in arms:
                    run = run_once(arm.name, lr, seed, train, eval_batch, args, root)
                    arm.runs.setdefault(lr, []).append(run)
    threshold, unigram = bigram_loss(train, eval_batch), corpus.unigram_loss
    for line in table(arms, args, threshold, unigram):
        print(line)
    print(f"\n({time.perf_counter() - started:.0f} s)")
    return {arm.name: summarize(arm, threshold, args.spike_window, unigram) for arm in arms if arm.runs}


if __name__ == "__main__":
    main()
