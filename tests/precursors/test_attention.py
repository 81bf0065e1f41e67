"""AttentionLogits: the largest pre-softmax logit per head, against the logits each model itself computes."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from lightning_stability.errors import StabilityConfigError
from lightning_stability.precursors.attention import AttentionLogits, QueryKey, register_attention
from tests.helpers import HostDataCounter, SyncCounter
from tests.precursors.tiny_lm import HF_FAMILIES, hf_config

transformers = pytest.importorskip("transformers")


def masked_max(logits: Tensor, keep: Tensor) -> Tensor:
    """(heads,): the max of (batch, heads, L, S) logits where ``keep``."""
    return logits.masked_fill(~keep, -math.inf).amax(dim=(0, 2, 3))


def mha_reference(mha: nn.MultiheadAttention, x: Tensor, keep: Tensor) -> Tensor:
    """Head by head, from the packed projection: q_h = x W_q,h^T + b_q,h; logits = q_h k_h^T / sqrt(d)."""
    w_q, w_k, _ = mha.in_proj_weight.chunk(3)
    b_q, b_k, _ = mha.in_proj_bias.chunk(3)
    d = mha.head_dim
    per_head = []
    for h in range(mha.num_heads):
        rows = slice(h * d, (h + 1) * d)
        q = x @ w_q[rows].T + b_q[rows]
        k = x @ w_k[rows].T + b_k[rows]
        per_head.append(masked_max((q @ k.transpose(-1, -2) / math.sqrt(d))[:, None], keep[:, None]))
    return torch.cat(per_head)


def test_transformer_encoder_layers_with_a_causal_mask() -> None:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True, norm_first=True)
    encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    x = torch.randn(3, 5, 16)
    mask = nn.Transformer.generate_square_subsequent_mask(5)
    logits = AttentionLogits(encoder)
    assert list(logits.modules) == ["layers.0.self_attn", "layers.1.self_attn"]
    encoder(x, mask=mask, is_causal=True)
    causal = torch.ones(5, 5, dtype=torch.bool).tril().expand(3, 5, 5)
    first = encoder.layers[0]
    expected = mha_reference(first.self_attn, first.norm1(x), causal)
    torch.testing.assert_close(logits.maxima["layers.0.self_attn"], expected)
    unmasked = mha_reference(first.self_attn, first.norm1(x), torch.ones_like(causal))
    assert not torch.equal(expected, unmasked)  # the mask matters on this input: the future pairs are left out
    assert logits.per_layer().shape == (2,)
    assert logits.per_layer()[0] == expected.max()


def test_sequence_first_attention_with_key_padding() -> None:
    torch.manual_seed(1)
    mha = nn.MultiheadAttention(8, 2)  # batch_first=False: (L, B, E)
    x = torch.randn(6, 2, 8)
    padding = torch.zeros(2, 6, dtype=torch.bool)
    padding[1, 4:] = True  # the second sequence's last two keys are padding
    logits = AttentionLogits(nn.Sequential(mha))
    mha(x, x, x, key_padding_mask=padding)
    keep = (~padding)[:, None, :].expand(2, 6, 6)
    torch.testing.assert_close(logits.maxima["0"], mha_reference(mha, x.transpose(0, 1), keep))


def test_the_maximum_runs_over_forwards_until_reset_and_stops_when_inactive() -> None:
    torch.manual_seed(2)
    mha = nn.MultiheadAttention(8, 2, batch_first=True)
    small, large = torch.randn(1, 4, 8) * 0.1, torch.randn(1, 4, 8) * 10
    logits = AttentionLogits(nn.Sequential(mha))
    mha(large, large, large)
    after_large = logits.maxima["0"].clone()
    mha(small, small, small)  # a second micro-batch with smaller logits: the max stays
    torch.testing.assert_close(logits.maxima["0"], after_large)
    logits.reset()
    assert logits.per_layer()[0] == -math.inf
    logits.active = False
    mha(large, large, large)
    assert logits.maxima == {}
    logits.active = True
    logits.remove()
    mha(large, large, large)
    assert logits.maxima == {}


def test_no_host_sync_and_no_host_data() -> None:
    layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True)
    x, mask = torch.randn(2, 5, 16), nn.Transformer.generate_square_subsequent_mask(5)
    logits = AttentionLogits(layer)
    syncs, data = SyncCounter(), HostDataCounter()
    with syncs, data:
        layer(x, src_mask=mask, is_causal=True)
        logits.per_layer()
    assert logits.maxima and syncs.count == 0 and data.count == 0


# ---------------------------------------------------------------------------------------------- Hugging Face
@pytest.fixture(scope="module")
def recorded() -> list[Tensor]:
    """An attention implementation that records the max of the logits the model computes (its own q, k, mask,
    scaling, after rotary embeddings and q/k norms), then runs torch's SDPA."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import sdpa_mask

    seen: list[Tensor] = []

    def record(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, mask: Any, **kwargs: Any) -> Any:
        key_full = key.repeat_interleave(query.shape[1] // key.shape[1], dim=1)
        logits = query @ key_full.transpose(-1, -2) * kwargs["scaling"]
        seen.append(logits.masked_fill(~mask, -math.inf).amax(dim=(0, 2, 3)).detach())
        return sdpa_attention_forward(module, query, key, value, mask, **kwargs)

    AttentionInterface.register("ls_record", record)
    AttentionMaskInterface.register("ls_record", sdpa_mask)
    return seen


@pytest.mark.parametrize("family", sorted(HF_FAMILIES))
def test_hugging_face_attention_matches_the_models_own_logits(family: str, recorded: list[Tensor]) -> None:
    torch.manual_seed(3)
    model = transformers.AutoModel.from_config(hf_config(family), attn_implementation="ls_record")
    logits = AttentionLogits(model)
    assert len(logits.modules) == 2
    recorded.clear()
    tokens = torch.randint(50, (2, 7))
    padding = torch.ones(2, 7, dtype=torch.long)
    padding[1, :2] = 0  # the second row starts with two pad tokens
    model(tokens, attention_mask=padding)
    assert len(recorded) == 2
    for name, expected in zip(logits.modules, recorded, strict=True):
        torch.testing.assert_close(logits.maxima[name], expected)


# ---------------------------------------------------------------------------------------------- your own
class TwoHeadAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wq, self.wk = nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.wq(x) + self.wk(x)


def test_a_registered_attention_is_measured() -> None:
    def qk(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> QueryKey:
        x = args[0]
        q = module.wq(x).unflatten(-1, (2, 4)).transpose(1, 2)
        k = module.wk(x).unflatten(-1, (2, 4)).transpose(1, 2)
        return QueryKey(q, k, scale=0.5, causal=True)

    with pytest.raises(StabilityConfigError, match="has no attention module AttentionLogits knows"):
        AttentionLogits(nn.Sequential(TwoHeadAttention()))
    register_attention(TwoHeadAttention, qk)
    torch.manual_seed(4)
    module = TwoHeadAttention()
    x = torch.randn(1, 3, 8)
    logits = AttentionLogits(nn.Sequential(module))
    module(x)
    q = module.wq(x).view(1, 3, 2, 4).transpose(1, 2)
    k = module.wk(x).view(1, 3, 2, 4).transpose(1, 2)
    expected = masked_max(q @ k.transpose(-1, -2) * 0.5, torch.ones(3, 3, dtype=torch.bool).tril())
    torch.testing.assert_close(logits.maxima["0"], expected)


def test_bad_registrations_and_bias_kv_are_refused() -> None:
    with pytest.raises(StabilityConfigError, match=r"is not an nn\.Module subclass"):
        register_attention(int, lambda *a: None)  # type: ignore[arg-type]
    with pytest.raises(StabilityConfigError, match="is not callable"):
        register_attention(TwoHeadAttention, 3)  # type: ignore[arg-type]
    with pytest.raises(StabilityConfigError, match="add_bias_kv=True"):
        AttentionLogits(nn.Sequential(nn.MultiheadAttention(8, 2, add_bias_kv=True)))
