"""Run under torchrun (2 CPU processes, gloo): each helper of ``lightning_stability.ranks`` on values that differ by
rank, over the default group and over a group of its own."""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from lightning_stability import ranks
from tests.helpers import SyncCounter, exit_worker

out_dir = sys.argv[1]
dist.init_process_group("gloo")
me = ranks.rank()
flag = torch.tensor(me == 1)  # true on rank 1 only
values = torch.tensor([float(me), 10.0 - me])
group = dist.new_group(backend="gloo")
mean_in = torch.tensor([1.0 + me, 4.0 * me])
result = {
    "distributed": ranks.is_distributed(),
    "world": ranks.world_size(),
    "rank": me,
    "any": ranks.any_rank(flag).tolist(),
    "all": ranks.all_ranks(flag).tolist(),
    "all_true": ranks.all_ranks(torch.tensor(True)).tolist(),
    "max": ranks.max_(values.clone()).tolist(),
    "min": ranks.min_(values.clone(), group).tolist(),
    "mean": ranks.mean(mean_in).tolist(),
    "mean_input_kept": mean_in.tolist() == [1.0 + me, 4.0 * me],
    "gather": ranks.gather(values).tolist(),
    "gather_0dim": ranks.gather(torch.tensor(float(me))).tolist(),
    "objects": ranks.gather_objects({"rank": me}, group),
    "group_world": ranks.world_size(group),
}
with SyncCounter() as counter:  # the device reductions read nothing on the host
    ranks.any_rank(flag)
    ranks.all_ranks(flag)
    ranks.max_(values.clone())
    ranks.min_(values.clone())
    ranks.mean(values)
    ranks.gather(values)
result["host_reads"] = counter.count
with open(f"{out_dir}/rank{me}.json", "w") as f:
    json.dump(result, f)
exit_worker()
