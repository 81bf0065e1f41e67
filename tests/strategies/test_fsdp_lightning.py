"""From Lightning's ``FSDPStrategy`` to ``StableFSDPStrategy`` by one word: each common configuration maps over, and
our callbacks refuse Lightning's FSDP and DeepSpeed at setup naming the switch."""

from __future__ import annotations

import functools
import logging
import warnings
from typing import Any

import pytest
import torch
from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy
from torch import nn
from torch.distributed.fsdp import CPUOffload, MixedPrecision, ShardingStrategy
from torch.distributed.fsdp.wrap import ModuleWrapPolicy, size_based_auto_wrap_policy, transformer_auto_wrap_policy

from lightning_stability import (
    GradientAccumulation,
    GradientNormMonitor,
    LossScaleTuner,
    StabilityConfigError,
    StableTrainer,
    TrainingHealthMonitor,
    WarmupConstantCosineLR,
)
from lightning_stability.ledger.callback import refuse_foreign_sharding
from lightning_stability.strategies.fsdp import StableFSDPStrategy
from lightning_stability.strategies.fsdp_wrap import select_blocks
from tests.distributed.fsdp_common import Block, TinyGPT
from tests.helpers import TinyModule, quiet_trainer

warnings.filterwarnings("ignore", ".*activation_checkpointing.*is deprecated.*")


def bf16_mixed() -> MixedPrecision:
    return MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.bfloat16)


#: common FSDPStrategy(...) configurations, as Lightning's docs and users write them
CONFIGS: list[dict[str, Any]] = [
    {},
    {"sharding_strategy": "FULL_SHARD"},
    {"sharding_strategy": "SHARD_GRAD_OP"},
    {"sharding_strategy": ShardingStrategy.SHARD_GRAD_OP},
    {"sharding_strategy": "HYBRID_SHARD", "auto_wrap_policy": {Block}},
    {"sharding_strategy": "_HYBRID_SHARD_ZERO2", "device_mesh": (2, 4)},
    {"sharding_strategy": "hybrid_shard", "device_mesh": (2, 4)},
    {"auto_wrap_policy": {Block}},
    {"auto_wrap_policy": ModuleWrapPolicy({Block, nn.Linear})},
    {"auto_wrap_policy": functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})},
    {"auto_wrap_policy": functools.partial(size_based_auto_wrap_policy, min_num_params=500)},
    {"activation_checkpointing_policy": {Block}},
    {"activation_checkpointing_policy": ModuleWrapPolicy({Block})},
    {"activation_checkpointing": Block},
    {"activation_checkpointing": [Block, nn.Linear]},
    {"cpu_offload": True},
    {"cpu_offload": CPUOffload(offload_params=True)},
    {"cpu_offload": False},
    {"mixed_precision": bf16_mixed()},
    {"mixed_precision": MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float16)},
    {"state_dict_type": "full"},
    {"state_dict_type": "sharded"},
    {"process_group_backend": "gloo"},
    {"limit_all_gathers": True, "use_orig_params": True, "forward_prefetch": True},
    {"sync_module_states": False},
    {
        "sharding_strategy": "SHARD_GRAD_OP",
        "auto_wrap_policy": {Block},
        "activation_checkpointing_policy": {Block},
        "mixed_precision": bf16_mixed(),
        "state_dict_type": "sharded",
        "limit_all_gathers": True,
    },
]


def expected_from(lightning: FSDPStrategy) -> dict[str, Any]:
    """What Lightning's FSDPStrategy made of the arguments, in StableFSDPStrategy's terms."""
    name = lightning.sharding_strategy.name
    policy = lightning.kwargs.get("auto_wrap_policy")
    ac = lightning._activation_checkpointing_kwargs
    ac_classes: Any = False
    if "check_fn" in ac:  # Lightning's deprecated activation_checkpointing=: a check on the classes
        ac_classes = {c for c in (Block, nn.Linear, nn.LayerNorm) if ac["check_fn"](c.__new__(c))}
    elif "auto_wrap_policy" in ac:
        ac_classes = set(ac["auto_wrap_policy"]._module_classes)
    mp = lightning.mixed_precision
    return {
        "sharding": "hybrid" if "HYBRID" in name else "full",
        "reshard_after_forward": name in ("FULL_SHARD", "HYBRID_SHARD"),
        "policy": set(policy._module_classes) if isinstance(policy, ModuleWrapPolicy) else policy,
        "activation_checkpointing": ac_classes,
        "cpu_offload": lightning.cpu_offload.offload_params,
        "param_dtype": mp.param_dtype if mp is not None else None,
        "reduce_dtype": mp.reduce_dtype if mp is not None else None,
        "state_dict_type": lightning._state_dict_type,
        "mesh_shape": lightning.kwargs.get("device_mesh"),
    }


def ours(stable: StableFSDPStrategy) -> dict[str, Any]:
    cfg = stable._cfg
    ac = cfg.activation_checkpointing
    return {
        "sharding": cfg.sharding,
        "reshard_after_forward": cfg.reshard_after_forward,
        "policy": cfg.policy,
        "activation_checkpointing": set(ac) if isinstance(ac, tuple) else ac,
        "cpu_offload": cfg.cpu_offload,
        "param_dtype": cfg.mp_policy.param_dtype if cfg.mp_policy is not None else None,
        "reduce_dtype": cfg.mp_policy.reduce_dtype if cfg.mp_policy is not None else None,
        "state_dict_type": cfg.state_dict_type,
        "mesh_shape": cfg.mesh_shape,
    }


@pytest.mark.parametrize("kwargs", CONFIGS, ids=lambda k: ",".join(f"{a}" for a in k) or "defaults")
def test_each_common_fsdpstrategy_configuration_maps_over(kwargs: dict[str, Any]) -> None:
    lightning = FSDPStrategy(**kwargs)
    stable = StableFSDPStrategy(**kwargs)
    expected, got = expected_from(lightning), ours(stable)
    if "state_dict_type" not in kwargs:  # the one default that differs: said in the docs' table
        assert (expected.pop("state_dict_type"), got.pop("state_dict_type")) == ("full", "sharded")
    if isinstance(got["policy"], int):  # size_based_auto_wrap_policy: its min_num_params
        assert expected["policy"].keywords["min_num_params"] == got["policy"]
        expected["policy"] = got["policy"]
    if isinstance(expected["policy"], functools.partial):  # transformer_auto_wrap_policy: its classes
        expected["policy"] = set(expected["policy"].keywords["transformer_layer_cls"])
    assert got == expected


def test_wrap_policies_select_the_modules_fsdp1_would_wrap() -> None:
    model = TinyGPT(d=16, layers=2, heads=2)
    blocks = [m for m in model.modules() if isinstance(m, Block)]
    for policy in (
        {Block},
        ModuleWrapPolicy({Block}),
        functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block}),
    ):
        assert select_blocks(model, StableFSDPStrategy(auto_wrap_policy=policy)._cfg.policy) == blocks
    # size based: bottom-up, every module whose parameters not inside a wrapped descendant reach the count
    per_block = sum(p.numel() for p in blocks[0].parameters())
    chosen = select_blocks(
        model,
        StableFSDPStrategy(
            auto_wrap_policy=functools.partial(size_based_auto_wrap_policy, min_num_params=per_block)
        )._cfg.policy,
    )
    assert all(sum(p.numel() for p in m.parameters()) >= per_block for m in chosen) and blocks[0] in chosen


def test_an_fsdp1_callable_policy_is_asked_per_module_as_a_leaf() -> None:
    seen: list[tuple[str, bool, int]] = []

    def policy(module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
        seen.append((type(module).__name__, recurse, nonwrapped_numel))
        return isinstance(module, Block)

    model = TinyGPT(d=16, layers=2, heads=2)
    chosen = select_blocks(model, StableFSDPStrategy(auto_wrap_policy=policy)._cfg.policy)
    assert chosen == [m for m in model.modules() if isinstance(m, Block)]
    assert all(recurse is False for _, recurse, _ in seen)
    total = sum(p.numel() for p in model.parameters())
    in_blocks = sum(p.numel() for m in chosen for p in m.parameters())
    top = [n for name, _, n in seen if name == "ModuleList"]
    assert top == [0]  # its blocks were wrapped already: nothing of its own left
    assert total > in_blocks


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"sharding_strategy": "NO_SHARD"}, r"`sharding_strategy='NO_SHARD'` shards nothing.*Fix: use strategy='ddp'"),
        ({"sharding_strategy": "ZERO3"}, r"`sharding_strategy='ZERO3'` is not one of FSDPStrategy's"),
        ({"sharding_strategy": "SHARD_GRAD_OP", "sharding": "hybrid"}, r"`sharding_strategy=.*given together"),
        ({"sync_module_states": True}, r"`sync_module_states=True` broadcasts rank 0's weights.*Fix: seed"),
        ({"process_group": object()}, r"`process_group=.*no FSDP2 meaning.*Fix: pass device_mesh"),
        ({"ignored_modules": [nn.Linear(1, 1)]}, r"`ignored_modules=.*Fix: keep those modules out"),
        ({"param_init_fn": lambda m: m}, r"`param_init_fn=.*Fix: initialise in configure_model"),
        ({"activation_checkpointing_policy": lambda m, r, n: True}, r"is a callable policy.*Fix: pass the classes"),
        (
            {"activation_checkpointing_policy": {Block}, "activation_checkpointing": Block},
            r"`activation_checkpointing_policy=.*given together with activation_checkpointing",
        ),
        (
            {"mixed_precision": MixedPrecision(param_dtype=torch.bfloat16, keep_low_precision_grads=True)},
            r"keeps low-precision gradients.*Fix: drop keep_low_precision_grads",
        ),
    ],
)
def test_what_cannot_map_is_refused_naming_the_argument(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(StabilityConfigError, match=match):
        StableFSDPStrategy(**kwargs)


def test_keywords_without_effect_are_said_once(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO):
        StableFSDPStrategy(limit_all_gathers=True, use_orig_params=True)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("StableFSDPStrategy:")]
    assert len(lines) == 1
    assert "limit_all_gathers=True: no effect" in lines[0] and "use_orig_params=True: no effect" in lines[0]


class CPUFSDP(FSDPStrategy):
    """Lightning's FSDPStrategy unchanged; a subclass only so that the Trainer builds it on a CPU."""


@pytest.fixture(autouse=True)
def no_process_group_left() -> Any:
    """FSDPStrategy's setup starts a process group, and a fit that fails at setup leaves it: end it."""
    yield
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


@pytest.mark.parametrize(
    "callback",
    [
        GradientNormMonitor,
        WarmupConstantCosineLR,
        TrainingHealthMonitor,
        LossScaleTuner,
        lambda: GradientAccumulation(2),
    ],
)
def test_our_callbacks_refuse_lightnings_fsdp_at_setup_naming_the_switch(callback: Any, tmp_path: Any) -> None:
    trainer = quiet_trainer(max_steps=1, strategy=CPUFSDP(), default_root_dir=tmp_path, callbacks=[callback()])
    with pytest.raises(
        StabilityConfigError,
        match=r"under Lightning's FSDPStrategy.*FSDPStrategy\(\.\.\.\) -> "
        r"StableFSDPStrategy\(\.\.\.\) with the same arguments.*ModelParallelStrategy",
    ):
        trainer.fit(TinyModule())


def test_every_preset_refuses_lightnings_fsdp_naming_the_switch(tmp_path: Any) -> None:
    for name in ("gpt", "over-10b"):  # (fp16 on a CPU needs a scaler plugin, which FSDPStrategy refuses)
        trainer = StableTrainer.from_preset(
            name,
            accelerator="cpu",
            devices=1,
            strategy=CPUFSDP(),
            logger=False,
            default_root_dir=tmp_path,
            enable_progress_bar=False,
        )
        with pytest.raises(StabilityConfigError, match=r"strategy='fsdp' -> strategy='stable_fsdp'"):
            trainer.fit(TinyModule(n=512))


def test_deepspeed_is_refused_naming_the_alternatives() -> None:
    # DeepSpeed is not installed here: its strategy cannot be built, only recognised (the check is by class)
    strategy = DeepSpeedStrategy.__new__(DeepSpeedStrategy)
    with pytest.raises(
        StabilityConfigError,
        match=r"under DeepSpeedStrategy.*Fix: shard with StableFSDPStrategy.*"
        r"ModelParallelStrategy",
    ):
        refuse_foreign_sharding(strategy, "GradientNormMonitor")
