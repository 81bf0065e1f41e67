"""Check that a model fits before launching: per-GPU memory for a 7B GPT on 8 GPUs, and for your own
nn.Module built on the meta device (nothing is allocated).

Run: python examples/plan_memory.py
"""

import torch
from torch import nn

from lightning_stability import ModelShape, plan_memory

# a GPT-style shape: 32 layers, width 4096, 32 heads, vocabulary 32000 (about 7B parameters)
shape = ModelShape.decoder(layers=32, hidden=4096, heads=32, vocab=32000)
plan = plan_memory(shape, nodes=1, gpus_per_node=8, gpu_memory="80GiB", seq_len=4096, micro_batch=1)
print(plan.table())
if not plan.fits:
    with_ckpt = plan_memory(shape, gpus_per_node=8, seq_len=4096, activation_checkpointing=True)
    print("\nwith activation checkpointing:", "fits" if with_ckpt.fits else "does not fit")

# your own module: build it on the meta device, the planner counts its parameters
with torch.device("meta"):
    model = nn.Sequential(*[nn.Linear(8192, 8192) for _ in range(24)])
own = plan_memory(model, gpus_per_node=4, gpu_memory="40GiB")
print(f"\nown module, 4 x 40 GiB: {'fits' if own.fits else 'does not fit'}")
