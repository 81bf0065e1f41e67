"""Benchmark: a batch that follows the measured critical batch against a fixed batch, at equal samples.

Issue 49's claim: at equal samples, ``BatchRamp`` reaches the fixed batch's final held-out loss (within +0.5%) with
at least 30% fewer optimizer steps, and is never more than 1% worse on any seed; the estimator costs at most 1% of
a step. Arms, per model family and seed, on the same data order, initial weights and base LR:

* **fixed** -- ``GradientAccumulation(steps=2, lr_scaling="sqrt")`` and ``WarmupConstantCosineLR()``: the starting
  batch throughout.
* **monitor** -- the same plus ``CriticalBatchMonitor()``: the estimator's cost (``time x fixed``), nothing else
  changes (its updates are bit-identical to fixed's).
* **ramp** -- ``GradientAccumulation(steps=2, lr_scaling="sqrt")``, ``BatchRamp(max_factor=--max-factor,
  fraction=--fraction, confidence=--confidence)`` (defaults: ``BatchRamp``'s) and the same schedule, which counts
  samples once the batch grew.

Every arm trains one epoch over the same ``--samples`` (equal samples), AdamW (lr ``--lr`` for one micro-batch of
``--micro`` samples, weight decay 0.01). Families (``--families``):

* ``mlp`` -- a 2-layer MLP (width 64) regressing a fixed random teacher MLP's output plus Gaussian noise (std 0.5)
  from 16 inputs; held-out MSE on 2,048 fresh samples.
* ``gpt2`` -- ``transformers``' ``GPT2LMHeadModel`` (2 layers, width 64, 4 heads, no dropout), a character LM on the
  demo's corpus (``lightning_stability.demo.model``: the first 90% for training windows of 64 characters, 256
  held-out windows from the last 10%); held-out cross-entropy.

**The offline check** (``--check``, the critical-batch literature's): the ramp arm of each family's first seed is
stopped after a quarter of its samples and checkpointed; from that checkpoint, short branches at
``--check-factors`` x the micro-batch train ``--check-samples`` samples each (plain PyTorch, the checkpoint's
optimizer state, LR by the square-root rule and beta2 by the half-life rule from the checkpoint's own), and the
held-out loss each gains is fitted to McCandlish et al.'s model of equal samples, ``gain(B) ~ 1 / (B + B_noise)``
(:func:`noise_scale_from_branches`). Beside it, the exact ``tr(Sigma) / |G|^2`` at the checkpoint's weights from
``--check-exact`` per-sample gradients (:func:`exact_noise_scale`): the estimator's own quantity, free of its
averaging over a moving run. Both are printed beside the figure the run had measured at the checkpoint. The branch
fit holds only while a branch's gain per step stays constant (short branches late in a run); where it and the exact
figure disagree, trust the exact one for the estimator, the branches for what the batch does to the loss.

``--quick``: the ``mlp`` family, one seed, 2,048 samples, the check included, and the ramp growing while the figure
is above the current batch (``--fraction 2 --confidence 0``, so that a run this short changes the batch): a smoke
test (seconds), not a result.
Nothing here is a timing benchmark: ``time x fixed`` is a ratio of two fits measured in the same run.
"""

from __future__ import annotations

import argparse
import copy
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from lightning_stability import BatchRamp, CriticalBatchMonitor, GradientAccumulation, WarmupConstantCosineLR
from lightning_stability.critical_batch.noise_scale import critical_batch
from lightning_stability.critical_batch.ramp import beta2_at

FAMILIES = ("mlp", "gpt2")
ARMS = ("fixed", "monitor", "ramp")
START_FACTOR = 2


# ---------------------------------------------------------------------------------------------- the offline check
def noise_scale_from_branches(batches: list[float], gains: list[float]) -> float:
    """``B_noise`` from the loss each branch gained over the same samples at batch ``B``: McCandlish et al.'s
    ``gain(B) = c / (B + B_noise)`` makes ``1 / gain`` linear in ``B`` (slope ``1/c``, intercept ``B_noise/c``); a
    least-squares line through the points gives ``B_noise = intercept / slope``. NaN when no branch gained or the
    line does not rise with ``B`` (the model does not hold there)."""
    points = [(b, 1.0 / g) for b, g in zip(batches, gains, strict=True) if g > 0]
    if len(points) < 2:
        return math.nan
    n = len(points)
    mean_b = sum(b for b, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    var = sum((b - mean_b) ** 2 for b, _ in points)
    slope = sum((b - mean_b) * (y - mean_y) for b, y in points) / var
    if slope <= 0:
        return math.nan
    return (mean_y - slope * mean_b) / slope


def exact_noise_scale(task: Task, net: nn.Module, samples: int, seed: int = 5) -> float:
    """``B_simple = tr(Sigma) / |G|^2`` at ``net``'s weights from ``samples`` per-sample gradients of the training
    set (one backward each): ``tr(Sigma)`` their summed variance, ``|G|^2`` the squared norm of their mean less
    ``tr(Sigma) / samples`` (unbiased). The estimator's own quantity, without its averaging over a moving run."""
    order = torch.randperm(len(task.train), generator=torch.Generator().manual_seed(seed))[:samples]  # type: ignore[arg-type]
    rows = []
    for i in order.tolist():
        item = task.train[i]
        batch = [t.unsqueeze(0) for t in item] if isinstance(item, list | tuple) else item.unsqueeze(0)
        net.zero_grad(set_to_none=True)
        task.loss(net, batch).backward()
        rows.append(torch.cat([p.grad.reshape(-1).double() for p in net.parameters() if p.grad is not None]))
    net.zero_grad(set_to_none=True)
    grads = torch.stack(rows)
    trace = grads.var(0).sum()
    g2 = grads.mean(0).pow(2).sum() - trace / len(rows)
    return float(trace / g2) if g2 > 0 else math.inf


# ---------------------------------------------------------------------------------------------- the families
@dataclass
class Task:
    model: nn.Module
    train: Dataset[Any]
    held_out: Any
    loss: Callable[[nn.Module, Any], Tensor]


def mlp_task(samples: int, seed: int) -> Task:
    gen = torch.Generator().manual_seed(1000 + seed)
    teacher = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
    with torch.no_grad():
        for p in teacher.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))

    def data(n: int) -> tuple[Tensor, Tensor]:
        x = torch.randn(n, 16, generator=gen)
        with torch.no_grad():
            return x, teacher(x) + 0.5 * torch.randn(n, 1, generator=gen)

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 1))

    def loss(net: nn.Module, batch: Any) -> Tensor:
        x, y = batch
        return nn.functional.mse_loss(net(x), y)

    return Task(model, TensorDataset(*data(samples)), data(2048), loss)


def gpt2_task(samples: int, seed: int) -> Task:
    from transformers import GPT2Config, GPT2LMHeadModel

    from lightning_stability.demo.model import CorpusWindows, load_corpus

    corpus = load_corpus()
    cut = int(0.9 * len(corpus.tokens))
    train = copy.copy(corpus)
    object.__setattr__(train, "tokens", corpus.tokens[:cut])
    held = copy.copy(corpus)
    object.__setattr__(held, "tokens", corpus.tokens[cut:])
    held_out = torch.stack([w for w in CorpusWindows(held, 256, 64, seed=99)])  # type: ignore[misc]
    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=corpus.vocab, n_positions=64, n_embd=64, n_layer=2, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    model = GPT2LMHeadModel(config)

    def loss(net: nn.Module, batch: Any) -> Tensor:
        tokens = batch[0] if isinstance(batch, list | tuple) else batch
        logits = net(input_ids=tokens[:, :-1]).logits
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))

    return Task(model, CorpusWindows(train, samples, 64, seed=seed), held_out, loss)


TASKS = {"mlp": mlp_task, "gpt2": gpt2_task}


class Module(pl.LightningModule):
    def __init__(self, task: Task, lr: float, micro: int, seed: int) -> None:
        super().__init__()
        self.net, self.task, self.lr, self.micro, self.seed = task.model, task, lr, micro, seed

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        return self.task.loss(self.net, batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)

    def train_dataloader(self) -> DataLoader[Any]:
        generator = torch.Generator().manual_seed(self.seed)
        return DataLoader(self.task.train, batch_size=self.micro, shuffle=True, generator=generator)


def held_out_loss(task: Task, net: nn.Module) -> float:
    with torch.no_grad():
        return float(task.loss(net, task.held_out))


# ---------------------------------------------------------------------------------------------- the runs
def callbacks_of(arm: str, args: argparse.Namespace) -> tuple[list[Any], Any]:
    accumulation = GradientAccumulation(steps=START_FACTOR, lr_scaling="sqrt")
    extra: Any = None
    if arm == "monitor":
        extra = CriticalBatchMonitor(log_every_n_steps=10)
    elif arm == "ramp":
        extra = BatchRamp(
            max_factor=args.max_factor, warmup_steps=20, fraction=args.fraction, confidence=args.confidence,
            log_every_n_steps=10,
        )  # fmt: skip
    return [accumulation, *([extra] if extra is not None else []), WarmupConstantCosineLR()], extra


class StopAt(pl.Callback):
    """Stops the fit at the first step boundary after ``micro_batches`` micro-batches, leaving the run's length (and
    so its LR schedule) as it was."""

    def __init__(self, micro_batches: int, accumulation: GradientAccumulation) -> None:
        self.micro_batches, self.accumulation = micro_batches, accumulation

    def on_train_batch_end(self, trainer: pl.Trainer, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx + 1 >= self.micro_batches and self.accumulation.micro_batch >= self.accumulation.window_size:
            trainer.should_stop = True


def run(family: str, seed: int, arm: str, args: argparse.Namespace, stop_at: int | None = None) -> dict[str, Any]:
    """One arm's fit (``stop_at``: stop after that many micro-batches, at a step boundary)."""
    pl.seed_everything(seed, verbose=False)
    task = TASKS[family](args.samples, seed)
    module = Module(task, args.lr, args.micro, seed)
    callbacks, extra = callbacks_of(arm, args)
    stop = [StopAt(stop_at, callbacks[0])] if stop_at is not None else []
    trainer = pl.Trainer(
        accelerator="cpu", max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[*callbacks, *stop],
    )  # fmt: skip
    start = time.perf_counter()
    trainer.fit(module)
    seconds = time.perf_counter() - start
    return {
        "loss": held_out_loss(task, module.net),
        "steps": trainer.global_step,
        "seconds": seconds,
        "factor": callbacks[0].factor,
        "critical_batch": getattr(extra, "critical_batch", math.nan),
        "trainer": trainer,
        "module": module,
    }


def offline_check(family: str, args: argparse.Namespace, directory: Path) -> dict[str, Any]:
    """Stop the ramp arm of seed 0 after a quarter of its samples, checkpoint it, branch from the checkpoint, fit
    ``B_noise``."""
    quarter = max(1, args.samples // args.micro // 4)
    half = run(family, 0, "ramp", args, stop_at=quarter)  # the LR schedule of the whole run
    path = directory / f"{family}-half.ckpt"
    half["trainer"].save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=False)
    measured = next(
        (float(v["critical_batch"]) for v in checkpoint["callbacks"].values() if "critical_batch" in v), math.nan
    )
    state = next(v["state"] for v in checkpoint["callbacks"].values() if "critical_batch" in v)
    averaged, averaged_stderr = (float(x) for x in critical_batch(torch.tensor(state)))
    factor_then = next((int(v["factor"]) for v in checkpoint["callbacks"].values() if "grown" in v), START_FACTOR)
    task = TASKS[family](args.samples, 0)
    base = Module(task, args.lr, args.micro, 0)
    base.load_state_dict(checkpoint["state_dict"])
    before = held_out_loss(task, base.net)
    exact = exact_noise_scale(task, base.net, args.check_exact)
    batches, gains = [], []
    for mult in args.check_factors:
        net = copy.deepcopy(base.net)
        optimizer = torch.optim.AdamW(net.parameters(), lr=args.lr, weight_decay=0.01)
        optimizer.load_state_dict(checkpoint["optimizer_states"][0])
        batch = mult * args.micro
        for group in optimizer.param_groups:  # the rules of a change, from the checkpoint's factor
            group["lr"] = group["lr"] * math.sqrt(mult / factor_then)
            group["betas"] = (group["betas"][0], beta2_at(group["betas"][1], mult, factor_then))
        loader = DataLoader(task.train, batch_size=batch, shuffle=True, generator=torch.Generator().manual_seed(7))
        seen = 0
        for data in loader:
            if seen >= args.check_samples:
                break
            optimizer.zero_grad(set_to_none=True)
            task.loss(net, data).backward()
            optimizer.step()
            seen += batch
        batches.append(float(batch))
        gains.append(before - held_out_loss(task, net))
    return {"measured": measured, "averaged": averaged, "averaged_stderr": averaged_stderr, "exact": exact,
            "fitted": noise_scale_from_branches(batches, gains), "batches": batches, "gains": gains,
            "at_step": half["steps"], "factor": factor_then}  # fmt: skip


# ---------------------------------------------------------------------------------------------- main
def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="mlp, one seed, 2,048 samples: a smoke test")
    parser.add_argument("--families", default="mlp,gpt2")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--samples", type=int, default=32768)
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--max-factor", type=int, default=32)
    parser.add_argument("--fraction", type=float, default=0.5, help="BatchRamp(fraction=)")
    parser.add_argument("--confidence", type=float, default=1.0, help="BatchRamp(confidence=)")
    parser.add_argument("--check", action="store_true", help="the offline check of the estimate (branches)")
    parser.add_argument("--check-factors", default="2,8,32")
    parser.add_argument("--check-samples", type=int, default=2048)
    parser.add_argument("--check-exact", type=int, default=512, help="per-sample gradients for the exact figure")
    parser.add_argument("--out", default="batch_ramp_out")
    args = parser.parse_args(argv)
    if args.quick:
        args.families, args.seeds, args.samples, args.check = "mlp", 1, 2048, True
        args.max_factor, args.check_samples, args.check_exact = 16, 512, 256
        args.fraction, args.confidence = 2.0, 0.0  # a rule that changes the batch this early: the smoke test takes one
    args.families = [f for f in args.families.split(",") if f]
    unknown = sorted(set(args.families) - set(FAMILIES))
    if unknown:
        parser.error(f"--families: unknown {unknown}; pick from {FAMILIES}")
    args.check_factors = [int(x) for x in args.check_factors.split(",")]
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse(argv)
    torch.set_num_threads(1)
    results: dict[str, Any] = {"runs": {}, "checks": {}}
    print(f"{'family':7} {'seed':>4} {'fixed loss':>11} {'ramp loss':>10} {'d loss':>7} {'fixed st':>8} "
          f"{'ramp st':>7} {'fewer':>6} {'factor':>6} {'B_crit':>8} {'monitor t':>9}")  # fmt: skip
    for family in args.families:
        for seed in range(args.seeds):
            arms = {arm: run(family, seed, arm, args) for arm in ARMS}
            fixed, ramp, monitor = arms["fixed"], arms["ramp"], arms["monitor"]
            row = {
                "fixed_loss": fixed["loss"],
                "ramp_loss": ramp["loss"],
                "loss_change": ramp["loss"] / fixed["loss"] - 1,
                "fixed_steps": fixed["steps"],
                "ramp_steps": ramp["steps"],
                "fewer_steps": 1 - ramp["steps"] / fixed["steps"],
                "final_factor": ramp["factor"],
                "critical_batch": ramp["critical_batch"],
                "monitor_time": monitor["seconds"] / fixed["seconds"],
                "monitor_same_loss": monitor["loss"] == fixed["loss"],
            }
            results["runs"][(family, seed)] = row
            print(f"{family:7} {seed:>4} {row['fixed_loss']:>11.5g} {row['ramp_loss']:>10.5g} "
                  f"{row['loss_change']:>+7.2%} {row['fixed_steps']:>8} {row['ramp_steps']:>7} "
                  f"{row['fewer_steps']:>6.0%} {row['final_factor']:>6} {row['critical_batch']:>8.4g} "
                  f"{row['monitor_time']:>9.3f}")  # fmt: skip
    rows = list(results["runs"].values())
    met = [r["loss_change"] <= 0.005 and r["fewer_steps"] >= 0.30 for r in rows]
    print(f"claim (<= +0.5% loss with >= 30% fewer steps): {sum(met)}/{len(rows)} runs; "
          f"worst loss change {max(r['loss_change'] for r in rows):+.2%} (bar: +1%)")  # fmt: skip
    if args.check:
        directory = Path(args.out)
        directory.mkdir(parents=True, exist_ok=True)
        print("\noffline check: branches from the ramp's checkpoint at a quarter of the run")
        for family in args.families:
            check = offline_check(family, args, directory)
            results["checks"][family] = check
            gains = ", ".join(f"B={b:g}: {g:+.4g}" for b, g in zip(check["batches"], check["gains"], strict=True))
            ratio = check["fitted"] / check["measured"] if check["measured"] > 0 else math.nan
            print(f"{family}: step {check['at_step']} (batch {check['factor'] * args.micro}), measured B_crit "
                  f"{check['measured']:.4g} (last read; averages now {check['averaged']:.4g} +- "
                  f"{check['averaged_stderr']:.2g}), exact from {args.check_exact} per-sample gradients "
                  f"{check['exact']:.4g}, fitted from the branches {check['fitted']:.4g} (x{ratio:.2g} the measured); "
                  f"held-out gains {gains}")  # fmt: skip
    return results


if __name__ == "__main__":
    main()
