"""Does ``plan_memory`` match the memory of real training steps? Planned / measured, per component, on CPU.

A small GPT-style decoder (4 blocks, hidden 256, 4 heads, vocab 1024, dropout 0.1; seq 128, micro-batch 4)
trains with AdamW in fp32 for 3 steps, each configuration in fresh processes (``torch.multiprocessing``
spawn, gloo): a plain PyTorch loop (eager attention; PyTorch's SDPA, which runs a flash kernel on CPU;
eager with activation checkpointing per block) and FSDP2 (``fully_shard`` per block and on the root) in 1
and 2 processes. The third step is measured, after ``zero_grad(set_to_none=True)``:

* params, grads, optimizer: bytes of the live tensors, counted (local shards under FSDP2; the same
  counting as ``benchmarks/fsdp_memory.py``);
* activations: the bytes saved for backward during the forward, caught by
  ``torch.autograd.graph.saved_tensors_hooks`` and counted once per storage (a view counts its whole
  storage, which it keeps alive), parameters excluded. Activation checkpointing keeps its block inputs
  outside those hooks, so there the count is the live bytes at the end of the forward (profiler, below);
* peak: the bytes live before the step (params + optimizer state, counted) plus the peak of the running
  sum of the CPU allocator's allocations and frees during the step, recorded by ``torch.profiler`` with
  ``profile_memory=True``. Unlike the RSS, this counts tensor bytes only, transients included.

The plan is ``plan_memory(ModelShape.from_module(model), precision="32-true", optimizer="adamw",
sharding="none" | "full", overhead=0, ...)``; its total assumes everything at once (all gradients and all
activations), so it bounds the peak from above.

Usage::

    python -m benchmarks.planner
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from lightning_stability.planner import ModelShape, plan_memory
from lightning_stability.planner import activations as planner_activations

LAYERS, HIDDEN, HEADS, VOCAB, SEQ, BATCH, DROPOUT = 4, 256, 4, 1024, 128, 4, 0.1
MiB = float(1 << 20)


@dataclass(frozen=True)
class Config:
    name: str
    world: int
    fsdp: bool
    flash: bool = False
    checkpointing: bool = False


CONFIGS = (
    Config("plain eager", 1, False),
    Config("plain sdpa(flash)", 1, False, flash=True),
    Config("plain eager ckpt", 1, False, checkpointing=True),
    Config("fsdp2 x1 eager", 1, True),
    Config("fsdp2 x2 eager", 2, True),
)


class Block(nn.Module):
    """Pre-norm GPT block: attention (eager softmax + dropout, or SDPA) and a GELU MLP, dropout on both."""

    causal: torch.Tensor

    def __init__(self, flash: bool) -> None:
        super().__init__()
        self.heads, self.flash = HEADS, flash
        self.norm1, self.norm2 = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)
        self.qkv, self.proj = nn.Linear(HIDDEN, 3 * HIDDEN), nn.Linear(HIDDEN, HIDDEN)
        self.fc1, self.fc2 = nn.Linear(HIDDEN, 4 * HIDDEN), nn.Linear(4 * HIDDEN, HIDDEN)
        self.drop = nn.Dropout(DROPOUT)
        self.register_buffer("causal", torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        if self.flash:  # CPU flash kernel: no dropout inside attention
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(h // self.heads))
            att = self.drop(scores.masked_fill(self.causal[:s, :s], float("-inf")).softmax(-1))
            out = att @ v
        x = x + self.drop(self.proj(out.transpose(1, 2).reshape(b, s, h)))
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.norm2(x)))))


class Decoder(nn.Module):
    def __init__(self, flash: bool, checkpointing: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.drop = nn.Dropout(DROPOUT)
        self.blocks = nn.ModuleList(Block(flash) for _ in range(LAYERS))
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.checkpointing = checkpointing

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.embed(tokens))
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False) if self.checkpointing else block(x)
        logits = self.head(self.norm(x)).float()
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())


def _local_bytes(t: Any) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t
    return int(local.numel() * local.element_size())


def _allocations(prof: Any) -> tuple[list[tuple[int, int]], int]:
    """(time ns, bytes) of every CPU allocation (+) and free (-) the profiler recorded, in time order, and the
    end time of the ``fwd`` range."""
    events: list[tuple[int, int]] = []
    forward_end = 0
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if type(node.extra_fields).__name__ == "_ExtraFields_Allocation":
            events.append((node.start_time_ns, int(node.extra_fields.alloc_size)))
        elif node.name == "fwd":
            forward_end = node.end_time_ns
    return sorted(events), forward_end


def measure(rank: int, config: Config, port: int, out: str) -> None:
    """One process: train 2 steps, measure the third, write ``rank{r}.json``."""
    torch.set_num_threads(1)
    if config.fsdp:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=config.world)
    torch.manual_seed(0)
    model = Decoder(config.flash, config.checkpointing)
    shape = ModelShape.from_module(model)
    if config.fsdp:
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(rank)
    for _ in range(2):  # the optimizer state exists from the first step on
        optimizer.zero_grad(set_to_none=True)
        model(torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)).backward()
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    params = list(model.parameters())
    states = [v for p in params for v in optimizer.state[p].values() if isinstance(v, torch.Tensor)]
    before = sum(_local_bytes(p) for p in params) + sum(_local_bytes(s) for s in states)
    saved: dict[int, int] = {}  # storage address -> bytes

    def pack(t: torch.Tensor) -> torch.Tensor:
        base = t if t._base is None else t._base  # a parameter, or a view of one (a transposed weight)
        if not (base.is_leaf and base.requires_grad):
            storage = t.untyped_storage()
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.profiler.record_function("fwd"):
            loss = model(tokens)
        loss.backward()
        grads = sum(_local_bytes(p.grad) for p in params if p.grad is not None)
        optimizer.step()
    events, forward_end = _allocations(prof)
    running = peak = after_forward = 0
    for when, size in events:
        running += size
        peak = max(peak, running)
        if when <= forward_end:
            after_forward = running
    result = {
        "params": sum(_local_bytes(p) for p in params),
        "grads": grads,
        "optimizer": sum(_local_bytes(s) for s in states),
        "saved": sum(saved.values()),
        "after_forward": after_forward,
        "peak": before + peak,
        "shape": asdict(shape),
    }
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    if config.fsdp:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(config: Config) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(measure, args=(config, _free_port(), tmp), nprocs=config.world, join=True)
        return [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(config.world)]


def cpu_masks(config: Config) -> int:
    """Extra bytes of the dropout masks on CPU, which stores them in the input's dtype (fp32 here) where the
    formula (after Korthikanti et al., on GPU) counts 1 byte: per block ``2*s*b*h`` (+ ``a*s^2*b`` with eager
    attention) and the embedding's ``s*b*h``; under checkpointing only the embedding's is kept."""
    per_block = 2 * SEQ * HIDDEN + (0 if config.flash else HEADS * SEQ * SEQ)
    masks = SEQ * HIDDEN + (0 if config.checkpointing else LAYERS * per_block)
    return 3 * BATCH * masks


def compare(config: Config, ranks: list[dict[str, Any]]) -> list[tuple[str, int, int, int | None]]:
    """Rows of (component, planner's bytes, planned with CPU masks, measured bytes or None)."""
    shape = ModelShape(**ranks[0]["shape"])
    plan = plan_memory(
        shape,
        gpus_per_node=config.world,
        gpu_memory="1TiB",
        precision="32-true",
        optimizer="adamw",
        sharding="full" if config.fsdp else "none",
        seq_len=SEQ,
        micro_batch=BATCH,
        activation_checkpointing=config.checkpointing,
        flash_attention=config.flash,
        overhead=0,
    )
    activations = plan.activations_bytes
    if config.checkpointing:  # what the forward keeps (block inputs, output layer): less the recomputed block
        per_sample = planner_activations(shape, SEQ, 4, config.flash)
        assert per_sample is not None
        activations = round((per_sample.checkpointed - per_sample.layer) * BATCH)
    largest = {key: max(r[key] for r in ranks) for key in ("params", "grads", "optimizer", "peak")}
    act_key = "after_forward" if config.checkpointing else "saved"
    masks = cpu_masks(config)
    return [
        ("params", plan.params_bytes, plan.params_bytes, largest["params"]),
        ("grads", plan.grads_bytes, plan.grads_bytes, largest["grads"]),
        ("optimizer", plan.optimizer_bytes, plan.optimizer_bytes, largest["optimizer"]),
        ("activations", activations, activations + masks, max(r[act_key] for r in ranks)),
        ("buffers", plan.buffers_bytes, plan.buffers_bytes, None),
        ("total/peak", plan.total_bytes, plan.total_bytes + masks, largest["peak"]),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    start = time.perf_counter()
    print(f"torch {torch.__version__}; decoder {LAYERS} blocks x hidden {HIDDEN}, {HEADS} heads, vocab {VOCAB}")
    print(f"seq {SEQ}, micro-batch {BATCH}, dropout {DROPOUT}, AdamW, fp32; MiB per process (largest rank)")
    print("plan: plan_memory(); +cpu: with dropout masks at 4 bytes (CPU) instead of 1; ratio: +cpu / measured")
    header = f"{'configuration':<19}{'component':<13}{'plan':>8}{'+cpu':>8}{'measured':>10}{'ratio':>7}"
    print(header)
    print("-" * len(header))
    for config in CONFIGS:
        for key, plan, cpu, got in compare(config, run(config)):
            measured = f"{got / MiB:>10.2f}{cpu / got:>7.3f}" if got else f"{'-':>10}{'-':>7}"
            print(f"{config.name:<19}{key:<13}{plan / MiB:>8.2f}{cpu / MiB:>8.2f}{measured}")
    print(f"wall time: {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
