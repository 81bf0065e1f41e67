"""The memory planner against published numbers and hand computations."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from lightning_stability.errors import StabilityConfigError
from lightning_stability.planner import (
    GPT3_SHAPES,
    MemoryPlan,
    ModelShape,
    activations,
    advise_tensor_parallel,
    parse_memory,
    plan_memory,
)

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


def test_a_parameter_count_alone_that_is_no_gpt3_size_leaves_out_what_it_cannot_count() -> None:
    plan = plan_memory(70e9, gpus_per_node=8, overhead=0)
    assert plan.activations_bytes == 0 and plan.max_micro_batch is None
    assert plan.buffers_bytes == 0  # no unit known: no gather buffers, rather than the whole model as one unit
    assert plan.missing == ("activations", "FSDP gather buffers") and plan.assumed_shape is None
    assert plan.total_bytes == 16 * 70e9 / 8
    assert any("lacks layers/hidden" in note for note in plan.notes)
    assert (
        "not counted: activations, FSDP gather buffers" in plan.table() and "the real total is higher" in plan.table()
    )
    assert ModelShape(70e9).unit_params() is None


# ---------------------------------------------------------------------- a parameter count alone: GPT-3's table
def test_the_175b_recipe_from_a_parameter_count_alone_is_planned_with_gpt3s_shape() -> None:
    """The bug: `plan --preset 175b --params 175e9 --nodes 8 --gpus-per-node 8` took the whole model as one FSDP
    unit (3 x 2 bytes x 175e9 = 979 GiB of buffers) and said DOES NOT FIT; GPT-3 175B's blocks are 1.81e9."""
    kwargs = dict(nodes=8, gpus_per_node=8, precision="16-mixed", activation_checkpointing=True)
    plan = plan_memory(175e9, **kwargs)  # type: ignore[arg-type]
    h = 12288
    assert plan.assumed_shape == "GPT-3 175B"
    assert plan.shape == ModelShape(175e9, layers=96, hidden=h, heads=96, vocab=50257)
    assert plan.buffers_bytes == 3 * 2 * (12 * h * h + 13 * h) + GIB  # one block, not 979 GiB
    assert plan.missing == () and plan.fits and plan.max_micro_batch == 2
    same = plan_memory(ModelShape(175e9, 96, h, 96, 50257), **kwargs)  # type: ignore[arg-type]
    assert plan.total_bytes == same.total_bytes
    assert "(shape: GPT-3 175B assumed)" in plan.title
    assert any(note.startswith("shape not given: GPT-3 175B's assumed (Brown et al. 2020") for note in plan.notes)


@pytest.mark.parametrize(
    ("params", "name", "layers", "hidden", "heads"),
    [
        (125e6, "GPT-3 Small", 12, 768, 12),
        (350e6, "GPT-3 Medium", 24, 1024, 16),
        (760e6, "GPT-3 Large", 24, 1536, 16),
        (1.3e9, "GPT-3 XL", 24, 2048, 24),
        (2.7e9, "GPT-3 2.7B", 32, 2560, 32),
        (7e9, "GPT-3 6.7B", 32, 4096, 32),  # within 10% of 6.7B
        (13e9, "GPT-3 13B", 40, 5120, 40),
        (160e9, "GPT-3 175B", 96, 12288, 96),
        (150e9, None, None, None, None),  # 14% off 175B: no shape assumed
        (3.5e9, None, None, None, None),
    ],
)
def test_gpt3_table_2_1_shapes(params: float, name: str | None, layers: int, hidden: int, heads: int) -> None:
    """Brown et al. 2020, Table 2.1 (13B's d_model as its 40 heads x 128, not the table's misprinted 5140)."""
    plan = plan_memory(params, gpus_per_node=8)
    assert plan.assumed_shape == name
    assert plan.shape is not None
    assert (plan.shape.layers, plan.shape.hidden, plan.shape.heads) == (layers, hidden, heads)
    assert plan.shape.params == params  # the count given stands
    assert ModelShape(params, layers=2).layers == 2 and plan_memory(ModelShape(params, layers=2)).assumed_shape is None


def test_gpt3_table_matches_narayanans_parameter_count() -> None:
    for name, params, layers, hidden, heads in GPT3_SHAPES:
        counted = ModelShape.decoder(layers, hidden, heads, 50257, positions=2048).params
        assert abs(counted / params - 1) < 0.1, name
        assert hidden % heads == 0 or name == "GPT-3 XL", name


def test_decoder_parameter_count_matches_gpt3() -> None:
    """Narayanan et al. 2021: 12*l*h^2*(1 + 13/(12h) + (V+s)/(12*l*h)) = 174.6B for GPT-3's shape."""
    shape = ModelShape.decoder(96, 12288, 96, 51200, positions=2048)
    layers, h = 96, 12288
    expected = 12 * layers * h * h * (1 + 13 / (12 * h) + (51200 + 2048) / (12 * layers * h))
    assert shape.params == pytest.approx(expected)
    assert round(shape.params / 1e9, 1) == 174.6


# ---------------------------------------------------------------------- tensor, sequence, pipeline parallelism
SBH = 2048 * 12288  # s*h of GPT-3 175B at b = 1


@pytest.mark.parametrize(
    ("tp", "sp", "per_layer"),
    [  # Korthikanti et al. 2022, Table 2, with 5as/h = 5 * 96 * 2048 / 12288 = 80, by hand
        (1, False, 114.0),  # 34 + 80
        (2, False, 62.0),  # 10 + 24/2 + 80/2
        (4, False, 36.0),  # 10 + 6 + 20
        (8, False, 23.0),  # 10 + 3 + 10
        (1, True, 114.0),  # 34/1 + 80/1: the t = 1 case of both formulas is the planner's old one
        (2, True, 57.0),  # 34/2 + 80/2
        (4, True, 28.5),  # 8.5 + 20
        (8, True, 14.25),  # 4.25 + 10
    ],
)
def test_korthikanti_table_2_per_layer_with_tensor_and_sequence_parallelism(
    tp: int, sp: bool, per_layer: float
) -> None:
    s, h, a = 2048, 12288, 96
    paper = 34 / tp + 5 * a * s / (h * tp) if sp else 10 + 24 / tp + 5 * a * s / (h * tp)
    assert paper == per_layer
    acts = activations(GPT3, s, element=2, flash_attention=False, tensor_parallel=tp, sequence_parallel=sp)
    assert acts is not None
    assert acts.layer == pytest.approx(SBH * per_layer, rel=1e-12)
    # output layer (Sec. 4.3): the embedding mask, the final norm's and the projection's inputs (whole on every
    # rank without sequence parallelism), the fp32 logits split over the vocabulary
    whole = SBH / tp if sp else SBH
    assert acts.output == pytest.approx(5 * whole + 4 * s * 51200 / tp)
    assert acts.full == pytest.approx(96 * acts.layer + acts.output)
    # full recomputation keeps each layer's input (Table 2: 2sbh), sequence-split under sequence parallelism
    assert acts.checkpointed == pytest.approx(96 * 2 * whole + acts.layer + acts.output)


def test_flash_attention_scores_split_over_tensor_parallel_ranks() -> None:
    acts = activations(GPT3, 2048, element=2, flash_attention=True, tensor_parallel=8, sequence_parallel=True)
    assert acts is not None
    assert acts.layer == pytest.approx(SBH * 34 / 8 + 4 * 96 * 2048 / 8)


@pytest.mark.parametrize(
    ("pp", "full_layers", "kept"),
    [  # 1F1B: the first stage holds pp micro-batches of its 96/pp layers (Korthikanti et al. Sec. 4.2.3)
        (1, 96, 1),
        (4, 96, 4),  # 4 x 24 layers, and 4 embedding masks
        (16, 96, 16),  # 16 x 6 layers
    ],
)
def test_pipeline_first_stage_holds_l_layers_worth(pp: int, full_layers: int, kept: int) -> None:
    acts = activations(GPT3, 2048, element=2, flash_attention=False, pipeline_parallel=pp)
    assert acts is not None
    logits_and_head = 4 * SBH + 4 * 2048 * 51200
    if pp == 1:
        assert acts.full == pytest.approx(96 * acts.layer + SBH + logits_and_head)
    else:  # the first stage (pp micro-batches) outweighs the last (one micro-batch, the output layer)
        assert acts.full == pytest.approx(full_layers * acts.layer + kept * SBH)
        assert acts.checkpointed == pytest.approx(96 * 2 * SBH + kept * SBH + acts.layer)


@pytest.mark.parametrize(
    ("sharding", "tp", "pp", "gpus", "per_param"),
    [  # bytes per parameter of (params, grads, optimizer) on one GPU, mixed-precision Adam, by hand
        ("none", 8, 1, 8, (2 / 8, 2 / 8, 12 / 8)),  # TP alone splits every model state
        ("none", 2, 4, 8, (2 / 8, 2 / 8, 12 / 8)),  # TP x PP = 8
        ("optimizer", 8, 1, 64, (2 / 8, 2 / 8, 12 / 64)),  # ZeRO-1 over DP 8 of the TP-8 slice
        ("grad_op", 8, 1, 64, (2 / 8, 2 / 64, 12 / 64)),
        ("full", 8, 1, 64, (2 / 64, 2 / 64, 12 / 64)),  # ZeRO-3: 16P/N whatever the TP
        ("full", 1, 1, 64, (2 / 64, 2 / 64, 12 / 64)),
        ("full", 8, 4, 64, (2 / 64, 2 / 64, 12 / 64)),
    ],
)
def test_model_states_with_tensor_and_pipeline_parallelism(
    sharding: str, tp: int, pp: int, gpus: int, per_param: tuple[float, float, float]
) -> None:
    plan = plan_memory(
        GPT3,
        nodes=gpus // 8,
        gpus_per_node=8,
        sharding=sharding,
        tensor_parallel=tp,
        pipeline_parallel=pp,  # type: ignore[arg-type]
    )
    assert plan.data_parallel == gpus // (tp * pp)
    got = (plan.params_bytes, plan.grads_bytes, plan.optimizer_bytes)
    assert got == pytest.approx(tuple(k * 175e9 for k in per_param), abs=1)


def test_tensor_parallel_gathers_a_slice_of_each_unit_and_accumulates_over_data_parallel_ranks() -> None:
    h = 12288
    plan = plan_memory(GPT3, nodes=8, gpus_per_node=8, tensor_parallel=8, effective_batch=1536)
    assert plan.buffers_bytes == round(3 * 2 * (12 * h * h + 13 * h) / 8 + GIB)
    assert plan.accumulation == 1536 // 8 == 192  # 8 data-parallel ranks, not 64 GPUs
    assert "TP 8 x PP 1 x DP 8" in plan.title
    assert "x 8 data-parallel ranks x 192" in plan.table()


def test_advice_names_the_smallest_tensor_parallel_size_that_fits() -> None:
    """GPT-3 175B on 8 x 8 x 80 GiB, sequence parallelism and FlashAttention, no activation checkpointing."""
    s, h, a, v, n = 2048, 12288, 96, 51200, 64
    kwargs = dict(nodes=8, gpus_per_node=8, sequence_parallel=True, flash_attention=True)
    advice = advise_tensor_parallel(GPT3, **kwargs)
    unit = 12 * h * h + 13 * h
    for plan, t in zip(advice.plans, (1, 2, 4, 8), strict=True):
        layer = s * h * 34 / t + 4 * a * s / t
        by_hand = 16 * 175e9 / n + 3 * 2 * unit / t + GIB + 96 * layer + (5 * s * h + 4 * s * v) / t
        assert plan.tensor_parallel == t
        assert plan.total_bytes == pytest.approx(by_hand, abs=2)
    assert [p.fits for p in advice.plans] == [False, False, True, True]  # 129, 85, 64, 53 GiB in 72
    assert advice.smallest == 4
    assert advice.text().startswith("tensor parallel: needed: TP 4 is the smallest size that fits")
    fits = advise_tensor_parallel(GPT3, activation_checkpointing=True, **kwargs)  # type: ignore[arg-type]
    assert fits.smallest == 1 and fits.text().startswith("tensor parallel: not needed: TP 1 fits")
    none = advise_tensor_parallel(GPT3, gpu_memory="40GiB", **kwargs)  # type: ignore[arg-type]
    assert none.smallest is None
    assert "no size up to TP 8 fits" in none.text() and "activation checkpointing" in none.text()
    small = advise_tensor_parallel(ModelShape(125e6, 12, 768, 12, 50257), gpus_per_node=16)
    assert [p.tensor_parallel for p in small.plans] == [1, 2, 4]  # 8 and 16 do not divide the 12 heads


@pytest.mark.parametrize(
    ("kwargs", "argument", "message"),
    [
        ({"gpus_per_node": 8, "tensor_parallel": 3}, "tensor_parallel", "does not divide gpus_per_node=8"),
        ({"gpus_per_node": 4, "tensor_parallel": 8}, "tensor_parallel", "does not divide gpus_per_node=4"),
        ({"gpus_per_node": 8, "tensor_parallel": 0}, "tensor_parallel", "must be an int >= 1"),
        ({"gpus_per_node": 8, "pipeline_parallel": 3}, "pipeline_parallel", "does not divide the 8 GPUs"),
        ({"gpus_per_node": 8, "pipeline_parallel": 128, "nodes": 16}, "pipeline_parallel", "exceeds the 96 layers"),
        ({"sequence_parallel": "yes"}, "sequence_parallel", "must be a bool"),
    ],
)
def test_bad_parallel_sizes_name_the_argument(kwargs: dict[str, object], argument: str, message: str) -> None:
    with pytest.raises(StabilityConfigError, match=rf"`{argument}=.*{message}.*Fix: "):
        plan_memory(GPT3, **kwargs)  # type: ignore[arg-type]
    with pytest.raises(StabilityConfigError, match=r"`tensor_parallel=8` does not divide the 12 attention heads"):
        plan_memory(ModelShape(125e6, 12, 768, 12, 50257), gpus_per_node=8, tensor_parallel=8)


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
        ({"gpu_memory": 80}, "gpu_memory"),  # 80 bytes: the unit left out
        ({"gpu_memory": "80"}, "gpu_memory"),
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
