"""The demo: one fragile training run, with a plain Trainer and with a preset, side by side.

The fragile run is a Post-LN character-level GPT (:mod:`lightning_stability.demo.model`) at a high learning rate
with no warmup, a configuration known to stall, plus one step whose loss is NaN (a corrupted batch, an
overflow). Both runs start from the same weights and see the same batches. The plain run gets Lightning's
defaults; the other is ``StableTrainer.from_preset(preset)``. Each run is judged by the same rule
(:func:`judge`), printed with the verdict.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.plugins import MixedPrecision
from torch.utils.data import DataLoader

from lightning_stability.demo.model import CharGPT, Corpus, CorpusWindows, load_corpus
from lightning_stability.ledger.step_ledger import Outcome, StepLedger
from lightning_stability.trainer import StableTrainer

BATCH, CONTEXT = 16, 64
DIVERGE_MARGIN = 1.0  # a loss above ln(V) + this is worse than guessing: diverged
STALL_MARGIN = 0.1  # a final loss above unigram - this has learned nothing beyond letter frequencies: stalled
#: CPU threads of the demo in all, split among its processes (at least 1 each), whatever the machine: fixed, because
#: a matmul's or a reduction's float sums are split among the threads, so their last bits follow the thread count,
#: and this fragile run grows those bits into different figures. One, because the model is tiny: a second thread
#: saves little on an idle machine, and where other work holds the cores each of its ops waits at a barrier for a
#: thread the scheduler parked, far more than a fair share (``benchmarks/demo_load.py``).
DEMO_THREADS = 1


@dataclass(frozen=True)
class Verdict:
    status: Literal["trained", "stalled", "diverged"]
    step: int | None  # where it diverged, or where a stalled run had its best loss
    final_loss: float  # mean over the last `window` steps (NaN when any of them is)
    detail: str


@dataclass
class DemoRun:
    name: str
    losses: list[float]  # the loss each optimizer step computed (before the injected NaN)
    skipped: int | None  # optimizer steps skipped (None: a plain Trainer does not count them)
    seconds: float
    log_dir: Path
    verdict: Verdict
    report: list[Path]  # the stability report's files (the preset run)


def judge(losses: list[float], corpus: Corpus) -> Verdict:
    """The rule both runs are judged by: diverged, stalled or trained."""
    window = max(1, len(losses) // 10)
    bound = corpus.uniform_loss + DIVERGE_MARGIN
    final = sum(losses[-window:]) / window if losses else math.nan
    for step, loss in enumerate(losses):
        if not math.isfinite(loss) or loss > bound:
            before = f"; best before: {min(losses[:step]):.3f}" if step else ""
            return Verdict("diverged", step, final, f"loss {loss:.3g} at step {step} (bound {bound:.2f}{before})")
    best = min(range(len(losses)), key=losses.__getitem__)
    if final > corpus.unigram_loss - STALL_MARGIN:
        detail = f"ends at {final:.3f}, no better than letter frequencies ({corpus.unigram_loss:.2f})"
        return Verdict("stalled", best, final, detail)
    return Verdict("trained", None, final, f"ends at {final:.3f} (letter frequencies: {corpus.unigram_loss:.2f})")


class _Losses(pl.Callback):
    """Keeps the loss of every step before the deliberate NaN in one preallocated tensor, read once at the end.

    (A growing list of per-step scalar tensors fragmented the host heap here: the RSS grew ~300 KB a step.)
    """

    def __init__(self) -> None:
        self.values = torch.empty(0)
        self.count = 0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.values = torch.full((trainer.max_steps,), math.nan, device=pl_module.device)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        assert isinstance(pl_module, CharGPT) and pl_module.clean_loss is not None
        self.values[self.count] = pl_module.clean_loss
        self.count += 1

    def host(self) -> list[float]:
        return [float(x) for x in self.values[: self.count].tolist()]


def run_demo(
    preset: str = "tiny",
    steps: int = 300,
    precision: str | None = None,
    devices: int = 1,
    out: str | Path = "lightning_stability_demo",
    compare: bool = True,
    nan_at_step: int | None = None,
    lr: float = 1e-2,
    seed: int = 0,
    progress_bar: bool = True,
    say: Callable[[str], None] = print,
) -> list[DemoRun]:
    """Train the fragile run bare (when ``compare``) and with ``preset``; return both, bare first.

    ``nan_at_step`` (default: 60% into the run; -1: none) is the step whose loss is made NaN.
    """
    corpus = load_corpus()
    out = Path(out)
    fault = int(0.6 * steps) if nan_at_step is None else nan_at_step
    common: dict[str, Any] = {
        "max_steps": steps,
        "max_epochs": 1,  # the data is one epoch of `steps` batches; without it the bar reads "Epoch 0/-2"
        "devices": devices,
        "log_every_n_steps": 10,
        "enable_checkpointing": False,
        "enable_model_summary": False,
        "enable_progress_bar": progress_bar,
    }
    if devices > 1:
        common["strategy"] = "ddp"  # on CPU: gloo, one process per device
    with repeatable(devices):
        runs = []
        for name in ("bare", preset) if compare else (preset,):
            pl.seed_everything(seed, verbose=False)
            model = CharGPT(corpus.vocab, context=CONTEXT, lr=lr, nan_at_step=fault if fault >= 0 else None)
            data = DataLoader(CorpusWindows(corpus, steps * BATCH * devices, CONTEXT, seed), batch_size=BATCH)
            losses = _Losses()
            logger = CSVLogger(out, name=name, version="")
            if name == "bare":
                trainer = pl.Trainer(logger=logger, callbacks=[losses], **common, **_bare_precision(precision))
            else:
                extra: dict[str, Any] = {"precision": precision} if precision else {}
                trainer = StableTrainer.from_preset(preset, logger=logger, callbacks=[losses], **common, **extra)
            say(f"\n[{name}] {_describe(trainer, name)}")
            started = time.perf_counter()
            trainer.fit(model, data)
            seconds = time.perf_counter() - started
            host = losses.host()
            skipped = None
            if name != "bare":
                counts = StepLedger.of(trainer).record_of().counts.tolist()
                skipped = int(sum(counts) - counts[Outcome.APPLIED])
            log_dir = Path(logger.log_dir)
            report = sorted(log_dir.glob("stability_report.*"))
            runs.append(DemoRun(name, host, skipped, seconds, log_dir, judge(host, corpus), report))
        if trainer.is_global_zero:
            _draw(runs, corpus, fault, out / "comparison.png")
    return runs


def _bare_precision(precision: str | None) -> dict[str, Any]:
    """What a user passes to a plain Trainer; fp16 on a CPU needs the scaler plugin, as on a GPU."""
    if precision in ("16-mixed", "16") and not torch.cuda.is_available():
        return {"plugins": [MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))]}
    return {"precision": precision} if precision else {}


def _describe(trainer: pl.Trainer, name: str) -> str:
    if name == "bare" and str(trainer.precision) == "16-mixed":
        return (
            "lightning.Trainer with fp16's GradScaler (it skips steps whose gradients overflow): no clipping, no warmup"
        )
    if name == "bare":
        return "lightning.Trainer with its defaults: no clipping, no warmup, no skip of bad steps"
    attached = trainer.callbacks  # type: ignore[attr-defined]
    names = [type(cb).__name__ for cb in attached if type(cb).__module__.startswith("lightning_stability")]
    callbacks = [name for name in names if not name.startswith("_")]
    return f"StableTrainer.from_preset({name!r}): " + ", ".join(callbacks)


def _draw(runs: list[DemoRun], corpus: Corpus, fault: int, path: Path) -> Path | None:
    """The runs' losses on one chart (matplotlib's object API; none without matplotlib)."""
    from lightning_stability.health.report import figure_class

    figure = figure_class()
    if figure is None:
        return None
    fig = figure(figsize=(8, 4.5))
    ax = fig.add_subplot()
    colours = {"bare": "tab:red"}
    for run in runs:
        label = f"{run.name}: {run.verdict.status}"
        ax.plot(run.losses, color=colours.get(run.name, "tab:blue"), linewidth=1, label=label)
        if run.verdict.status == "diverged" and run.verdict.step is not None:
            colour = colours.get(run.name, "tab:blue")
            ax.axvline(run.verdict.step, color=colour, linestyle=":", linewidth=1)
            ax.annotate(
                f" {run.name} diverged at step {run.verdict.step}",
                (run.verdict.step, (corpus.uniform_loss + corpus.unigram_loss) / 2),
                color=colour,
                fontsize=9,
            )
    ax.axhline(corpus.unigram_loss, color="gray", linestyle="--", linewidth=1, label="letter frequencies (unigram)")
    ax.axhline(corpus.uniform_loss, color="gray", linestyle=":", linewidth=1, label="uniform guess")
    if fault >= 0:
        ax.axvline(fault, color="black", alpha=0.3, linewidth=6, label=f"NaN loss injected (step {fault})")
    finite = [x for run in runs for x in run.losses if math.isfinite(x)]
    ax.set_ylim(min(finite, default=0.0) - 0.2, corpus.uniform_loss + DIVERGE_MARGIN + 0.3)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss (nats per character)")
    ax.set_title("The same fragile run: plain Trainer vs preset")
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


def demo_threads(devices: int = 1) -> int:
    """CPU threads of each of the demo's processes: :data:`DEMO_THREADS` split among ``devices``."""
    return max(1, DEMO_THREADS // devices)


@contextmanager
def repeatable(devices: int = 1) -> Iterator[None]:
    """The same figures on every run on one machine: fixed CPU threads, torch's deterministic algorithms.

    :func:`demo_threads` threads per process (``OMP_NUM_THREADS`` too: Lightning's DDP launcher would otherwise set
    cores // processes, and the processes it starts inherit it); ``torch.use_deterministic_algorithms(True,
    warn_only=True)`` with cuBLAS's fixed workspace and no cuDNN benchmark (what ``Trainer(deterministic="warn")``
    sets, for a GPU; on a CPU the demo's ops are deterministic already, at no cost). All restored after. The
    weights and batches are seeded per run (``--seed``); the model has no dropout and the data no workers.
    """
    threads = demo_threads(devices)
    saved_env = {key: os.environ.get(key) for key in ("OMP_NUM_THREADS", "CUBLAS_WORKSPACE_CONFIG")}
    saved = torch.get_num_threads(), torch.backends.cudnn.benchmark
    saved_deterministic = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    os.environ["OMP_NUM_THREADS"] = str(threads)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.set_num_threads(threads)
    torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        torch.set_num_threads(saved[0])
        torch.backends.cudnn.benchmark = saved[1]
        torch.use_deterministic_algorithms(saved_deterministic[0], warn_only=saved_deterministic[1])


@contextmanager
def quiet_lightning() -> Iterator[None]:
    """Lightning's info banners (devices found, tips) turned down while the demo runs."""
    logger = logging.getLogger("lightning.pytorch")
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)
