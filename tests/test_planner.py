"""The memory planner against published numbers and hand computations."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from lightning_stability.errors import StabilityConfigError
from lightning_stability.planner import MemoryPlan, ModelShape, activations, parse_memory, plan_memory

GIB = 2**30
GPT3 = ModelShape(175e9, layers=96, hidden=12288, heads=96, vocab=51200)


def model_states(plan: MemoryPlan) -> int:
    return plan.params_bytes + plan.grads_bytes + plan.optimizer_bytes


# ---------------------------------------------------------------------- ZeRO paper (Rajbhandari et al. 2020)
@pytest.mark.parametrize(
    ("sharding", "paper_gb"),
    [("none", 120.0), ("optimizer", 31.4), ("grad_op", 16.6), ("full", 1.9)],
)
def test_zero_paper_figure_1(sharding: str, paper_gb: float) -> None:
    """Figure 1: 7.5B parameters, N_d = 64, K = 12 (mixed-precision Adam): 120, 31.4, 16.6, 1.9 GB per GPU."""
    plan = plan_memory(7.5e9, nodes=8, gpus_per_node=8, sharding=sharding, precision="bf16-mixed")  # type: ignore[arg-type]
    psi, n = 7.5e9, 64
    exact = {"none": 16 * psi, "optimizer": 4 * psi + 12 * psi / n, "grad_op": 2 * psi + 14 * psi / n}
    assert model_states(plan) == pytest.approx(exact.get(sharding, 16 * psi / n), abs=2)
    assert round(model_states(plan) / 1e9, 1) == paper_gb


def test_zero_split_of_the_model_states() -> None:
    plan = plan_memory(7.5e9, gpus_per_node=64, sharding="optimizer")
    assert (plan.params_bytes, plan.grads_bytes, plan.optimizer_bytes) == (15e9, 15e9, 12 * 7.5e9 / 64)
    plan = plan_memory(7.5e9, gpus_per_node=64, sharding="grad_op")
    assert (plan.params_bytes, plan.grads_bytes, plan.optimizer_bytes) == (15e9, 2 * 7.5e9 / 64, 12 * 7.5e9 / 64)


@pytest.mark.parametrize(
    ("precision", "optimizer", "per_param"),
    [
        ("32-true", "adamw", (4, 4, 8)),
        ("bf16-mixed", "adamw", (2, 2, 12)),
        ("16-mixed", "sgd_momentum", (2, 2, 8)),  # fp32 master + momentum
        ("32-true", "sgd_momentum", (4, 4, 4)),
        ("32-true", "sgd", (4, 4, 0)),
        ("bf16-mixed", "sgd", (2, 2, 4)),  # the master copy only
        ("bf16-true", "adamw", (2, 2, 4)),  # moments in the parameters' dtype
    ],
)
def test_bytes_per_parameter(precision: str, optimizer: str, per_param: tuple[int, int, int]) -> None:
    plan = plan_memory(1e9, sharding="none", precision=precision, optimizer=optimizer)  # type: ignore[arg-type]
    assert (plan.params_bytes, plan.grads_bytes, plan.optimizer_bytes) == tuple(k * 10**9 for k in per_param)


def test_autocast_layout_keeps_fp32_params_and_counts_the_compute_copies() -> None:
    plan = plan_memory(1e9, sharding="none", mixed_layout="autocast", overhead=0)
    assert (plan.params_bytes, plan.grads_bytes, plan.optimizer_bytes) == (4e9, 4e9, 8e9)
    assert plan.buffers_bytes == 2e9  # bf16 weight copies saved for backward
    sharded = plan_memory(1e9, gpus_per_node=8, mixed_layout="autocast")
    assert model_states(sharded) == 16e9 / 8  # FSDP2: the same total as ZeRO-3, split 4/4/8


def test_cpu_offload_moves_the_optimizer_state_to_the_host() -> None:
    plan = plan_memory(7.5e9, gpus_per_node=64, sharding="grad_op", cpu_offload=True)
    assert plan.optimizer_bytes == 0
    assert plan.host_bytes == 12 * 7.5e9 / 64
    assert any("host memory" in note for note in plan.notes)


# ---------------------------------------------------------------------- Korthikanti et al. 2022
def test_korthikanti_per_layer_gpt3() -> None:
    """s*b*h*(34 + 5*a*s/h) bytes per layer, 16-bit activations: 2048*12288*(34 + 80) for GPT-3 175B."""
    s, h, a, v = 2048, 12288, 96, 51200
    per_layer = s * h * (34 + 5 * a * s // h)
    assert per_layer == 2_868_903_936  # 2.87 GB
    acts = activations(GPT3, s, element=2, flash_attention=False)
    assert acts is not None
    assert acts.layer == per_layer
    output = 4 * s * h * (1 + v / h) + s * h  # Sec. 4.3 (output layer) + embedding dropout mask
    assert acts.full == pytest.approx(96 * per_layer + output, abs=1)
    # full recomputation keeps each layer's input (2sbh) and recomputes one layer at a time
    assert acts.checkpointed == pytest.approx(96 * 2 * s * h + per_layer + output, abs=1)


def test_activations_scale_with_micro_batch_and_flash_drops_the_scores() -> None:
    one = plan_memory(GPT3, nodes=8, gpus_per_node=8, micro_batch=1)
    four = plan_memory(GPT3, nodes=8, gpus_per_node=8, micro_batch=4)
    assert four.activations_bytes == 4 * one.activations_bytes
    flash = activations(GPT3, 2048, element=2, flash_attention=True)
    assert flash is not None
    assert flash.layer == 2048 * 12288 * 34 + 4 * 96 * 2048  # no a*s^2 term; fp32 logsumexp
    fp32 = activations(GPT3, 2048, element=4, flash_attention=False)
    assert fp32 is not None
    assert fp32.layer == 2048 * 12288 * (66 + 9 * 96 * 2048 / 12288)  # 4-byte activations, 1-byte masks


# ---------------------------------------------------------------------- 175B on 8 x 8 x 80 GiB
def test_175b_on_64_gpus() -> None:
    psi, n, s, h = 175e9, 64, 2048, 12288
    plan = plan_memory(GPT3, nodes=8, gpus_per_node=8, gpu_memory="80GiB", sharding="full", seq_len=s)
    assert plan.params_bytes == 2 * psi / n
    assert plan.grads_bytes == 2 * psi / n
    assert plan.optimizer_bytes == 12 * psi / n
    assert model_states(plan) == 16 * psi / n  # 43.75 GB
    unit = 12 * h * h + 13 * h  # one block gathered at a time
    assert plan.buffers_bytes == 3 * 2 * unit + GIB
    assert plan.capacity_bytes == 80 * GIB
    assert plan.usable_bytes == round(0.9 * 80 * GIB)
    assert not plan.fits  # 257 GiB of activations without checkpointing
    assert plan.max_micro_batch == 0
    assert "activation_checkpointing=True would fit" in plan.notes

    ckpt = plan_memory(GPT3, nodes=8, gpus_per_node=8, activation_checkpointing=True, effective_batch=1536)
    assert ckpt.fits
    assert ckpt.total_bytes == model_states(ckpt) + ckpt.buffers_bytes + ckpt.activations_checkpointed_bytes
    free = 0.9 * 80 * GIB - 16 * psi / n - (3 * 2 * unit + GIB)
    assert ckpt.max_micro_batch == math.floor(free / ckpt.activations_checkpointed_bytes) == 2
    assert ckpt.accumulation == 1536 // 64 == 24

    table = ckpt.table()
    assert "64 GPUs" in table and "ZeRO" in table and "Korthikanti" in table
    assert f"{16 * psi / n / 16 * 12 / GIB:.2f}" in table  # the optimizer row, 30.56 GiB
    assert "fits" in table and "24 steps" in table


def test_accumulation_rounds_up_with_a_note() -> None:
    plan = plan_memory(GPT3, nodes=8, gpus_per_node=8, micro_batch=2, effective_batch=1000)
    assert plan.accumulation == math.ceil(1000 / 128) == 8
    assert any("not a multiple" in note for note in plan.notes)


def test_a_parameter_count_alone_gives_no_activation_term() -> None:
    plan = plan_memory(7e9, gpus_per_node=8)
    assert plan.activations_bytes == 0 and plan.max_micro_batch is None
    assert any("lacks layers/hidden" in note for note in plan.notes)


def test_decoder_parameter_count_matches_gpt3() -> None:
    """Narayanan et al. 2021: 12*l*h^2*(1 + 13/(12h) + (V+s)/(12*l*h)) = 174.6B for GPT-3's shape."""
    shape = ModelShape.decoder(96, 12288, 96, 51200, positions=2048)
    layers, h = 96, 12288
    expected = 12 * layers * h * h * (1 + 13 / (12 * h) + (51200 + 2048) / (12 * layers * h))
    assert shape.params == pytest.approx(expected)
    assert round(shape.params / 1e9, 1) == 174.6


# ---------------------------------------------------------------------- ModelShape.from_module
class TinyLM(nn.Module):
    def __init__(self, vocab: int = 100, hidden: int = 64, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        block = nn.TransformerEncoderLayer(hidden, heads, 4 * hidden, batch_first=True)
        self.encoder = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.head = nn.Linear(hidden, vocab, bias=False)


def test_from_module_counts_a_real_module() -> None:
    model = TinyLM()
    shape = ModelShape.from_module(model)
    assert shape.params == sum(p.numel() for p in model.parameters())
    assert (shape.layers, shape.hidden, shape.heads, shape.vocab) == (2, 64, 4, 100)
    block = sum(p.numel() for p in model.encoder.layers[0].parameters())
    assert block == 12 * 64 * 64 + 13 * 64  # nn.TransformerEncoderLayer has Narayanan's block count
    assert shape.unit_params() == max(block, shape.params - 2 * block)
    assert plan_memory(model, gpus_per_node=1).params_bytes == 2 * shape.params


def test_from_module_on_the_meta_device_allocates_nothing() -> None:
    with torch.device("meta"):
        model = TinyLM(vocab=32000, hidden=2048, heads=16, layers=24)  # 1.3B parameters: 5 GB if materialised
    assert all(p.is_meta for p in model.parameters())
    shape = ModelShape.from_module(model)
    assert shape.params == sum(p.numel() for p in model.parameters())
    tied = ModelShape.decoder(24, 2048, 16, 32000)  # embedding + blocks; TinyLM adds an untied head
    assert shape.params == tied.params + 32000 * 2048
    assert (shape.layers, shape.hidden, shape.heads, shape.vocab) == (24, 2048, 16, 32000)
    assert plan_memory(model, gpus_per_node=8).params_bytes == 2 * shape.params / 8


def test_from_module_reads_a_config_and_takes_overrides() -> None:
    model = nn.Sequential(nn.Linear(8, 8))
    model.config = SimpleNamespace(num_hidden_layers=3, hidden_size=8, num_attention_heads=2, vocab_size=50)  # type: ignore[assignment]
    assert ModelShape.from_module(model) == ModelShape(72.0, 3, 8, 2, 50)
    assert ModelShape.from_module(nn.Linear(4, 4), layers=1, hidden=4).layers == 1
    assert ModelShape.from_module(nn.Linear(4, 4)).layers is None


# ---------------------------------------------------------------------- memory strings and bad inputs
@pytest.mark.parametrize(
    ("text", "expected"),
    [("80GiB", 80 * GIB), ("40GB", 40 * 10**9), ("512 MiB", 512 * 2**20), ("1.5TiB", 3 * 2**39), (1024, 1024)],
)
def test_parse_memory(text: str | int, expected: int) -> None:
    assert parse_memory("gpu_memory", text) == expected


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"precision": "fp8"}, "precision"),
        ({"optimizer": "lion"}, "optimizer"),
        ({"sharding": "zero3"}, "sharding"),
        ({"nodes": 0}, "nodes"),
        ({"gpus_per_node": -1}, "gpus_per_node"),
        ({"micro_batch": 0}, "micro_batch"),
        ({"seq_len": 2.5}, "seq_len"),
        ({"effective_batch": 0}, "effective_batch"),
        ({"gpu_memory": "80 gigs"}, "gpu_memory"),
        ({"gpu_memory": "eighty"}, "gpu_memory"),
        ({"gpu_memory": -5}, "gpu_memory"),
        ({"gpu_memory": 0}, "gpu_memory"),
        ({"headroom": 1.5}, "headroom"),
        ({"mixed_layout": "deepspeed"}, "mixed_layout"),
    ],
)
def test_bad_inputs_name_the_argument(kwargs: dict[str, object], argument: str) -> None:
    with pytest.raises(StabilityConfigError, match=rf"`{argument}=.*Fix: ") as info:
        plan_memory(GPT3, **kwargs)  # type: ignore[arg-type]
    assert repr(next(iter(kwargs.values()))) in str(info.value)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    ("make", "argument"),
    [
        (lambda: ModelShape(0), "params"),
        (lambda: ModelShape(1e9, layers=0), "layers"),
        (lambda: plan_memory("7B"), "model"),  # type: ignore[arg-type]
        (lambda: ModelShape.from_module(nn.ReLU()), "module"),
    ],
)
def test_bad_models_name_the_argument(make: object, argument: str) -> None:
    with pytest.raises(StabilityConfigError, match=rf"`{argument}="):
        make()  # type: ignore[operator]
