"""Tensor-parallel plans for ``configure_model`` under ``StableFSDPStrategy(tensor_parallel=N)`` (or Lightning's
``ModelParallelStrategy``): which linear layers split by column and which by row.

A plan maps submodule names to torch's parallel styles (``torch.distributed.tensor.parallel``). The rule for a
transformer block (Megatron-LM, Shoeybi et al. 2019): the MLP's first linear is column-parallel (each rank computes
a slice of the hidden features), the second row-parallel (each rank multiplies its slice; one all-reduce sums the
partial outputs), so a block costs one collective in forward and one in backward. For your own block, name its
linears in the same way: up-projections (and separate q/k/v projections, whose heads then split across ranks)
``ColwiseParallel()``, the projections back to the model width ``RowwiseParallel()``; everything else (norms,
embeddings) stays replicated, and gradient norms count it once.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from lightning_stability.errors import check_instance


def gpt_block_plan() -> dict[str, Any]:
    """The plan of ``torch.nn.TransformerEncoderLayer`` / ``TransformerDecoderLayer`` (the demo's ``CharGPT`` block):
    ``linear1`` column-parallel, ``linear2`` row-parallel.

    Attention stays replicated: ``nn.MultiheadAttention`` keeps q, k and v in one fused ``in_proj_weight`` that the
    parallel styles cannot split by head. A block with separate q/k/v linears splits them column-wise too.

    Example::

        def configure_model(self):
            tp = self.device_mesh["tensor_parallel"]
            for block in self.blocks.layers:
                parallelize_module(block, tp, gpt_block_plan())
    """
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"linear1": ColwiseParallel(), "linear2": RowwiseParallel()}


def parallelize_blocks(blocks: nn.Module, mesh: Any, plan: dict[str, Any] | None = None) -> nn.Module:
    """Apply ``plan`` (default :func:`gpt_block_plan`) to every block of ``blocks`` (an ``nn.TransformerEncoder``
    or ``nn.TransformerDecoder``'s ``layers``, an ``nn.ModuleList``, or a single block) over ``mesh``."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import parallelize_module

    check_instance("blocks", blocks, nn.Module, "an nn.Module", "self.model.layers")
    if plan is not None:
        check_instance("plan", plan, dict, "a dict of module names to ParallelStyles", "gpt_block_plan()")
    check_instance("mesh", mesh, DeviceMesh, "a DeviceMesh", 'self.device_mesh["tensor_parallel"]')
    layers = getattr(blocks, "layers", blocks)
    for block in layers if isinstance(layers, (nn.ModuleList, nn.Sequential)) else [layers]:
        parallelize_module(block, mesh, plan if plan is not None else gpt_block_plan())
    return blocks
