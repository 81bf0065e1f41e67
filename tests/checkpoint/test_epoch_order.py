"""The epoch order of a loader rebuilt from its recipe and dealt to another number of processes (epoch_order.py), and
the RNG states of a rank a checkpoint has none of (rng.derive). The runs that resume on another world size:
test_world_size.py."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch.utils.data import BatchSampler, DistributedSampler, RandomSampler, SequentialSampler

from lightning_stability.checkpoint import epoch_order, rng
from lightning_stability.checkpoint.loader_state import ReplayableSampler, _not_dealt


@pytest.mark.parametrize(
    ("size", "world", "shuffle", "drop_last"),
    [(16, 2, True, False), (10, 3, True, False), (10, 3, False, True), (10, 4, True, False)],
)
def test_a_distributed_order_is_the_ranks_shares_interleaved(
    size: int, world: int, shuffle: bool, drop_last: bool
) -> None:
    shares = []
    for rank in range(world):
        sampler = DistributedSampler(
            range(size), num_replicas=world, rank=rank, shuffle=shuffle, seed=5, drop_last=drop_last
        )  # type: ignore[arg-type]
        sampler.set_epoch(3)
        shares.append(BatchSampler(sampler, 2, drop_last=False))
    recipe = epoch_order.describe(shares[0], None)
    assert recipe is not None and recipe["epoch"] == 3
    order = epoch_order.rebuild(recipe)
    for rank, batch_sampler in enumerate(shares):  # dealing the whole epoch gives each rank its own batches
        assert epoch_order.deal(order, 0, rank, world, 2, False) == list(batch_sampler)


@pytest.mark.parametrize("generator", [None, 7])
def test_a_random_order_is_rebuilt_from_the_states_it_was_drawn_from(generator: int | None) -> None:
    gen = torch.Generator().manual_seed(generator) if generator is not None else None
    wrapper = ReplayableSampler(BatchSampler(RandomSampler(range(12), generator=gen), 4, drop_last=False))
    torch.manual_seed(1)
    list(wrapper)  # an earlier epoch: the generators moved on
    drawn = [i for batch in wrapper for i in batch]
    recipe = epoch_order.describe(wrapper.inner, wrapper.start)
    assert recipe is not None and recipe["kind"] == "random"
    before = torch.get_rng_state()
    assert epoch_order.rebuild(recipe) == drawn
    assert torch.equal(torch.get_rng_state(), before)  # the caller's states are left as they were


def test_orders_that_cannot_be_rebuilt_have_no_recipe() -> None:
    assert epoch_order.describe(BatchSampler(SequentialSampler(range(4)), 2, False), None) == {
        "kind": "sequential",
        "size": 4,
    }
    with_replacement = BatchSampler(RandomSampler(range(4), replacement=True), 2, False)
    assert epoch_order.describe(with_replacement, {"global": {}, "generators": []}) is None
    assert epoch_order.describe(BatchSampler(RandomSampler(range(4)), 2, False), None) is None  # no record
    assert epoch_order.describe([[0, 1], [2, 3]], None) is None  # a user's own batch sampler


def test_the_rest_of_an_epoch_is_dealt_in_the_same_global_batches() -> None:
    """8 samples per global batch: 2 x 4 saved, dealt after 3 batches to 1 x 8 and 4 x 2."""
    order = torch.randperm(64, generator=torch.Generator().manual_seed(0)).tolist()
    for world in (1, 2, 4):
        shares = [epoch_order.deal(order, 3 * 8, rank, world, 8 // world, False) for rank in range(world)]
        assert all(len(share) == 5 for share in shares)
        for j in range(5):
            dealt = sorted(i for share in shares for i in share[j])
            assert dealt == sorted(order[(3 + j) * 8 : (4 + j) * 8])
    assert epoch_order.deal(list(range(10)), 4, 1, 2, 2, drop_last=True) == [[5, 7]]  # [9] dropped


def test_a_new_rank_gets_its_own_reproducible_states() -> None:
    torch.manual_seed(0)
    saved = rng.capture()
    one, two, again = rng.derive(saved, 1), rng.derive(saved, 2), rng.derive(saved, 1)
    draws = []
    for states in (saved, one, two, again):
        rng.restore(states)
        draws.append((torch.rand(3).tolist(), random.random(), float(np.random.rand())))
    assert draws[1] == draws[3]  # the same for every resume from the same checkpoint
    for first, second in [(0, 1), (0, 2), (1, 2)]:  # rank 0's, rank 1's and rank 2's differ in every generator
        assert all(a != b for a, b in zip(draws[first], draws[second], strict=True))


def test_why_the_rest_of_an_epoch_cannot_be_dealt_names_the_fix() -> None:
    recipe = {"kind": "sequential", "size": 64}
    assert _not_dealt(recipe, 8, 2, 8, 1) is None
    assert "(2 x 4) and this run's is 4 (1 x 4); a batch size of 8 per process keeps it" in str(
        _not_dealt(recipe, 8, 2, 4, 1)
    )
    assert "no batch size per process keeps it on 3 processes" in str(_not_dealt(recipe, 8, 2, 2, 3))
    assert "holds no order of its epoch" in str(_not_dealt(None, 8, 2, 4, 1))
