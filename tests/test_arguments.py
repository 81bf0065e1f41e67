"""Every argument of every public entry point is checked: a wrong type or value gets ``StabilityConfigError``
naming the argument, the value and the fix (the package's message layout: ``\\`name=value\\` ... Fix: ...``)."""

from __future__ import annotations

import inspect
import re
import signal
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

import lightning_stability as ls
from lightning_stability import StabilityConfigError


class Wrong:
    """A value of no type any argument accepts."""

    def __repr__(self) -> str:
        return "Wrong()"


WRONG = Wrong()


class _Module(pl.LightningModule):
    """A LightningModule with one submodule, for BitFlip (a hook that got through would touch nothing trained)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(2, 2)


class _Attention(nn.Module):
    """An attention module of this test's own (a registration that got through would touch no real one)."""


#: public name -> (a call with its required arguments, given the keyword under test; the wrong values to try per
#: argument beyond WRONG, which every argument is tried with)
Entry = tuple[Callable[..., Any], dict[str, list[Any]]]


def call(fn: Callable[..., Any], **required: Any) -> Callable[..., Any]:
    return lambda **kw: fn(**{**required, **kw})


def lengths() -> dict[str, list[Any]]:
    return {"warmup": [-0.1, 1.5, None], "min_lr_ratio": [1.5, -1]}


class _NotARouter(nn.Module):
    """A module class that register_router's refusals are tried with (each call fails before it registers)."""


ENTRIES: dict[str, Entry] = {
    "GradientAccumulation": (
        ls.GradientAccumulation,
        {"steps": [0, {0: 0}, {-1: 2}], "lr_scaling": ["cubic"], "batchnorm": ["drop"], "log_every_n_steps": [0]},
    ),
    "GradientNormMonitor": (
        ls.GradientNormMonitor,
        {
            "max_norm": [0, -1.0, float("nan")],
            "norm_type": [0, "l2"],
            "log_every_n_steps": [0],
            "per_layer": [-1],
            "skip_nonfinite": [1],
            "warn_top_k": [-1],
            "check_replicas": ["yes"],
        },
    ),
    "LossScaleTuner": (
        ls.LossScaleTuner,
        {
            "init_scale": [0, "big"],
            "growth_factor": [1.0, 0.5],
            "backoff_factor": [1.5, 0],
            "growth_interval": [0],
            "hysteresis": [0],
            "min_scale": [0, -1],
            "on_min_scale": ["ignore"],
            "consecutive_hysteresis": [1],
            "overflow_window": [0],
            "max_overflow_rate": [1.5, 0],
            "auto_headroom": [0],
            "log_every_n_steps": [0],
            "fit_start_checks": [1],
        },
    ),
    "TunedGradScaler": (
        call(ls.TunedGradScaler, device="cpu"),
        {
            "device": [3],
            "init_scale": [0],
            "growth_factor": [1.0],
            "backoff_factor": [1.5],
            "growth_interval": [0],
            "hysteresis": [0],
            "min_scale": [-1],
            "consecutive_hysteresis": [1],
            "overflow_window": [0],
            "auto_headroom": [0],
            "process_group": [3],
            "enabled": [1],
        },
    ),
    "ScheduledLR": (
        call(ls.ScheduledLR, schedule=ls.CosineSchedule()),
        {"schedule": [3], "total_steps": [0, [1, 0]], "log_every_n_steps": [0]},
    ),
    "WarmupConstantCosineLR": (
        ls.WarmupConstantCosineLR,
        {**lengths(), "decay": [-0.5, 2.5], "total_steps": [0], "log_every_n_steps": [0]},
    ),
    "WarmupConstantCosineSchedule": (ls.WarmupConstantCosineSchedule, {**lengths(), "decay": [-1]}),
    "CosineSchedule": (ls.CosineSchedule, lengths()),
    "LinearSchedule": (ls.LinearSchedule, lengths()),
    "InverseSqrtSchedule": (ls.InverseSqrtSchedule, lengths()),
    "StepSchedule": (
        ls.StepSchedule,
        {**lengths(), "gamma": [0, 1.5], "every": [0, -2], "milestones": [(-1,), "3"]},
    ),
    "TrainingHealthMonitor": (
        ls.TrainingHealthMonitor,
        {
            "response": ["panic"],
            "spike_z": [0, -1],
            "clip_z": [0],
            "alpha": [0, 1.5],
            "warmup_steps": [0],
            "snapshot_every": [0],
            "skip_batches": [-1],
            "max_rollbacks": [-1],
            "max_disk_rollbacks": [-1],
            "memory_warn_fraction": [0, 1.5],
            "top_modules": [-1],
            "report": [1],
            "report_dir": [3],
            "skip_on": ["grad", "loss"],  # "loss" with the default response="warn"
            "log_every_n_steps": [0],
        },
    ),
    "PrecursorMonitor": (
        ls.PrecursorMonitor,
        {
            "attention": [1],
            "log_partition": [3],
            "qk_clip": [0, -1.0],
            "qk_clip_alpha": [1.5, True],
            "update_clip": [0],
            "lr_backoff": [0.02],
            "reset_moments": [1],
            "reset_ratio": [0],
            "other_optimizers": ["ignore"],
            "log_every_n_steps": [0],
        },
    ),
    "get_preset": (ls.get_preset, {"name": ["nope", 3]}),
    "LRBackoff": (
        ls.LRBackoff,
        {
            "signal": ["loss"],
            "threshold": [0],
            "factor": [1.0, 0],
            "recovery": [1.0],
            "floor": [-1.0],
            "every": [0, 1.5],
            "efficiency": [1.5, 0],
            "ceiling": [0, -1.0],
        },
    ),
    "CriticalBatchMonitor": (
        ls.CriticalBatchMonitor,
        {"micro_batch_size": [0, 2.5], "ema_decay": [1.5, -0.1], "log_every_n_steps": [0]},
    ),
    "BatchRamp": (
        lambda **kw: ls.BatchRamp(**{"max_factor": 8, **kw}),
        {
            "max_factor": [1, 0],
            "growth": [1],
            "warmup_steps": [-1],
            "fraction": [0, -0.5, float("inf")],
            "confidence": [-1, float("nan")],
            "beta2_half_life": [1],
            "micro_batch_size": [0],
            "ema_decay": [1.5],
            "log_every_n_steps": [0],
        },
    ),
    "register_attention": (
        lambda **kw: ls.register_attention(**{"cls": _Attention, "fn": lambda module, args, kwargs: None, **kw}),
        {"cls": [int, nn.Linear(2, 2)], "fn": [3], "projection": [3]},
    ),
    "StepReplay": (
        ls.StepReplay,
        {
            "max_faults": [0, 1.5],
            "fault_window": [0],
            "quarantine_file": [3],
            "rng_states": ["numpy", None],
            "log_every_n_steps": [0],
        },
    ),
    "BitFlip": (
        lambda **kw: ls.BitFlip(**{"module": _Module(), "layer": "net", "step": 3, **kw}),
        {
            "module": [nn.Linear(2, 2)],
            "layer": ["nope", 3],
            "step": [-1, [1, "2"], []],
            "rank": [-1],
            "bit": [-1, 1.5],
            "element": [-1],
            "runs": [(-1,), "0"],
        },
    ),
    "PoisonedSamples": (
        lambda **kw: ls.PoisonedSamples(**{"dataset": [1, 2, 3], "indices": [1], **kw}),
        {"dataset": [3], "indices": [-1, "1"], "value": ["nan", True]},
    ),
    "read_quarantine": (ls.read_quarantine, {"path": [3, "no/such/quarantine.json"]}),
    "read_incidents": (ls.read_incidents, {"directory": [3, "no/such/directory"]}),
    "format_incidents": (ls.format_incidents, {"incidents": [3, "a page", [3]]}),
    "ClusterHealthMonitor": (
        ls.ClusterHealthMonitor,
        {"straggler_factor": [1.0, 0], "weight_hash_every": [0], "straggler_min_gap_s": [-1], "log_every_n_steps": [0]},
    ),
    "LedgerCallback": (ls.LedgerCallback, {"log_every_n_steps": [0, -1]}),
    "StepLedger": (ls.StepLedger, {"trainer": [3]}),
    "RouterHealthMonitor": (
        ls.RouterHealthMonitor,
        {
            "expert_shares": [1, "yes"],
            "log_every_n_steps": [0],
            "z_loss": [-1.0, "1e-3"],
            "logit_clip": [-1.0, "30"],
            "balance_bias": [-1.0, "1e-3"],
        },
    ),
    "register_router": (call(ls.register_router, cls=_NotARouter), {"cls": [3, int], "routing": [3], "spec": [3]}),
    "check_training_status": (call(ls.check_training_status, model=nn.Linear(2, 2)), {"model": [3], "verbose": [1]}),
    "PreemptionCheckpoint": (ls.PreemptionCheckpoint, {"signals": [["TERM"], "SIGTERM", [signal.SIGKILL]]}),
    "StableCheckpoint": (
        ls.StableCheckpoint,
        {
            "dirpath": [3],
            "filename": [3],
            "monitor": [3],
            "verbose": [1],
            "save_last": ["sometimes"],
            "save_top_k": [-2],
            "keep": [0],
            "signals": [["TERM"]],
            "save_at_end": [1],
            "save_weights_only": [1],
            "mode": ["median"],
            "auto_insert_metric_name": [1],
            "every_n_train_steps": [-1],
            "train_time_interval": [3],
            "every_n_epochs": [-1],
            "save_on_train_epoch_end": [1],
            "enable_version_counter": [1],
            "async_save": [1],
        },
    ),
    "verify_checkpoint": (call(ls.verify_checkpoint, path="."), {"path": [3], "meta_file": [3]}),
    "consolidate_checkpoint": (
        call(ls.consolidate_checkpoint, sharded_dir=".", out_file="out.pt"),
        {"sharded_dir": [3], "out_file": [3], "weights_only": [1]},
    ),
    "watchdog_environment": (call(ls.watchdog_environment, existing_env={}), {"existing_env": [3], "dump_prefix": [3]}),
    "watchdog_settings": (
        call(ls.watchdog_settings, existing_env={}),
        {"existing_env": [3], "timeout": [5, timedelta(0)], "dump_prefix": [3]},
    ),
    "StableFSDPStrategy": (
        ls.StableFSDPStrategy,
        {
            "auto_wrap_policy": [0, True],
            "mixed_precision": ["fp8"],
            "reduce_dtype": [torch.int32],
            "flatten_parameters": [1],
            "cpu_offload": [1],
            "reshard_after_forward": [1.5, 1],
            "activation_checkpointing": [3],
            "sharding": ["zero"],
            "device_mesh": [(2,)],
            "state_dict_type": ["dcp"],
            "backend": ["deepspeed"],
            "tensor_parallel": [0],
            "process_group_backend": [3],
            "timeout": [30],
            "sharding_strategy": ["NO_SHARD", "ZERO3"],
            "activation_checkpointing_policy": [3],
        },
    ),
    "parallelize_blocks": (
        call(ls.parallelize_blocks, blocks=nn.ModuleList([nn.Linear(2, 2)]), mesh=None),
        {"blocks": [3], "mesh": [3], "plan": [3]},
    ),
    "Preset": (
        call(ls.Preset, name="mine", description="my recipe"),
        {
            "name": [3, ""],
            "description": [3],
            "max_norm": [0],
            "warmup": [None],
            "decay": [-1],
            "min_lr_ratio": [2],
            "lr_schedule": [1],
            "precision": ["fp8"],
            "init_scale": [0],
            "hysteresis": [0],
            "accumulation": [0],
            "lr_scaling": ["cubic"],
            "effective_batch": [0],
            "fsdp": [1],
            "activation_checkpointing": [1],
            "tensor_parallel": [0],
            "num_nodes": [0],
            "health": ["panic"],
            "skip_on": ["grad", None],
            "lr_backoff": [0, -0.1, float("nan"), "0.02"],
            "per_layer": [0, "all"],
            "replay": [1],
            "router": [1],
            "router_balance_bias": [0, -1e-3, "1e-3"],
            "router_z_loss": [0, float("nan"), "1e-3"],
            "batch_ramp": [1, 2.5],
            "checkpoint": [None],
            "watchdog": [1],
            "sources": [3],
        },
    ),
    "StableTrainer": (
        call(ls.StableTrainer, accelerator="cpu", logger=False),
        {"preset": [3, "gtp"], "preset_overrides": [3, {"max_nrom": 1}]},
    ),
    "describe_preset": (call(ls.describe_preset, name="gpt"), {"name": [3, "gtp"]}),
    "ModelShape": (
        call(ls.ModelShape, params=1e9),
        {"params": [0, -1], "layers": [0], "hidden": [0], "heads": [0], "vocab": [0], "largest_unit": [0]},
    ),
    "plan_memory": (
        call(ls.plan_memory, model=1e9),
        {
            "model": ["big", -1],
            "nodes": [0],
            "gpus_per_node": [0],
            "gpu_memory": ["lots", -1],
            "precision": ["fp8"],
            "optimizer": ["lion"],
            "sharding": ["zero9"],
            "seq_len": [0],
            "micro_batch": [0],
            "activation_checkpointing": [1],
            "effective_batch": [0],
            "cpu_offload": [1],
            "flash_attention": [1],
            "tensor_parallel": [0],
            "sequence_parallel": [1],
            "pipeline_parallel": [0],
            "mixed_layout": ["both"],
            "headroom": [1.5, -0.1],
            "overhead": ["much"],
        },
    ),
    "advise_tensor_parallel": (call(ls.advise_tensor_parallel, model=1e9), {"model": ["big"]}),
    "StabilityProgressBar": (
        ls.StabilityProgressBar,
        {"refresh_rate": [-1], "process_position": [-1], "leave": [1]},
    ),
    "StabilityRichProgressBar": (
        ls.StabilityRichProgressBar,
        {"refresh_rate": [-1], "leave": [1], "theme": [3], "console_kwargs": [3]},
    ),
}

#: public names that take no arguments, or whose arguments are not the user's to pass, with the reason
NOT_ENTRY_POINTS = {
    "AtomicCheckpointIO": "no arguments",
    "ExactResume": "no arguments",
    "QKProjection": "a record your projection function returns: qk_projection refuses anything else, and "
    "apply_qk_clip_ checks its head count against the logits",
    "HeadBlocks": "a record inside QKProjection (the same checks)",
    "PrecisionDiagnostics": "no arguments",
    "gpt_block_plan": "no arguments",
    "list_presets": "no arguments",
    "MemoryPlan": "a result of plan_memory, not built by callers",
    "TensorParallelAdvice": "a result of advise_tensor_parallel, not built by callers",
    "TrainingStatus": "a result of check_training_status, not built by callers",
    "WatchdogSettings": "a result of watchdog_settings, not built by callers",
    "Outcome": "an enum of step outcomes, read from the ledger",
    "Stage": "an enum of the step table's rows, passed to StepLedger.at (which refuses anything else)",
    "RouterSpec": "a record your register_router spec function returns, checked when the monitor reads it at setup",
    "Routing": "a record your register_router routing function returns, read by the monitor's hook",
    "QueryKey": "what a register_attention function returns, read by the monitor's hook",
    "CheckpointError": "an exception",
    "LossScaleFloorError": "an exception",
    "StabilityConfigError": "an exception",
    "TrainingDivergedError": "an exception",
    "FailingDeviceError": "an exception",
    "Incident": "a record of the incident log, written by the callbacks, read back by read_incidents",
}
#: arguments that are the Trainer's to pass (Lightning's accelerator connector sets them), or open keywords
NOT_THE_USERS = {
    ("StableFSDPStrategy", "accelerator"): "set by the Trainer",
    ("StableFSDPStrategy", "parallel_devices"): "set by the Trainer",
    ("StableFSDPStrategy", "cluster_environment"): "set by the Trainer",
    ("StableFSDPStrategy", "precision_plugin"): "set by the Trainer from precision=",
    ("StableFSDPStrategy", "fairscale_kwargs"): "open keywords: an unknown one is tested below",
    ("StableTrainer", "args"): "lightning.Trainer's positional arguments",
    ("StableTrainer", "kwargs"): "lightning.Trainer's arguments",
    ("advise_tensor_parallel", "kwargs"): "plan_memory's arguments, tested there",
    ("get_preset", "argument"): "the argument name its error reports (from_preset passes its own)",
}


def test_the_table_covers_every_argument_of_every_public_entry_point() -> None:
    assert set(ENTRIES) | set(NOT_ENTRY_POINTS) == set(ls.__all__)
    for name, (_, values) in ENTRIES.items():
        parameters = set(inspect.signature(getattr(ls, name)).parameters) - {"self"}
        own = {p for p in parameters if (name, p) not in NOT_THE_USERS}
        assert set(values) == own, (name, own ^ set(values))


CASES = [
    pytest.param(name, argument, value, id=f"{name}-{argument}={value!r}")
    for name, (_, values) in ENTRIES.items()
    for argument, bad in values.items()
    for value in [WRONG, *bad]
]


@pytest.mark.parametrize(("name", "argument", "value"), CASES)
def test_a_wrong_argument_gets_the_packages_error_naming_it(name: str, argument: str, value: Any) -> None:
    build, _ = ENTRIES[name]
    with pytest.raises(StabilityConfigError) as info:
        build(**{argument: value})
    message = str(info.value)
    assert re.search(rf"\b{argument}\b", message), message
    assert "Fix:" in message, message


def test_an_unknown_strategy_keyword_is_named_with_the_closest() -> None:
    with pytest.raises(
        StabilityConfigError, match=r"`auto_wrap_polcy=1` is not a keyword.*did you mean `auto_wrap_policy`"
    ):
        ls.StableFSDPStrategy(auto_wrap_polcy=1)
