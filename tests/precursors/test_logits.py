"""LogPartition: the head's mean log-sum-exp and its drift from an EMA, on the device."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from lightning_stability.errors import StabilityConfigError
from lightning_stability.precursors.logits import LogPartition, find_head, log_partition
from tests.helpers import HostDataCounter, SyncCounter


class LM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.lm_head = nn.Linear(4, 10)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.embed(tokens))


def test_log_partition_by_hand() -> None:
    # two positions over a vocabulary of 2: log(e^0 + e^0) = ln 2 and log(e^1 + e^1) = 1 + ln 2
    logits = torch.tensor([[[0.0, 0.0], [1.0, 1.0]]])
    assert log_partition(logits).item() == pytest.approx(0.5 + math.log(2))
    assert log_partition(logits.half()).dtype == torch.float32


def test_drift_is_the_value_minus_the_ema_before_it() -> None:
    torch.manual_seed(0)
    model = LM()
    watch = LogPartition(model, decay=0.5)
    assert watch.name == "lm_head"
    assert watch.end_step() is None  # no forward yet
    tokens = torch.randint(10, (2, 3))
    expected = [log_partition(model(tokens)).item()]
    first = watch.end_step()
    assert first is not None and first[1].item() == 0.0  # the first value starts the average
    with torch.no_grad():
        model.lm_head.bias += 2.0  # every logit up by 2: log Z up by exactly 2
    model(tokens), model(tokens)  # two micro-batches: averaged
    log_z, drift = watch.end_step()  # type: ignore[misc]
    assert log_z.item() == pytest.approx(expected[0] + 2.0, abs=1e-5)
    assert drift.item() == pytest.approx(2.0, abs=1e-5)  # ema was the first value
    assert watch.ema is not None and watch.ema.item() == pytest.approx(expected[0] + 1.0, abs=1e-5)  # halfway


def test_no_host_sync_and_the_ema_round_trips() -> None:
    model = LM()
    watch = LogPartition(model)
    syncs, data = SyncCounter(), HostDataCounter()
    with syncs, data:
        model(torch.zeros(1, 2, dtype=torch.long))
        out = watch.end_step()
    assert out is not None and syncs.count == 0 and data.count == 0
    again = LogPartition(LM())
    again.load_state_dict(watch.state_dict())
    assert again.ema is not None and torch.equal(again.ema, watch.ema)  # type: ignore[arg-type]
    watch.remove()
    model(torch.zeros(1, 2, dtype=torch.long))
    assert watch.end_step() is None


def test_hugging_face_output_and_named_heads() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=30, n_positions=8)
    model = transformers.GPT2LMHeadModel(config)
    watch = LogPartition(model)
    out = model(torch.randint(30, (1, 5)))
    log_z, _ = watch.end_step()  # type: ignore[misc]
    torch.testing.assert_close(log_z, torch.logsumexp(out.logits.detach(), -1).mean())
    assert find_head(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 3)), "1")[0] == "1"


def test_bad_heads_are_refused() -> None:
    with pytest.raises(StabilityConfigError, match="found no LM head"):
        LogPartition(nn.Sequential(nn.Linear(2, 2)))
    with pytest.raises(StabilityConfigError, match="is not a module of LM"):
        LogPartition(LM(), module="nope")
    with pytest.raises(StabilityConfigError, match="decay"):
        LogPartition(LM(), decay=2.0)

    class Pair(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.head = nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return self.head(x), x

    model = Pair()
    wrong = LogPartition(model, module="")  # the root's output is a tuple
    with pytest.raises(StabilityConfigError, match="not the logits"):
        model(torch.zeros(1, 2))
    wrong.remove()
    picked = LogPartition(model, module="", logits_fn=lambda output: output[0])
    model(torch.zeros(1, 2))
    assert picked.end_step() is not None
