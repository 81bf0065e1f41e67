"""The runs of ``benchmarks.stability``: its tasks, models, the two arms and how a run is scored.

See ``benchmarks/stability.py`` for what is measured and why; this module trains and scores one run.
"""

from __future__ import annotations

import argparse
import math
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins import MixedPrecision
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from benchmarks.spikes import FIRST_POISON, TAIL, Batches, Regressor, make_data, teacher
from lightning_stability import LossScaleFloorError, StableTrainer, TrainingDivergedError, TrainingHealthMonitor

VOCAB, SEQ, WIDTH, HEADS, LM_BATCH, LM_EVAL = 32, 16, 32, 4, 16, 512
MLP_BATCH, MLP_EVAL = 64, 4096  # as benchmarks/spikes.py
TABLE_SEED, EVAL_SEED = 4321, 10**6


# ---------------------------------------------------------------------------------------------- the data
def bigram_table() -> Tensor:
    """The fixed next-token distribution of the language-model task (the same in every seed)."""
    g = torch.Generator().manual_seed(TABLE_SEED)
    return torch.softmax(torch.randn(VOCAB, VOCAB, generator=g) * 3.0, dim=-1)


def sequences(n: int, generator: torch.Generator) -> Tensor:
    """``n`` token sequences of ``SEQ + 1`` tokens: a uniform first token, then the bigram chain."""
    table = bigram_table()
    x = torch.empty(n, SEQ + 1, dtype=torch.long)
    x[:, 0] = torch.randint(VOCAB, (n,), generator=generator)
    for t in range(1, SEQ + 1):
        x[:, t] = torch.multinomial(table[x[:, t - 1]], 1, generator=generator).squeeze(1)
    return x


def bayes_loss(x: Tensor) -> float:
    """Cross-entropy of the true bigram distribution on ``x``: the floor no model can beat on it."""
    table = bigram_table()
    return -table[x[:, :-1], x[:, 1:]].log().mean().item()


class Sequences(Dataset[Tensor]):
    """Pre-built batches of sequences, served in order (one per optimizer step)."""

    def __init__(self, x: Tensor) -> None:
        self.x = x

    def __len__(self) -> int:
        return self.x.shape[0]

    def __getitem__(self, i: int) -> Tensor:
        return self.x[i]


# ---------------------------------------------------------------------------------------------- the models
class Recorder(pl.Callback):
    """Every training loss (device tensors, read after fit) and the training loop's wall time."""

    def __init__(self) -> None:
        self.losses: list[Tensor] = []
        self.start = self.end = 0.0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.start = self.end = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, *_: Any) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(loss.detach().float())
        self.end = time.perf_counter()


class LM(pl.LightningModule):
    """A decoder-only transformer LM: ``nn.TransformerEncoderLayer`` blocks with a causal mask.

    ``norm_first=False`` is the original Post-LN block (LayerNorm after each residual sum, no final norm);
    ``norm_first=True`` the Pre-LN block with a final LayerNorm.
    """

    def __init__(self, lr: float, layers: int, norm_first: bool) -> None:
        super().__init__()
        self.lr = lr
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Parameter(torch.randn(1, SEQ, WIDTH) * 0.02)
        block = nn.TransformerEncoderLayer(
            WIDTH, HEADS, 4 * WIDTH, dropout=0.0, batch_first=True, norm_first=norm_first
        )
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm: nn.Module = nn.LayerNorm(WIDTH) if norm_first else nn.Identity()
        self.head = nn.Linear(WIDTH, VOCAB)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(SEQ), persistent=False)

    def loss(self, batch: Tensor) -> Tensor:
        h = self.blocks(self.embed(batch[:, :-1]) + self.pos, mask=self.mask, is_causal=True)
        logits = self.head(self.norm(h)).float()
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        return self.loss(batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)


class MLP(Regressor):
    """benchmarks/spikes.py's regressor (32-128-128-1 GELU MLP, MSE, AdamW with weight decay 0.01)."""

    def loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)


# ---------------------------------------------------------------------------------------------- a configuration
@dataclass(frozen=True)
class Config:
    key: str
    label: str
    steps: int
    lr: float
    layers: int = 0  # LM only
    norm_first: bool = False
    init_scale: float | None = None  # fp16 with this initial loss scale; None: fp32
    preset_init_scale: float | str | None = None  # the preset's init_scale override (default: init_scale)
    poison: int = 0  # MLP only: poisoned batches per run
    factor: float = 1.0


@dataclass
class Task:
    """One seed's data for one configuration and the numbers its runs are scored against."""

    train: Dataset[Any]
    poisoned: frozenset[int]  # 0-based steps whose batch was poisoned (left out of the steps-to-target window)
    eval_batch: Any
    know_nothing: float  # uniform guess (LM) / constant prediction (MLP) on the evaluation set
    floor: float  # the evaluation set's irreducible loss (true bigram table / label noise)


@dataclass
class Run:
    final: float  # evaluation loss after training; inf when stopped by an error
    diverged: bool
    steps_to_target: int | None
    skipped: int  # batches whose update was not applied (loss scaler, non-finite or spike skips)
    fit_s: float  # trainer.fit, as the user waits for it (the preset's end-of-fit report included)
    loop_s: float  # first to last training batch
    stopped: str = ""  # the error that stopped training, if any


def lm_task(config: Config, seed: int, eval_set: Tensor) -> Task:
    g = torch.Generator().manual_seed(seed)
    x = sequences(config.steps * LM_BATCH, g).view(config.steps, LM_BATCH, SEQ + 1)
    return Task(Sequences(x), frozenset(), eval_set, math.log(VOCAB), bayes_loss(eval_set))


def mlp_task(config: Config, seed: int, eval_set: tuple[Tensor, Tensor]) -> Task:
    # the same draws as benchmarks/spikes.py: data first, then the poisoned positions
    g = torch.Generator().manual_seed(seed)
    x, y = make_data(config.steps * MLP_BATCH, g)
    x, y = x.view(config.steps, MLP_BATCH, -1).clone(), y.view(config.steps, MLP_BATCH, 1).clone()
    positions = FIRST_POISON + torch.randperm(config.steps - TAIL - FIRST_POISON, generator=g)[: config.poison]
    x[positions] *= config.factor
    y[positions] *= config.factor
    ex, ey = eval_set
    noise = nn.functional.mse_loss(teacher(ex), ey).item()
    return Task(Batches(x, y), frozenset(positions.tolist()), eval_set, ey.var().item(), noise)


def bound_of(task: Task, progress: float) -> float:
    """The loss that closes ``progress`` of the gap from the know-nothing loss to the floor."""
    return task.know_nothing - progress * (task.know_nothing - task.floor)


def steps_to_target(losses: Sequence[float], skip: frozenset[int], target: float, window: int) -> int | None:
    """First step (1-based) at which the mean training loss of the last ``window`` clean batches is <= target."""
    recent: deque[float] = deque(maxlen=window)
    for i, loss in enumerate(losses):
        if i in skip:
            continue
        recent.append(loss)
        if len(recent) == window and sum(recent) / window <= target:
            return i + 1
    return None


def applied_updates(optimizer: torch.optim.Optimizer) -> int:
    """AdamW's own step counter: updates actually applied (skipped steps leave it unchanged)."""
    steps = [int(s["step"]) for s in optimizer.state.values() if "step" in s]
    return max(steps, default=0)


def run_once(
    config: Config, preset: bool, seed: int, task: Task, args: argparse.Namespace, root: str, report: bool = True
) -> Run:
    """Train one seed of one configuration, bare or with the preset, then score it. ``report=False`` switches
    the preset's end-of-fit stability report off (runs whose time is not reported)."""
    pl.seed_everything(seed, verbose=False)  # the same initial weights in both arms
    model: LM | MLP = LM(config.lr, config.layers, config.norm_first) if config.key != "poison" else MLP(config.lr)
    recorder = Recorder()
    common: dict[str, Any] = dict(
        accelerator="cpu",
        devices=1,
        max_steps=config.steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=root,  # the preset's stability report goes here
        callbacks=[recorder],
    )
    trainer: pl.Trainer
    if preset:
        fp16: dict[str, Any] = {}
        if config.init_scale is not None:
            scale = config.init_scale if config.preset_init_scale is None else config.preset_init_scale
            fp16 = {"precision": "16-mixed", "init_scale": scale}
        trainer = StableTrainer.from_preset("tiny", **common, **fp16)
        for callback in trainer.callbacks:  # type: ignore[attr-defined]
            if isinstance(callback, TrainingHealthMonitor):
                callback.report = report
    elif config.init_scale is not None:  # on a CPU, precision="16-mixed" alone would become bf16
        scaler = torch.amp.GradScaler("cpu", init_scale=config.init_scale)
        trainer = pl.Trainer(**common, plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)])
    else:
        trainer = pl.Trainer(**common)
    stopped = ""
    start = time.perf_counter()
    try:
        trainer.fit(model, DataLoader(task.train, batch_size=None))
    except (TrainingDivergedError, LossScaleFloorError) as error:
        stopped = type(error).__name__
    fit_s = time.perf_counter() - start
    with torch.no_grad():
        model.eval()
        final = math.inf if stopped else model.loss(task.eval_batch).item()
    losses = torch.stack(recorder.losses).tolist() if recorder.losses else []
    bound, target = bound_of(task, args.diverged_below), bound_of(task, args.target)
    diverged = bool(stopped) or not math.isfinite(final) or final > bound
    reached = steps_to_target(losses, task.poisoned, target, args.window)
    skipped = len(losses) - applied_updates(trainer.optimizers[0])
    return Run(final, diverged, reached, skipped, fit_s, recorder.end - recorder.start, stopped)
