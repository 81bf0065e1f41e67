"""The pure norm functions against torch's own clip_grad_norm_ (no Trainer)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from lightning_stability.norms import (
    clip_by_global_norm_,
    clip_coefficient,
    combine_norms,
    group_norms,
    is_uniform,
    per_tensor_norms,
    scale_,
    total_norm,
)
from tests.helpers import HostDataCounter


def _grads(seed: int = 0, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(7, 5), (5,), (3, 4, 2), (1,), (11,)]
    return [torch.randn(s, generator=g).to(dtype) * (i + 1) for i, s in enumerate(shapes)]


@pytest.mark.parametrize("norm_type", [2.0, 1.0, 3.0, 0.5, math.inf])
def test_total_norm_matches_clip_grad_norm(norm_type: float) -> None:
    grads = _grads()
    params = [nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    expected = torch.nn.utils.clip_grad_norm_(params, max_norm=1e9, norm_type=norm_type)
    torch.testing.assert_close(total_norm(grads, norm_type), expected)


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_clipping_matches_clip_grad_norm(norm_type: float) -> None:
    grads = _grads(1)
    params = [nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    torch.nn.utils.clip_grad_norm_(params, max_norm=0.5, norm_type=norm_type)
    ours = [g.clone() for g in grads]
    coef = clip_coefficient(total_norm(ours, norm_type), 0.5)
    scale_(ours, coef)
    for p, g in zip(params, ours, strict=True):
        torch.testing.assert_close(g, p.grad)
    assert coef.item() < 1.0


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_the_one_clip_is_torchs_clip_grad_norm_bit_for_bit(norm_type: float) -> None:
    grads = _grads(3)
    params = [nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    torch.nn.utils.clip_grad_norm_(params, max_norm=0.5, norm_type=norm_type)
    ours = [g.clone() for g in grads]
    coef = clip_by_global_norm_(ours, 0.5, norm_type=norm_type)
    assert coef.item() < 1.0
    assert all(torch.equal(g, p.grad) for p, g in zip(params, ours, strict=True))


def test_gradient_clip_val_under_fused_clip_mixed_precision_is_lightnings_clip_bit_for_bit() -> None:
    """``Trainer(gradient_clip_val)`` through the package's clip gives what Lightning's own plugin gives."""
    from lightning.pytorch.plugins.precision import Precision

    from lightning_stability.amp.callback import FusedClipMixedPrecision

    grads = _grads(4)
    results = []
    for plugin in (Precision(), FusedClipMixedPrecision("16-mixed", "cpu")):
        params = [nn.Parameter(torch.zeros_like(g)) for g in grads]
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        plugin.clip_grad_by_norm(torch.optim.SGD(params, lr=0.1), 0.5)
        results.append([p.grad for p in params])
    assert not torch.equal(results[0][0], grads[0])  # it clipped
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))


def test_no_clipping_below_threshold() -> None:
    grads = _grads(2)
    coef = clip_coefficient(total_norm(grads), 1e6)
    assert coef.item() == 1.0


def test_mixed_dtypes_accumulate_in_fp32_in_input_order_without_host_data() -> None:
    grads = _grads(3)
    # three dtype buckets, interleaved: the result must come back in input order
    mixed = [g.half() if i % 3 == 1 else g.bfloat16() if i % 3 == 2 else g for i, g in enumerate(grads)]
    counter = HostDataCounter()
    with counter:
        norms = per_tensor_norms(mixed)
    assert norms.dtype == torch.float32
    expected = torch.stack([torch.linalg.vector_norm(g.float()) for g in mixed])
    torch.testing.assert_close(norms, expected)
    # no index tensor built from host data: on a GPU that would be a blocking copy in every step
    assert counter.count == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_the_uniform_fast_path_gives_the_same_norms_and_scaling(dtype: torch.dtype) -> None:
    grads = _grads(6, dtype)
    assert is_uniform(grads)
    for norm_type in (2.0, math.inf):
        fast, checked = per_tensor_norms(grads, norm_type, uniform=True), per_tensor_norms(grads, norm_type)
        assert fast.dtype == torch.float32
        torch.testing.assert_close(fast, checked)
    copy = [g.clone() for g in grads]
    scale_(grads, torch.tensor(0.5), uniform=True)
    scale_(copy, torch.tensor(0.5))
    torch.testing.assert_close(grads, copy)


def test_only_plain_non_empty_tensors_of_one_dtype_are_uniform() -> None:
    grads = _grads(7)
    assert not is_uniform([])
    assert not is_uniform([*grads, grads[0].double()])
    assert not is_uniform([*grads, torch.zeros(0)])  # an empty tensor takes the checked path (norm 0)


def test_the_gradients_layout_is_rechecked_when_the_set_of_parameters_changes() -> None:
    from lightning_stability.ledger.gradients import ClipScale, StepGradients

    fp32, fp64 = nn.Linear(3, 4), nn.Linear(3, 2).double()
    optimizer = torch.optim.SGD([*fp32.parameters(), *fp64.parameters()], lr=0.1)
    x = torch.randn(5, 3)
    fp32(x).sum().backward()  # only the fp32 layer has gradients: one dtype, the fast path
    first = StepGradients(optimizer, 2.0, torch.device("cpu"), ClipScale())
    assert first._uniform and len(first.params) == 2
    fp64(x.double()).sum().backward()  # now both: another set of parameters, checked again
    second = StepGradients(optimizer, 2.0, torch.device("cpu"), ClipScale())
    assert not second._uniform and len(second.params) == 4
    expected = torch.linalg.vector_norm(torch.cat([p.grad.flatten().float() for p in second.params]))
    torch.testing.assert_close(second.total, expected)
    second.clip_(0.5 * expected.item())
    torch.testing.assert_close(
        torch.linalg.vector_norm(torch.cat([p.grad.flatten().float() for p in second.params])), 0.5 * expected
    )


def test_group_norms_combine_per_module() -> None:
    grads = _grads(4)
    norms = per_tensor_norms(grads)
    index = torch.tensor([0, 0, 1, 2, 2])
    groups = group_norms(norms, index, 3)
    torch.testing.assert_close(groups[0], torch.linalg.vector_norm(torch.cat([grads[0].flatten(), grads[1]])))
    torch.testing.assert_close(groups[1], torch.linalg.vector_norm(grads[2]))
    inf_groups = group_norms(per_tensor_norms(grads, math.inf), index, 3, math.inf)
    torch.testing.assert_close(inf_groups[2], torch.cat([grads[3], grads[4]]).abs().max())
    torch.testing.assert_close(combine_norms(groups), combine_norms(norms))


def test_nonfinite_gradient_gives_nonfinite_norm() -> None:
    grads = _grads(5)
    grads[2][0, 0, 0] = float("nan")
    assert not torch.isfinite(total_norm(grads))
    grads[2][0, 0, 0] = float("inf")
    assert torch.isinf(total_norm(grads))


def test_empty_list() -> None:
    assert total_norm([]).item() == 0.0
