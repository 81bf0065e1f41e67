"""The early actions' math: QK-clip brings each head's max logit back to tau; StableAdamW's update clipping
matches the paper's reference algorithm; a momentum reset leaves the step count alone."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from lightning_stability.errors import StabilityConfigError
from lightning_stability.precursors.actions import (
    HeadBlocks,
    QKProjection,
    apply_qk_clip_,
    clip_updates_,
    first_update_gain,
    qk_clip_factors,
    qk_projection,
    reset_moments_,
    scale_heads_,
    update_clip_coefficients,
)
from lightning_stability.precursors.attention import AttentionLogits, QueryKey, register_attention
from tests.helpers import HostDataCounter, SyncCounter
from tests.precursors.tiny_lm import hf_config

TAU = 100.0


def test_qk_clip_factors_by_hand() -> None:
    s = torch.tensor([50.0, 100.0, 200.0, 400.0, -math.inf, -3.0])
    torch.testing.assert_close(qk_clip_factors(s, TAU), torch.tensor([1.0, 1.0, 0.5, 0.25, 1.0, 1.0]))
    with pytest.raises(StabilityConfigError, match="tau"):
        qk_clip_factors(s, 0.0)


def test_heads_at_or_below_a_tau_float32_cannot_hold_are_left_exactly_alone() -> None:
    tau = 0.1  # not a float32 number: the clamp rounds it, and tau over its rounding is not 1
    s = torch.tensor([0.05, tau, 0.2])
    eta = qk_clip_factors(s, tau)
    assert eta[:2].tolist() == [1.0, 1.0]
    assert eta[2].item() == pytest.approx(0.5)


def maxima_after(model: nn.Module, run: Any) -> dict[str, Tensor]:
    logits = AttentionLogits(model)
    with torch.no_grad():
        run()
    logits.remove()
    return logits.maxima


def check_clip(model: nn.Module, run: Any, alpha: float = 0.5) -> None:
    """Clip every attention of ``model`` from a forward's maxima; the next forward's maxima are min(S, tau) for
    plain heads, at most tau for all."""
    before = maxima_after(model, run)
    assert any(float(s.max()) > 2 * TAU for s in before.values())  # the case is not trivial: some heads exceed
    assert any(float(s.min()) < TAU for s in before.values())  # and some do not
    modules = dict(model.named_modules())
    for name, s in before.items():
        apply_qk_clip_(qk_projection(modules[name]), s, TAU, alpha)
    after = maxima_after(model, run)
    for name, s in before.items():
        projection = qk_projection(modules[name])
        if projection.kv_heads == projection.heads:
            torch.testing.assert_close(after[name], s.clamp(max=TAU), rtol=1e-4, atol=1e-3)
        else:  # grouped-query: each head ends at or below tau, and below-tau groups are untouched
            assert float(after[name].max()) <= TAU * (1 + 1e-4)


def test_multihead_attention_heads_end_at_tau() -> None:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True)
    with torch.no_grad():
        layer.self_attn.in_proj_weight[:16].mul_(
            torch.tensor([1.0, 1.0, 1.0, 1.0, 30.0, 30.0, 30.0, 30.0]).repeat_interleave(2)[:, None]
        )
        layer.self_attn.in_proj_weight[16:32].mul_(
            torch.tensor([1.0, 1.0, 1.0, 1.0, 30.0, 30.0, 30.0, 30.0]).repeat_interleave(2)[:, None]
        )
    x = torch.randn(2, 6, 16) * 3
    values = layer.self_attn.in_proj_weight[32:].clone()
    check_clip(layer, lambda: layer(x))
    assert torch.equal(layer.self_attn.in_proj_weight[32:], values)  # W_v untouched


def test_alpha_one_scales_only_the_query() -> None:
    torch.manual_seed(1)
    mha = nn.MultiheadAttention(8, 2, batch_first=True)
    key = mha.in_proj_weight[8:16].clone()
    eta = apply_qk_clip_(qk_projection(mha), torch.tensor([400.0, 50.0]), TAU, alpha=1.0)
    torch.testing.assert_close(eta, torch.tensor([0.25, 1.0]))
    assert torch.equal(mha.in_proj_weight[8:16], key)
    with pytest.raises(StabilityConfigError, match="alpha"):
        apply_qk_clip_(qk_projection(mha), torch.tensor([1.0, 1.0]), alpha=2.0)
    with pytest.raises(StabilityConfigError, match="max_logits"):
        apply_qk_clip_(qk_projection(mha), torch.tensor([1.0, 1.0, 1.0]))


transformers = pytest.importorskip("transformers")


def hf_model(family: str) -> nn.Module:
    return transformers.AutoModel.from_config(hf_config(family, layers=1))


@pytest.mark.parametrize("family", ["gpt2", "bert", "llama"])
def test_hugging_face_heads_end_at_or_below_tau(family: str) -> None:
    torch.manual_seed(2)
    model = hf_model(family).eval()  # no dropout: the two forwards see the same hidden states
    names = list(AttentionLogits(model).modules)
    modules = dict(model.named_modules())
    projection = qk_projection(modules[names[0]])
    with torch.no_grad():  # heads 2 and 3 get large logits
        factors = torch.tensor([0.5, 1.0, 300.0, 300.0])
        for blocks in projection.query:
            scale_heads_(blocks, factors, projection.head_dim)
        kv = factors.view(projection.kv_heads, -1).amax(1)
        for blocks in projection.key:
            scale_heads_(blocks, kv, projection.head_dim)
    tokens = torch.randint(50, (2, 8))
    check_clip(model, lambda: model(tokens))


def test_heads_with_qk_norms_are_refused() -> None:
    config = transformers.Qwen3Config(
        num_hidden_layers=1,
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        vocab_size=50,
        head_dim=8,
    )
    attention = transformers.Qwen3Model(config).layers[0].self_attn
    with pytest.raises(StabilityConfigError, match="would undo QK-clip"):
        qk_projection(attention)
    with pytest.raises(StabilityConfigError, match="does not know where Linear"):
        qk_projection(nn.Linear(2, 2))


# ---------------------------------------------------------------------------------------------- update clipping
def stable_adamw_reference(
    params: list[Tensor],
    grads_per_step: list[list[Tensor]],
    lr: float,
    wd: float,
    betas: tuple[float, float],
    eps: float,
) -> None:
    """Wortsman et al. 2023's StableAdamW as their reference code writes it (bias-corrected running averages via
    beta-hats, update clipping per tensor with d = 1), in place on ``params``."""
    beta1, beta2 = betas
    m = [torch.zeros_like(p) for p in params]
    u = [torch.zeros_like(p) for p in params]
    for step, grads in enumerate(grads_per_step, start=1):
        beta1hat = beta1 * (1 - beta1 ** (step - 1)) / (1 - beta1**step)
        beta2hat = beta2 * (1 - beta2 ** (step - 1)) / (1 - beta2**step)
        for p, g, mi, ui in zip(params, grads, m, u, strict=True):
            mi.mul_(beta1hat).add_(g, alpha=1 - beta1hat)
            ui.mul_(beta2hat).addcmul_(g, g, value=1 - beta2hat)
            rms = (g.pow(2) / torch.maximum(ui, torch.full_like(ui, eps**2))).mean().sqrt().item()
            p.mul_(1 - lr * wd).addcdiv_(mi, ui.sqrt().add(eps), value=-lr / max(1.0, rms))


def test_update_clipping_on_adamw_matches_stable_adamw() -> None:
    torch.manual_seed(3)
    shapes = [(5, 4), (7,)]
    grads_per_step = [[torch.randn(s) for s in shapes] for _ in range(6)]
    for grads in grads_per_step[3:5]:  # a gradient spike: g^2 far above its running average, RMS_t >> 1
        grads[0].mul_(50)
    lr, wd, betas, eps = 1e-2, 0.1, (0.9, 0.99), 1e-8
    start = [torch.randn(s) for s in shapes]
    expected = [p.clone() for p in start]
    stable_adamw_reference(expected, grads_per_step, lr, wd, betas, eps)

    params = [nn.Parameter(p.clone()) for p in start]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=wd, betas=betas, eps=eps)
    clipped = 0
    for grads in grads_per_step:
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        state = [optimizer.state.get(p, {}) for p in params]
        coefs = update_clip_coefficients(
            grads,
            [s.get("exp_avg_sq", torch.zeros_like(p)) for s, p in zip(state, params, strict=True)],
            [s.get("step", torch.tensor(0.0)) for s in state],
            betas[1],
            eps,
        )
        clipped += int((coefs < 1).sum())
        before = [p.detach().clone() for p in params]
        optimizer.step()
        clip_updates_(params, before, coefs, lr, wd)
    assert clipped >= 2  # the spike was clipped
    for p, e in zip(params, expected, strict=True):
        torch.testing.assert_close(p.detach(), e, rtol=1e-5, atol=1e-6)


def test_update_clip_coefficients_without_host_sync() -> None:
    g, v = [torch.randn(3, 3)], [torch.rand(3, 3)]
    syncs, data = SyncCounter(), HostDataCounter()
    step = [torch.tensor(4.0)]
    with syncs, data:
        coef = update_clip_coefficients(g, v, step, 0.99, 1e-8)
    assert coef.shape == (1,) and syncs.count == 0 and data.count == 0
    u = (0.99 * v[0] + 0.01 * g[0] ** 2) / (1 - 0.99**5)
    rms = (g[0] ** 2 / u).mean().sqrt()
    torch.testing.assert_close(coef[0], 1 / rms.clamp(min=1))


# ---------------------------------------------------------------------------------------------- momentum reset
def test_momentum_reset_leaves_the_step_count_and_the_other_tensors_alone() -> None:
    hit, other = nn.Parameter(torch.zeros(4)), nn.Parameter(torch.zeros(3))
    betas, lr = (0.9, 0.999), 1e-3
    optimizer = torch.optim.Adam([hit, other], lr=lr, betas=betas, eps=1e-12)
    grad = torch.tensor([0.5, -2.0, 1.0, -0.1])
    for _ in range(50):  # a steady gradient: Adam settles at lr * sign(g) per step
        hit.grad, other.grad = grad.clone(), torch.ones(3)
        optimizer.step()
    saved_other = {k: v.clone() for k, v in optimizer.state[other].items()}
    reset_moments_(optimizer, [hit, other], torch.tensor([True, False]))
    assert float(optimizer.state[hit]["step"]) == 50  # the step count is not touched
    assert not optimizer.state[hit]["exp_avg"].any() and not optimizer.state[hit]["exp_avg_sq"].any()
    for key, value in optimizer.state[other].items():
        assert torch.equal(value, saved_other[key])
    before = hit.detach().clone()
    hit.grad, other.grad = grad.clone(), torch.ones(3)
    optimizer.step()
    gain = first_update_gain(*betas, 50)
    torch.testing.assert_close((before - hit.detach()) / lr, gain * grad.sign(), rtol=1e-5, atol=1e-7)
    assert float(optimizer.state[hit]["step"]) == 51
    assert first_update_gain(0.9, 0.95, 10**6) == pytest.approx(0.1 / math.sqrt(0.05))  # 0.45; OLMo-core's bug: 2.2
    with pytest.raises(StabilityConfigError, match="does not update"):
        reset_moments_(optimizer, [nn.Parameter(torch.zeros(2))], torch.tensor([True]))
    reset_moments_(torch.optim.Adam([p := nn.Parameter(torch.zeros(1))]), [p], torch.tensor([True]))  # no state yet


class PackedAttention(nn.Module):
    """A user's own attention: q | k | v packed in one projection, four heads of four."""

    heads = 4

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(16, 48)

    def forward(self, x: Tensor) -> Tensor:
        return self.qkv(x)


def packed_qk(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> QueryKey:
    q, k, _ = module.qkv(args[0]).unflatten(-1, (3, 4, 4)).permute(2, 0, 3, 1, 4)
    return QueryKey(q, k, scale=0.5, causal=True)


def packed_heads(module: nn.Module) -> QKProjection:
    weight, bias = module.qkv.weight, module.qkv.bias  # type: ignore[union-attr]
    query = [HeadBlocks(weight, 0, 0), HeadBlocks(bias, 0, 0)]
    key = [HeadBlocks(weight, 0, 16), HeadBlocks(bias, 0, 16)]
    return QKProjection(query, key, heads=4, kv_heads=4, head_dim=4)


def test_a_registered_attention_with_its_projection_is_clipped_and_one_without_is_refused() -> None:
    torch.manual_seed(5)
    model = nn.Sequential(PackedAttention())
    with torch.no_grad():  # heads 2 and 3 get large logits
        model[0].qkv.weight[:32].unflatten(0, (2, 4, 4)).mul_(torch.tensor([1.0, 1.0, 40.0, 40.0]).view(1, 4, 1, 1))
    x = torch.randn(2, 6, 16)
    register_attention(PackedAttention, packed_qk)
    with pytest.raises(StabilityConfigError, match=r"register_attention\(PackedAttention, fn, projection=\.\.\.\)"):
        qk_projection(model[0])
    register_attention(PackedAttention, packed_qk, projection=packed_heads)
    check_clip(model, lambda: model(x))
    register_attention(PackedAttention, packed_qk, projection=lambda module: "rows 0-15")
    with pytest.raises(StabilityConfigError, match=r"projection.*is not a QKProjection"):
        qk_projection(model[0])
