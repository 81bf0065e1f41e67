"""StableFSDPStrategy without processes: arguments, wrap policies, precision mapping, clipping math, errors."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator

import pytest
import torch
from lightning.pytorch.strategies import StrategyRegistry
from torch import nn

from lightning_stability.errors import StabilityConfigError
from lightning_stability.strategies import fsdp_backend, mesh
from lightning_stability.strategies.fsdp import StableFSDPStrategy
from lightning_stability.strategies.fsdp_checkpoint import index_keyed, name_keyed, optimizer_param_names
from lightning_stability.strategies.fsdp_config import resolve_mixed_precision
from lightning_stability.strategies.fsdp_precision import StableFSDPPrecision
from lightning_stability.strategies.fsdp_wrap import (
    check_wraps_something,
    describe_classes,
    find_repeated_blocks,
    select_blocks,
    top_level_units,
)
from tests.distributed.fsdp_common import Block, TinyGPT, TinyLM
from tests.helpers import TinyModule, quiet_trainer


@pytest.fixture
def clean_env() -> Iterator[None]:
    """Lightning's launcher writes MASTER_PORT & co. into os.environ even for one process: undo it."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


# ---------------------------------------------------------------------- construction errors
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"auto_wrap_polcy": {Block}}, r"`auto_wrap_polcy=.*` is not a keyword.*did you mean `auto_wrap_policy`"),
        ({"bucket_cap_mb": 25}, r"`bucket_cap_mb=25` is a FairScale keyword.*the unit is the bucket"),
        ({"move_grads_to_cpu": True}, r"move_grads_to_cpu.*FairScale keyword.*cpu_offload=True"),
        ({"backend": "deepspeed"}, r"`backend='deepspeed'` is not a backend"),
        ({"mixed_precision": "fp8"}, r"`mixed_precision='fp8'` is not a precision"),
        ({"reduce_dtype": torch.int8}, r"`reduce_dtype=torch.int8` is not a floating dtype"),
        ({"cpu_offload": "yes"}, r"`cpu_offload='yes'` must be a bool"),
        ({"flatten_parameters": 1}, r"`flatten_parameters=1` must be a bool"),
        ({"reshard_after_forward": 1}, r"`reshard_after_forward=1` must be a bool or a group size >= 2"),
        ({"auto_wrap_policy": 0}, r"`auto_wrap_policy=0` must be a parameter count >= 1"),
        ({"auto_wrap_policy": [Block, "Linear"]}, r"must hold nn.Module subclasses only"),
        ({"auto_wrap_policy": True}, r"`auto_wrap_policy=True` is not a policy"),
        (
            {"activation_checkpointing": ["Block"]},
            r"`activation_checkpointing=\[.Block.\]` must be a bool or module classes",
        ),
        ({"sharding": "zero3"}, r"`sharding='zero3'` is not a sharding mode"),
        ({"device_mesh": (2, 2)}, r"`device_mesh=\(2, 2\)` must be a \(replicas, shard_size\) pair.*sharding='hybrid'"),
        ({"sharding": "hybrid", "device_mesh": (2, 0)}, r"`device_mesh=\(2, 0\)` must be"),
        ({"state_dict_type": "local"}, r"`state_dict_type='local'` is not a checkpoint layout"),
        ({"backend": "fairscale", "state_dict_type": "sharded"}, r"not available with backend='fairscale'"),
        ({"backend": "fairscale", "sharding": "hybrid"}, r"`sharding='hybrid'` is not available with backend='fair"),
        ({"backend": "fairscale", "bucket_kap_mb": 3}, r"did you mean `bucket_cap_mb`"),
        ({"tensor_parallel": 0}, r"`tensor_parallel=0` must be an int >= 1.*tensor_parallel=2"),
        ({"tensor_parallel": True}, r"`tensor_parallel=True` must be an int >= 1"),
        ({"backend": "fairscale", "tensor_parallel": 2}, r"`tensor_parallel=2` is not available with backend='fai"),
    ],
)
def test_bad_arguments_fail_at_construction(kwargs: dict, match: str) -> None:
    with pytest.raises(StabilityConfigError, match=match):
        StableFSDPStrategy(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "nodes", "devices", "match"),
    [
        (
            {"tensor_parallel": 2},
            1,
            3,
            r"`tensor_parallel=2` does not divide the 3 devices per node \(1 nodes x 3 devices",
        ),
        ({"tensor_parallel": 4}, 2, 2, r"`tensor_parallel=4` does not divide the 2 devices per node.*within a node"),
        (
            {"tensor_parallel": 2, "sharding": "hybrid", "device_mesh": (2, 2)},
            1,
            4,
            r"`device_mesh=\(2, 2\)` does not cover the 2 data-parallel ranks \(4 / 2\).*product is 2",
        ),
    ],
)
def test_a_tensor_parallel_mesh_that_does_not_fit_the_world_names_the_argument(
    kwargs: dict, nodes: int, devices: int, match: str
) -> None:
    cfg = StableFSDPStrategy(**kwargs)._cfg
    with pytest.raises(StabilityConfigError, match=match):
        mesh.build_mesh(cfg, nodes, devices, "cpu")


def test_fairscale_backend_accepts_the_seeds_keywords_and_its_own() -> None:
    strategy = StableFSDPStrategy(
        backend="fairscale", mixed_precision=True, flatten_parameters=True, cpu_offload=True, bucket_cap_mb=25
    )
    assert strategy._cfg.state_dict_type == "full"
    assert strategy._cfg.fairscale_kwargs == {"bucket_cap_mb": 25}


def test_seed_keywords_map_to_fsdp2_and_flatten_parameters_is_explained_once(caplog) -> None:
    fsdp_backend._FLATTEN_EXPLAINED = False
    with caplog.at_level(logging.INFO):
        strategy = StableFSDPStrategy(mixed_precision=True, flatten_parameters=True, cpu_offload=True)
        StableFSDPStrategy(flatten_parameters=False)
    explained = [r for r in caplog.records if "flatten_parameters" in r.getMessage()]
    assert len(explained) == 1 and "no FSDP2 equivalent" in explained[0].getMessage()
    plugin = strategy.precision_plugin  # mixed_precision=True: FairScale's fp16 compute, fp32 master weights
    assert plugin.precision == "16-mixed" and plugin.param_dtype == torch.float16
    policy = plugin.mp_policy()
    assert policy.param_dtype == torch.float16 and policy.reduce_dtype == torch.float32
    assert type(plugin.scaler).__name__ == "ShardedGradScaler"


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, None),
        (True, "16-mixed"),
        (False, "32-true"),
        ("bf16-mixed", "bf16-mixed"),
        (torch.bfloat16, "bf16-mixed"),
        (torch.float16, "16-mixed"),
        ("bf16-true", "bf16-true"),
    ],
)
def test_mixed_precision_values(value: object, expected: str | None) -> None:
    assert resolve_mixed_precision(value)[0] == expected


def test_trainer_precision_becomes_fsdp2_policy_with_fp32_reduction() -> None:
    trainer = quiet_trainer(precision="bf16-mixed", strategy=StableFSDPStrategy(), devices=1)
    plugin = trainer.precision_plugin
    assert isinstance(plugin, StableFSDPPrecision) and trainer.precision == "bf16-mixed"
    assert plugin.scaler is None
    assert plugin.mp_policy().param_dtype == torch.bfloat16 and plugin.mp_policy().reduce_dtype == torch.float32
    root = plugin.mp_policy(cast_forward_inputs=False)
    assert root.cast_forward_inputs is False
    reduce_in_bf16 = quiet_trainer(precision="bf16-mixed", strategy=StableFSDPStrategy(reduce_dtype=None), devices=1)
    assert reduce_in_bf16.precision_plugin.mp_policy().reduce_dtype is None


def test_registered_with_lightning() -> None:
    assert "stable_fsdp" in StrategyRegistry
    trainer = quiet_trainer(strategy="stable_fsdp", devices=1)
    assert isinstance(trainer.strategy, StableFSDPStrategy)
    assert trainer._accelerator_connector.is_distributed


def test_disagreeing_precisions_fail_at_trainer_construction() -> None:
    with pytest.raises(StabilityConfigError, match=r"mixed_precision -> '16-mixed'.*precision='bf16-mixed'.*disagree"):
        quiet_trainer(precision="bf16-mixed", strategy=StableFSDPStrategy(mixed_precision=True))
    with pytest.raises(StabilityConfigError, match=r"cannot use the precision plugin DoublePrecision"):
        quiet_trainer(precision="64-true", strategy=StableFSDPStrategy())


# ---------------------------------------------------------------------- setup errors (before any process group)
def test_cpu_offload_on_a_cpu_run_fails_at_setup(clean_env) -> None:
    trainer = quiet_trainer(strategy=StableFSDPStrategy(cpu_offload=True), devices=1, max_steps=1)
    with pytest.raises(StabilityConfigError, match=r"`cpu_offload=True` moves parameters.*already the CPU.*nothing"):
        trainer.fit(TinyModule())


def test_fairscale_backend_on_cpu_names_the_native_backend(clean_env) -> None:
    trainer = quiet_trainer(strategy=StableFSDPStrategy(backend="fairscale"), devices=1, max_steps=1)
    with pytest.raises(StabilityConfigError, match=r"needs CUDA.*StableFSDPStrategy\(backend='native'\)"):
        trainer.fit(TinyModule())


# ---------------------------------------------------------------------- wrap policies (pure)
def test_default_policy_finds_the_transformer_blocks() -> None:
    model = TinyGPT(layers=3)
    assert select_blocks(model, None) == list(model.blocks)  # not the Linear layers inside them, nor the head
    assert top_level_units(TinyLM(), select_blocks(TinyLM(), None))[0].__class__ is TinyGPT


def test_default_policy_on_an_mlp_wraps_its_layers() -> None:
    module = TinyModule()
    assert select_blocks(module, None) == [m for m in module.net if isinstance(m, nn.Linear)]
    assert top_level_units(module, select_blocks(module, None)) == []


def test_explicit_policies_select_children_before_parents() -> None:
    model = TinyGPT(layers=2)
    linears = select_blocks(model, {nn.Linear})
    assert len(linears) == 2 * 4 + 1 and all(isinstance(m, nn.Linear) for m in linears)
    assert select_blocks(model, lambda m: isinstance(m, Block)) == list(model.blocks)
    by_size = select_blocks(model, 2000)  # the MLPs (2128 parameters) before their block can count them
    assert [type(m) for m in by_size] == [nn.Sequential, nn.Sequential]
    assert find_repeated_blocks(nn.Linear(2, 2)) == []


@pytest.fixture
def one_process_mesh(tmp_path) -> Iterator[object]:
    """A real 1-rank gloo group and its device mesh (no other process)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,), mesh_dim_names=("tensor_parallel",))
    finally:
        dist.destroy_process_group()


def test_a_parameter_count_policy_counts_the_slice_a_rank_holds_under_tensor_parallelism(one_process_mesh) -> None:
    """Each MLP split as a 2-way tensor-parallel plan splits it (its first linear by rows, the second by columns;
    the DTensors declare the global shape, as on a 2-rank mesh): the count is of the local slices, so the
    2000-element units are the blocks (2176 local elements), no longer the MLPs (2128 in all, 1072 per rank)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    def split(param: nn.Parameter, dim: int) -> nn.Parameter:
        shape = param.shape
        local = param.detach().chunk(2, dim=dim)[0].contiguous()
        dt = DTensor.from_local(
            local, one_process_mesh, [Shard(dim)], run_check=False, shape=shape, stride=param.stride()
        )
        return nn.Parameter(dt)

    model = TinyGPT(layers=2)
    for block in model.blocks:
        up, down = block.mlp[0], block.mlp[2]
        up.weight, up.bias = split(up.weight, 0), split(up.bias, 0)
        down.weight = split(down.weight, 1)
        down.bias = nn.Parameter(DTensor.from_local(down.bias.detach(), one_process_mesh, [Replicate()]))
        assert up.weight.numel() == 64 * 16 and up.weight.to_local().numel() == 32 * 16
    assert select_blocks(model, 2000) == list(model.blocks)
    whole = TinyGPT(layers=2)  # the same model without the split: its MLPs reach 2000 first
    assert select_blocks(whole, 2000) == [block.mlp for block in whole.blocks]


def test_policy_that_wraps_nothing_is_an_error_naming_what_could_be_wrapped() -> None:
    model = TinyLM()
    blocks = select_blocks(model, {nn.Conv2d})
    with pytest.raises(StabilityConfigError, match=r"`auto_wrap_policy=\{<class .*Conv2d'>\}` wraps no module of Ti"):
        check_wraps_something({nn.Conv2d}, blocks, model)
    assert "Block x2" in describe_classes(model)
    check_wraps_something(None, [], model)  # the default may find no repeated block: root-only sharding


# ---------------------------------------------------------------------- clipping and loss scaling math
def _grads(model: nn.Module, scale: float = 1.0) -> None:
    torch.manual_seed(0)
    out = model(torch.randn(16, 8)).pow(2).sum() * scale
    out.backward()


@pytest.mark.parametrize(("fused", "clip_factor"), [(False, 0.5), (True, 0.5), (True, 2.0)])
def test_clip_by_global_norm_equals_torch_and_unscales_fused_first(fused: bool, clip_factor: float) -> None:
    module, reference = TinyModule(), TinyModule()
    reference.load_state_dict(module.state_dict())
    _grads(reference)
    clip_val = clip_factor * float(torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()]))
    torch.nn.utils.clip_grad_norm_(reference.parameters(), clip_val)  # clip_factor 2: changes nothing
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    plugin = StableFSDPPrecision("16-mixed", scaler=scaler, device_type="cpu")
    optimizer = torch.optim.AdamW(module.parameters(), fused=fused or None)
    if fused:  # fused optimizers reach clipping with their gradients still scaled
        _grads(module, scale=float(scaler.scale(torch.ones(()))))
    else:
        _grads(module)
    plugin.clip_gradients(optimizer, clip_val)
    for p, q in zip(module.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)


def test_scaler_only_where_it_belongs() -> None:
    assert StableFSDPPrecision("bf16-mixed").scaler is None
    assert StableFSDPPrecision("16-true").scaler is None
    with pytest.raises(StabilityConfigError, match=r"`scaler=.*` is only used with '16-mixed'"):
        StableFSDPPrecision("bf16-mixed", scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(StabilityConfigError, match=r"`precision='64-true'` is not supported"):
        StableFSDPPrecision("64-true")


def test_true_half_converts_the_module() -> None:
    plugin = StableFSDPPrecision("bf16-true")
    assert plugin.convert_module(TinyModule()).net[0].weight.dtype == torch.bfloat16
    with plugin.module_init_context():
        assert nn.Linear(2, 2).weight.dtype == torch.bfloat16
    assert torch.get_default_dtype() == torch.float32


# ---------------------------------------------------------------------- optimizer keys of full checkpoints
def test_optimizer_state_rekeying_round_trip() -> None:
    module = TinyModule()
    optimizer = torch.optim.AdamW(module.parameters())
    _grads(module)
    optimizer.step()
    names = optimizer_param_names(module, optimizer)
    by_index = optimizer.state_dict()
    by_name = name_keyed(by_index, names)
    assert set(by_name["state"]) == {n for n, _ in module.named_parameters()}
    assert name_keyed(by_name, names) is by_name  # already by name
    back = index_keyed(by_name)
    fresh = torch.optim.AdamW(TinyModule().parameters())
    fresh.load_state_dict(back)
    for i, state in by_index["state"].items():
        torch.testing.assert_close(fresh.state_dict()["state"][i]["exp_avg"], state["exp_avg"])


def test_gradient_norm_monitor_refuses_fairscale_flat_shards_and_names_the_trainer_clip() -> None:
    """The refusal is the callback's (it reads the strategy's ``gradients_are_local_shards``): strategies/ imports
    no callback."""
    from lightning_stability.grad_norm import GradientNormMonitor

    trainer = quiet_trainer(strategy=StableFSDPStrategy(backend="fairscale"), devices=1)
    assert trainer.strategy.gradients_are_local_shards and not StableFSDPStrategy().gradients_are_local_shards
    with pytest.raises(StabilityConfigError, match=r"flat local shards.*backend='native'.*gradient_clip_val"):
        GradientNormMonitor(max_norm=1.0).on_setup(trainer, TinyModule())
