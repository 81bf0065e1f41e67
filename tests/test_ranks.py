"""``lightning_stability.ranks`` in one process (no process group, and a real 1-rank gloo group), and the check
that it stays the one place the package asks whether it runs distributed (two ranks: tests/distributed/
test_ranks_ddp.py)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from lightning_stability import ranks

PACKAGE = Path(ranks.__file__).parent


@pytest.fixture(params=["no group", "one-rank group"])
def setting(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "one-rank group":
        dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield request.param
    finally:
        if request.param == "one-rank group":
            dist.destroy_process_group()


def test_one_rank_is_rank_zero_and_every_reduction_returns_its_input(setting: str) -> None:
    assert ranks.is_distributed() is (setting == "one-rank group")
    assert (ranks.world_size(), ranks.rank()) == (1, 0)
    flag, values = torch.tensor(True), torch.tensor([1.0, -2.0])
    assert ranks.any_rank(flag) is flag and ranks.all_ranks(flag) is flag
    assert ranks.max_(values) is values and ranks.min_(values) is values and ranks.mean(values) is values
    assert values.tolist() == [1.0, -2.0]
    assert ranks.gather(values).tolist() == [[1.0, -2.0]]
    assert ranks.gather(torch.tensor(3.0)).tolist() == [3.0]
    assert ranks.gather_objects({"a": 1}) == [{"a": 1}]


def test_step_ledger_any_rank_is_the_same_helper() -> None:
    from lightning_stability.ledger import StepLedger

    flag = torch.tensor(False)
    assert StepLedger().any_rank(flag) is flag


# what only ranks.py may call: whether torch.distributed runs, how many ranks, which one, the object gather
_ASKS = re.compile(
    r"\b(dist|distributed)\.(is_initialized|get_world_size|get_rank|all_gather_object)\b"
    r"|_distributed_is_initialized|\bdef _world(_size)?\("
)


def test_only_ranks_py_asks_whether_the_run_is_distributed() -> None:
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{i}: {line.strip()}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.name != "ranks.py" or path.parent != PACKAGE
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if _ASKS.search(line)
    ]
    assert not found, "ask lightning_stability.ranks instead:\n" + "\n".join(found)
