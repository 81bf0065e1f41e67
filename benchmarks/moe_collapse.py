"""Benchmark: a small top-1 mixture of experts whose routing collapses under a plain Trainer, and what the router
actions of ``RouterHealthMonitor`` do to it.

The model: a Hugging Face OLMoE built from a tiny config (``--layers`` layers of width 32, ``--experts`` experts of
intermediate size ``--expert-size`` (8), **top-1**, ``norm_topk_prob=False`` so the chosen expert's output is
scaled by its softmax score and the router is trained by the loss, as in the Switch Transformer; **no auxiliary loss**:
``output_router_logits`` is off, so ``router_aux_loss_coef`` adds nothing). Each router starts **skewed**: after
the usual initialisation (N(0, 0.02)), expert 0's row of every router gets ``--skew * mu / |mu|^2``, where ``mu``
is the mean input of that router over 32 sequences of the data at initialisation, so expert 0's logit starts
``--skew`` above what it would be on the average token (8: about e^8 times the others' score on that token).

The data, ``--data keyed`` (the default): ``--clusters`` (8) tables on one ``--pool`` of 32 tokens. Each sequence
(16 tokens) begins with its cluster's marker token, then walks the pool by its cluster's own random permutation with
probability 0.9 (else to any token of the pool). The next token depends on the current token and the marker together
(8 x 32 entries), which the embeddings cannot hold and the attention alone cannot compute: the experts' hidden units
hold the tables, and 8 experts of 8 units hold more than one does. ``--data disjoint`` is the earlier case:
``--clusters`` disjoint parts of the 256-token vocabulary, each sequence in one part following its permutation, a
table the embeddings hold without the experts (so a collapse there costs no loss). Training: ``--steps`` (2000)
steps of AdamW (``--lr`` 1e-2, torch's other defaults), 8 sequences a step, clusters in turn; the held-out loss is
on 64 other sequences of the same clusters.

What makes it collapse: the skewed start plus top-1 routing with nothing that pulls the load back (no auxiliary
loss). On the keyed data a plain Trainer ends with nearly every token on one or two experts (MaxVio about 6.3 of
the 7 possible), the other experts dead; the loss's gradient does not pull it back. (Without the skew,
``--skew 0``, it collapses part of the way by itself: held-out MaxVio 1.77, the two busiest experts 56% of the
tokens, held-out loss 0.989 against 1.022 with the skew; 3 seeds.) A top-1 Mixtral would not do here: its router
normalizes the chosen expert's weight to 1, so the loss gives its router no gradient at all (only float rounding,
about 1e-11).

Arms, each over the same seeds (``--seeds``), each seed with the same initial weights and data in every arm:

* **plain**: a plain ``lightning.pytorch.Trainer`` (fp32, no callbacks of the package);
* **monitor**: the same with ``RouterHealthMonitor()`` (it observes only: its training loss is checked bit for bit
  equal to plain's at every step);
* **bias**: ``RouterHealthMonitor(balance_bias=1e-3)`` (the auxiliary-loss-free balancing bias, DeepSeek-V3's rate);
  **bias 1e-2**: ten times that rate;
* **z-loss**: ``RouterHealthMonitor(z_loss=1e-3)`` (ST-MoE's router z-loss coefficient);
* **bias+z**: both at 1e-3;
* **moe preset**: ``StableTrainer.from_preset("moe")`` as shipped (the bias and the z-loss at 1e-3, and the rest of
  the preset: clip 2.0, 5% warmup and a cosine over the last 20%, the health monitor skipping loss spikes, the LR
  back-off; its precision on this CPU printed), ``enable_checkpointing=False``;
* **preset, monitor only**: the same with ``router_balance_bias=None, router_z_loss=None``.

Figures, per arm (mean over seeds, and the range):

* ``MaxVio``: the monitor's ``stability/router/max_vio`` at the end (the largest over the layers, over the last
  logging window of ``--log-every`` steps); ``-`` for plain, which has no monitor (its routing is monitor's, which
  is bit-equal). Under the bias this windowed figure overstates the balance (benchmarks/README.md): read
  ``held MaxVio``;
* ``dead``: the monitor's ``stability/router/dead_experts`` at the end (summed over the layers);
* ``held MaxVio`` and ``top-2``: counted by hand on the held-out sequences after training (every arm, plain too;
  the model routes as trained, the bias included): the largest MaxVio over the layers, and the share of the
  tokens the two busiest experts of the worst layer take;
* ``train``: the mean training loss of the last 20 steps; ``held-out``: the loss on the held-out sequences;
  ``vs plain``: the held-out loss minus plain's on the same seed.

Run: ``python -m benchmarks.moe_collapse [--steps 2000] [--seeds 0 1 2] [--arms ...]`` (24 runs of about 20 s each
on one core); the earlier case: ``--data disjoint --clusters 4 --expert-size 64 --steps 300``; ``--quick`` for a
smoke run (seconds).
"""

from __future__ import annotations

import argparse
import logging
import shutil
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader

from lightning_stability import RouterHealthMonitor, StableTrainer

VOCAB, LENGTH, WIDTH, BATCH, HELD_OUT = 256, 16, 32, 8, 64
#: the arms: name -> RouterHealthMonitor's arguments (None: a plain Trainer)
ARMS: dict[str, dict[str, float] | None] = {
    "plain": None,
    "monitor": {},
    "bias": {"balance_bias": 1e-3},
    "bias 1e-2": {"balance_bias": 1e-2},
    "z-loss": {"z_loss": 1e-3},
    "bias+z": {"balance_bias": 1e-3, "z_loss": 1e-3},
}
#: the preset's arms: name -> overrides of ``StableTrainer.from_preset("moe", ...)``
PRESET_ARMS: dict[str, dict[str, Any]] = {
    "moe preset": {},
    "preset, monitor only": {"router_balance_bias": None, "router_z_loss": None},
}


def draws(clusters: int, tokens: int, count: int, seed: int) -> tuple[list[Tensor], Tensor, Tensor]:
    """Each cluster's permutation of ``tokens`` (fixed), and for ``count`` sequences by ``seed``: whether each
    position follows its cluster's permutation (probability 0.9), and the token drawn where it does not."""
    tables = torch.Generator().manual_seed(1234)
    perms = [torch.randperm(tokens, generator=tables) for _ in range(clusters)]
    g = torch.Generator().manual_seed(seed)
    follow = torch.rand(count, LENGTH, generator=g) < 0.9
    return perms, follow, torch.randint(tokens, (count, LENGTH), generator=g)


def clustered(clusters: int, count: int, seed: int) -> Tensor:
    """``count`` sequences, sequence ``i`` in cluster ``i % clusters``: each cluster's tokens follow its own random
    permutation with probability 0.9, else any token of the cluster (the permutations fixed, the draws by ``seed``)."""
    per = VOCAB // clusters
    perms, follow, anyone = draws(clusters, per, count, seed)
    out = torch.empty(count, LENGTH, dtype=torch.long)
    for i in range(count):
        cluster, token = i % clusters, int(anyone[i, 0])
        for j in range(LENGTH):
            out[i, j] = cluster * per + token
            token = int(perms[cluster][token]) if follow[i, j] else int(anyone[i, j])
    return out


def keyed(clusters: int, count: int, seed: int, pool: int = 32) -> Tensor:
    """``count`` sequences, sequence ``i`` in cluster ``i % clusters``: its cluster's marker token (``3 + c``), then
    tokens of a ``pool`` shared by every cluster (``3 + clusters`` on), each followed by the cluster's own random
    permutation of the pool with probability 0.9, else by any token of the pool (the permutations fixed, the draws
    by ``seed``). The next token depends on the token and on the marker together: a table of ``clusters x pool``
    entries that only the experts' hidden units can hold."""
    perms, follow, anyone = draws(clusters, pool, count, seed)
    out = torch.empty(count, LENGTH, dtype=torch.long)
    for i in range(count):
        cluster, token = i % clusters, int(anyone[i, 0])
        out[i, 0] = 3 + cluster
        for j in range(1, LENGTH):
            out[i, j] = 3 + clusters + token
            token = int(perms[cluster][token]) if follow[i, j] else int(anyone[i, j])
    return out


def data(args: argparse.Namespace, count: int, seed: int) -> Tensor:
    """``--data``'s sequences."""
    if args.data == "keyed":
        return keyed(args.clusters, count, seed, args.pool)
    return clustered(args.clusters, count, seed)


def gates(model: nn.Module) -> dict[str, nn.Module]:
    return {name: m for name, m in model.named_modules() if name.endswith("mlp.gate")}


def build(layers: int, experts: int, skew: float, probe: Tensor, expert_size: int = 64) -> nn.Module:
    """The top-1 OLMoE, each router skewed towards expert 0 on the mean input of ``probe``."""
    import transformers

    config = transformers.OlmoeConfig(
        vocab_size=VOCAB,
        hidden_size=WIDTH,
        intermediate_size=expert_size,  # each expert's (OLMoE has no dense MLP)
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=2,
        num_experts=experts,
        num_experts_per_tok=1,
        norm_topk_prob=False,
        output_router_logits=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = transformers.OlmoeForCausalLM(config)
    routers = gates(model)
    means: dict[str, Tensor] = {}
    handles = [
        m.register_forward_hook(lambda m, a, o, n=n: means.__setitem__(n, a[0].reshape(-1, WIDTH).mean(0)))
        for n, m in routers.items()
    ]
    with torch.no_grad():
        model(input_ids=probe)
        for handle in handles:
            handle.remove()
        for name, router in routers.items():
            mu = means[name]
            weight: Tensor = router.weight  # type: ignore[assignment]
            weight[0] += skew * mu / mu.dot(mu)
    return model


class CollapseLM(pl.LightningModule):
    def __init__(self, model: nn.Module, train: Tensor, lr: float) -> None:
        super().__init__()
        self.model, self.train_data, self.lr = model, train, lr
        self.losses: list[Tensor] = []

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        loss = self.model(input_ids=batch, labels=batch).loss
        self.losses.append(loss.detach())
        return loss

    def train_dataloader(self) -> DataLoader[Tensor]:
        return DataLoader(self.train_data, batch_size=BATCH)  # type: ignore[arg-type]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


@dataclass
class Run:
    losses: Tensor
    held_out: float
    held_vio: float
    top2: float
    max_vio: float | None = None
    dead: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def held_out_figures(model: nn.Module, data: Tensor, experts: int) -> tuple[float, float, float]:
    """The held-out loss, the largest MaxVio over the layers and the worst layer's two busiest experts' share."""
    counts: dict[str, Tensor] = {}

    def count(name: str) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            counts[name] = torch.bincount(output[2].flatten(), minlength=experts)

        return hook

    handles = [m.register_forward_hook(count(n)) for n, m in gates(model).items()]
    model.eval()
    with torch.no_grad():
        loss = float(model(input_ids=data, labels=data).loss)
    for handle in handles:
        handle.remove()
    vio = {n: float(c.max() / c.float().mean() - 1) for n, c in counts.items()}
    worst = max(vio, key=vio.__getitem__)
    top2 = float(counts[worst].topk(2).values.sum() / counts[worst].sum())
    return loss, vio[worst], top2


def run(arm: str, seed: int, args: argparse.Namespace) -> Run:
    torch.manual_seed(seed)
    probe = data(args, 32, 10_000 + seed)
    model = build(args.layers, args.experts, args.skew, probe, args.expert_size)
    train = data(args, args.steps * BATCH, seed + 1)
    held = data(args, HELD_OUT, 20_000 + seed)
    common: dict[str, Any] = dict(
        max_steps=args.steps,
        accelerator="cpu",
        devices=1,
        log_every_n_steps=args.log_every,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    if arm in PRESET_ARMS:  # the preset as users get it (its precision on this CPU is printed)
        # its health monitor writes the stability report into default_root_dir: a temporary one
        root = tempfile.mkdtemp(prefix="moe_collapse_")
        common["default_root_dir"] = root
        trainer: pl.Trainer = StableTrainer.from_preset("moe", **PRESET_ARMS[arm], **common)
    else:
        options = ARMS[arm]
        monitor = None
        if options is not None:
            monitor = RouterHealthMonitor(
                expert_shares=False, z_loss=options.get("z_loss"), balance_bias=options.get("balance_bias")
            )
        trainer = pl.Trainer(precision="32-true", callbacks=[] if monitor is None else [monitor], **common)
    module = CollapseLM(model, train, args.lr)
    trainer.fit(module)
    if "default_root_dir" in common:
        shutil.rmtree(common["default_root_dir"], ignore_errors=True)
    loss, vio, top2 = held_out_figures(model, held, args.experts)
    result = Run(torch.stack(module.losses), loss, vio, top2)
    result.extra["precision"] = str(trainer.precision)
    if "stability/router/max_vio" in trainer.callback_metrics:
        result.max_vio = float(trainer.callback_metrics["stability/router/max_vio"])
        result.dead = float(trainer.callback_metrics["stability/router/dead_experts"])
    return result


def spread(values: Sequence[float | None], digits: int = 2) -> str:
    if any(v is None for v in values):
        return "-"
    vs = [float(v) for v in values if v is not None]
    return f"{statistics.mean(vs):.{digits}f} ({min(vs):.{digits}f}-{max(vs):.{digits}f})"


def main(argv: list[str] | None = None) -> dict[str, list[Run]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--data", choices=("keyed", "disjoint"), default="keyed", help="the clusters' data (see the docstring)")
    add("--pool", type=int, default=32, help="--data keyed: the tokens the clusters share")
    add("--steps", type=int, default=2000)
    add("--lr", type=float, default=1e-2)
    add("--seeds", type=int, nargs="+", default=[0, 1, 2])
    add("--skew", type=float, default=8.0, help="expert 0's head start on the average token, in logits")
    add("--experts", type=int, default=8)
    add("--expert-size", type=int, default=8, help="each expert's intermediate size")
    add("--clusters", type=int, default=8)
    add("--layers", type=int, default=2)
    add("--log-every", type=int, default=20)
    add("--threads", type=int, default=1)
    every = [*ARMS, *PRESET_ARMS]
    add("--arms", nargs="+", default=every, choices=every)
    add("--quick", action="store_true", help="a smoke run: 40 steps, one seed")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.seeds, args.log_every = 40, [0], 10
    torch.set_num_threads(args.threads)
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    started = time.strftime("%a %b %d %H:%M UTC %Y", time.gmtime())
    runs: dict[str, list[Run]] = {arm: [run(arm, seed, args) for seed in args.seeds] for arm in args.arms}
    case = f"{args.clusters} clusters" + (f" sharing {args.pool} tokens" if args.data == "keyed" else " (disjoint)")
    print(
        f"{started}; top-1 OLMoE, {args.layers} layers, {args.experts} experts of {args.expert_size}, skew "
        f"{args.skew:g}, {case}, {args.steps} steps at lr {args.lr:g}, seeds {' '.join(map(str, args.seeds))}; "
        f"torch {torch.__version__}, lightning {pl.__version__}"
    )
    for arm in PRESET_ARMS:
        if arm in runs:
            print(f"{arm}: precision {runs[arm][0].extra['precision']} (the preset's choice on this CPU)")
    if "plain" in runs and "monitor" in runs:
        equal = all(torch.equal(a.losses, b.losses) for a, b in zip(runs["plain"], runs["monitor"], strict=True))
        print(f"monitor's training loss bit-equal to plain's at every step: {'yes' if equal else 'NO'}")
    print("mean over seeds (min-max); vs plain: held-out minus plain's on the same seed")
    print(
        f"{'arm':<20} {'MaxVio':<18} {'dead':<14} {'held MaxVio':<18} {'top-2':<18} {'train':<20} {'held-out':<20} "
        "vs plain"
    )
    for arm, rs in runs.items():
        paired = [r.held_out - p.held_out for r, p in zip(rs, runs["plain"], strict=True)] if "plain" in runs else []
        print(
            f"{arm:<20} {spread([r.max_vio for r in rs]):<18} {spread([r.dead for r in rs], 1):<14} "
            f"{spread([r.held_vio for r in rs]):<18} {spread([r.top2 for r in rs]):<18} "
            f"{spread([float(r.losses[-20:].mean()) for r in rs], 3):<20} {spread([r.held_out for r in rs], 3):<20} "
            f"{spread(paired, 3) if paired else '-'}"
        )
    return runs


if __name__ == "__main__":
    main()
