"""Run under torchrun: per_tensor_norms of sharded DTensors equals the norm of the full tensors."""

import json
import math
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard  # what FSDP2 x TP makes; built here directly

from lightning_stability.norms import per_tensor_norms, total_norm
from tests.helpers import HostDataCounter, exit_worker

out_dir = sys.argv[1]
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
g = torch.Generator().manual_seed(0)  # same full tensors on every rank
full = [torch.randn(7, 3, generator=g), torch.randn(5, generator=g) * 3, torch.randn(2, 9, generator=g)]
plain = torch.randn(4, generator=g)  # an unsharded (replicated, plain) gradient beside the sharded ones
result: dict = {}
mesh1 = init_device_mesh("cpu", (world,))
sharded = [distribute_tensor(t, mesh1, [Shard(0)]) for t in full]  # 7 and 5 rows: uneven shards
mesh2 = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard")) if world % 2 == 0 else None
for p in (2.0, 1.0, math.inf):
    expected = [torch.linalg.vector_norm(t, p).item() for t in full]
    ours = per_tensor_norms(sharded, p).tolist()
    counter = HostDataCounter()  # tensors built from host data: blocking copies on a GPU
    with counter:
        mixed = total_norm([*sharded, plain], p)
    mixed_total = mixed.item()
    expected_total = torch.linalg.vector_norm(torch.cat([*(t.flatten() for t in full), plain]), p).item()
    result[str(p)] = {
        "expected": expected,
        "ours": ours,
        "mixed_total": mixed_total,
        "expected_total": expected_total,
        "host_data": counter.count,
    }
    if mesh2 is not None:
        hsdp = [distribute_tensor(t, mesh2, [Replicate(), Shard(0)]) for t in full]
        result[str(p)]["hsdp"] = per_tensor_norms(hsdp, p).tolist()
        # FSDP2 over tensor parallelism, both on dim 0: the data-parallel dim becomes a _StridedShard
        strided_dp = _StridedShard(0, split_factor=mesh2.size(1))
        # every rank holds the full tensors: split locally (uneven shards need no padded scatter)
        strided = [distribute_tensor(t, mesh2, [strided_dp, Shard(0)], src_data_rank=None) for t in full]
        result[str(p)]["strided"] = per_tensor_norms(strided, p).tolist()
        # a sequence-parallel gradient: a sum still pending over the second mesh dim, beside a replicated one
        parts = [
            torch.randn(mesh2.size(1), *t.shape, generator=torch.Generator().manual_seed(i)) for i, t in enumerate(full)
        ]
        tp_rank = mesh2.get_local_rank(1)
        pending = [DTensor.from_local(part[tp_rank], mesh2, [Replicate(), Partial()]) for part in parts]
        result[str(p)]["partial"] = per_tensor_norms(pending, p).tolist()
        result[str(p)]["partial_expected"] = [torch.linalg.vector_norm(part.sum(0), p).item() for part in parts]
with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
    json.dump(result, f)
dist.destroy_process_group()
exit_worker()
