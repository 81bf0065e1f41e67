"""Per-layer update-to-weight ratios: the layer grouping, and the ratio against the change an AdamW step made."""

from __future__ import annotations

import torch
from torch import nn

from lightning_stability.norms import per_tensor_norms
from lightning_stability.precursors.adam import adam_updates
from lightning_stability.precursors.update_ratio import layer_groups, layer_of, update_to_weight_ratios


def test_layers_are_numbered_blocks_else_modules() -> None:
    assert layer_of("blocks.layers.3.self_attn.in_proj_weight") == "blocks.layers.3"
    assert layer_of("model.layers.0.mlp.up_proj.weight") == "model.layers.0"
    assert layer_of("embed.weight") == "embed"
    assert layer_of("pos") == "pos"
    index, layers = layer_groups(["embed.weight", "h.0.a.weight", "h.0.b.bias", "h.1.a.weight", "head.bias"])
    assert index == [0, 1, 1, 2, 3] and layers == ["embed", "h.0", "h.1", "head"]


def test_ratio_by_hand() -> None:
    # layer 0: updates 3, 4 -> 5; weights 6, 8 -> 10: 0.5. layer 1: update 1, weight 4: 0.25
    ratios = update_to_weight_ratios(
        torch.tensor([3.0, 4.0, 1.0]), torch.tensor([6.0, 8.0, 4.0]), torch.tensor([0, 0, 1]), 2
    )
    torch.testing.assert_close(ratios, torch.tensor([0.5, 0.25]))


def test_adam_update_norms_give_the_ratio_of_the_step_taken() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    x = torch.randn(16, 4)
    for _ in range(3):
        optimizer.zero_grad()
        model(x).pow(2).mean().backward()
        before = [p.detach().clone() for p in model.parameters()]
        optimizer.step()
    names = [n for n, _ in model.named_parameters()]
    index, layers = layer_groups(names)
    found = adam_updates(optimizer)
    weights = per_tensor_norms([p.detach() for p in found.params])
    got = update_to_weight_ratios(found.norms, weights, torch.tensor(index), len(layers))
    params = list(model.parameters())
    expected = []
    for layer in (0, 1):
        moved = [(p.detach() - b).norm() ** 2 for p, b, i in zip(params, before, index, strict=True) if i == layer]
        sizes = [p.detach().norm() ** 2 for p, i in zip(params, index, strict=True) if i == layer]
        expected.append((sum(moved) ** 0.5) / (sum(sizes) ** 0.5))
    assert layers == ["0", "2"]
    torch.testing.assert_close(got, torch.stack(expected), rtol=1e-4, atol=1e-8)
