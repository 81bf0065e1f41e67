"""Lightning ``FSDPStrategy``'s keyword arguments, translated to :class:`StableFSDPStrategy`'s (FSDP2).

Changing ``FSDPStrategy(`` to ``StableFSDPStrategy(`` keeps a Lightning user's arguments:

==================================  =================================================================================
``FSDPStrategy(...)``               ``StableFSDPStrategy`` (FSDP2)
==================================  =================================================================================
``sharding_strategy="FULL_SHARD"``  ``sharding="full"``, ``reshard_after_forward=True`` (ZeRO-3)
``"SHARD_GRAD_OP"``                 ``sharding="full"``, ``reshard_after_forward=False`` (parameters stay gathered
                                    from forward to backward: ZeRO-2's communication)
``"HYBRID_SHARD"``                  ``sharding="hybrid"`` (shard within a node, replicate across nodes)
``"_HYBRID_SHARD_ZERO2"``           ``sharding="hybrid"``, ``reshard_after_forward=False``
``"NO_SHARD"``                      refused: that is DDP (``strategy="ddp"``)
``auto_wrap_policy={Block}``        ``auto_wrap_policy={Block}`` (also a ``ModuleWrapPolicy``, or a
                                    ``transformer_auto_wrap_policy`` partial: their classes)
``size_based_auto_wrap_policy``     its ``min_num_params`` as a parameter count (the same rule: a module whose
                                    parameters not inside a wrapped descendant number at least that many)
FSDP1 ``policy(module, recurse,     called per module as a leaf decision: ``policy(module, recurse=False,
nonwrapped_numel)``                 nonwrapped_numel=its parameters not inside an already wrapped descendant)``
``activation_checkpointing_policy`` ``activation_checkpointing=`` those classes (a set, a ``ModuleWrapPolicy`` or a
                                    ``transformer_auto_wrap_policy`` partial); another callable is refused
``activation_checkpointing=Block``  the same (Lightning's deprecated spelling)
``cpu_offload=True/CPUOffload``     ``cpu_offload=`` its ``offload_params``
``mixed_precision=MixedPrecision``  a ``MixedPrecisionPolicy`` with its ``param_dtype``, ``reduce_dtype`` and
                                    ``cast_forward_inputs``; ``buffer_dtype`` is not applied (FSDP2 leaves buffers
                                    in their dtype, autocast computes with them); ``keep_low_precision_grads=True``
                                    is refused (gradients are kept in fp32 here)
``state_dict_type``                 the same (``"full"``: one file; ``"sharded"``: a directory; note that
                                    Lightning's default is ``"full"`` and this strategy's ``"sharded"``)
``device_mesh=(replicas, shard)``   the same, with ``HYBRID_SHARD``
``process_group_backend, timeout``  the same
``use_orig_params``                 accepted, no effect: FSDP2 always keeps the original parameters (one DTensor
                                    each; no flat parameters)
``limit_all_gathers``               accepted, no effect: FSDP2 bounds the all-gathers in flight by itself (one
                                    unit prefetched ahead)
``forward_prefetch``,               accepted, no effect: FSDP2 prefetches the next unit implicitly in forward and
``backward_prefetch``               backward
``sync_module_states=False``        accepted (the default); ``True`` is refused: seed the initialisation
                                    (``seed_everything``) or load the weights, as FSDP2 shards each rank's own copy
``process_group``, ``device_id``,   refused with the replacement (``device_mesh``, the Trainer's ``devices``,
``ignored_modules``,                ``configure_model``)
``param_init_fn``, ``checkpoint_io``
==================================  =================================================================================
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Collection
from typing import Any

from torch import nn

from lightning_stability.errors import config_error

#: FSDPStrategy's keywords that have no effect on FSDP2, each with the reason (said once at construction)
NO_EFFECT = {
    "use_orig_params": "FSDP2 always keeps the original parameters (one DTensor each)",
    "limit_all_gathers": "FSDP2 bounds the all-gathers in flight by itself",
    "forward_prefetch": "FSDP2 prefetches the next unit implicitly",
    "backward_prefetch": "FSDP2 prefetches the next unit implicitly",
}
#: FSDPStrategy's keywords refused, each with what to do instead
REFUSED = {
    "process_group": "pass device_mesh=(replicas, shard_size) with sharding_strategy='HYBRID_SHARD', or nothing",
    "device_id": "the Trainer's devices= picks the device",
    "ignored_modules": "keep those modules out of the wrap policy, or shard them yourself in configure_model",
    "param_init_fn": "initialise in configure_model (on the meta device, materialised by the strategy)",
    "checkpoint_io": "this strategy writes its checkpoints itself (atomically, on every rank)",
}
LIGHTNING_KEYWORDS = frozenset({*NO_EFFECT, *REFUSED, "sync_module_states"})
SHARDING_STRATEGIES = {
    "FULL_SHARD": ("full", True),
    "SHARD_GRAD_OP": ("full", False),
    "HYBRID_SHARD": ("hybrid", True),
    "_HYBRID_SHARD_ZERO2": ("hybrid", False),
}


def sharding_of(sharding_strategy: Any) -> tuple[str, bool]:
    """``FSDPStrategy(sharding_strategy=...)`` (a name, any case, or torch's ``ShardingStrategy``) as
    ``(sharding, reshard_after_forward)``."""
    from torch.distributed.fsdp import ShardingStrategy

    name = sharding_strategy.name if isinstance(sharding_strategy, ShardingStrategy) else sharding_strategy
    if isinstance(name, str) and name.upper() == "NO_SHARD":
        raise config_error(
            "sharding_strategy",
            sharding_strategy,
            "shards nothing: every rank holds the whole model, which is DDP",
            "use strategy='ddp' (our callbacks measure, clip and skip exactly there), or 'FULL_SHARD'",
        )
    if not isinstance(name, str) or name.upper() not in SHARDING_STRATEGIES:
        raise config_error(
            "sharding_strategy",
            sharding_strategy,
            "is not one of FSDPStrategy's sharding strategies",
            f"pass one of {', '.join(SHARDING_STRATEGIES)} or torch's ShardingStrategy",
        )
    return SHARDING_STRATEGIES[name.upper()]


def _partial_of(policy: Any, name: str) -> functools.partial[Any] | None:
    return policy if isinstance(policy, functools.partial) and getattr(policy.func, "__name__", "") == name else None


def classes_of(policy: Any) -> set[type[nn.Module]] | None:
    """The module classes of a class-based FSDP1 policy (a ``ModuleWrapPolicy`` or a
    ``transformer_auto_wrap_policy`` partial); ``None`` for any other value."""
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    if isinstance(policy, ModuleWrapPolicy):
        return set(policy._module_classes)
    transformer = _partial_of(policy, "transformer_auto_wrap_policy")
    if transformer is not None:
        return set(transformer.keywords.get("transformer_layer_cls", ()))
    return None


def _is_fsdp1_callable(policy: Any) -> bool:
    try:
        parameters = inspect.signature(policy).parameters
    except (TypeError, ValueError):
        return False
    return "recurse" in parameters and "nonwrapped_numel" in parameters


def wrap_policy(policy: Any) -> Any:
    """``FSDPStrategy(auto_wrap_policy=...)`` as a ``StableFSDPStrategy`` policy (its own values pass as they are)."""
    classes = classes_of(policy)
    if classes is not None:
        return classes
    size_based = _partial_of(policy, "size_based_auto_wrap_policy")
    if size_based is not None:
        return int(size_based.keywords.get("min_num_params", int(1e8)))
    if callable(policy) and not isinstance(policy, type) and _is_fsdp1_callable(policy):
        return LeafDecision(policy)
    return policy


class LeafDecision:
    """An FSDP1 policy ``fn(module, recurse, nonwrapped_numel)`` asked for each module as a leaf decision
    (``recurse=False``), with the parameters of the module not inside a descendant it already chose."""

    def __init__(self, policy: Callable[..., bool]) -> None:
        self.policy = policy
        self._chosen: set[int] = set()

    def __call__(self, module: nn.Module) -> bool:
        inside = {id(p) for m in module.modules() if m is not module and id(m) in self._chosen for p in m.parameters()}
        free = sum(p.numel() for p in module.parameters() if id(p) not in inside)
        chosen = bool(self.policy(module=module, recurse=False, nonwrapped_numel=free))
        if chosen:
            self._chosen.add(id(module))
        return chosen


def checkpointing_of(activation_checkpointing: Any, activation_checkpointing_policy: Any) -> Any:
    """Lightning's ``activation_checkpointing`` / ``activation_checkpointing_policy`` as this strategy's
    ``activation_checkpointing`` (``None``: neither was given)."""
    if activation_checkpointing_policy is None:
        if activation_checkpointing is None:
            return None
        return (
            activation_checkpointing
            if isinstance(activation_checkpointing, (bool, Collection))
            else [activation_checkpointing]
        )
    if activation_checkpointing not in (None, False):
        raise config_error(
            "activation_checkpointing_policy",
            activation_checkpointing_policy,
            "is given together with activation_checkpointing",
            "pass one of them (activation_checkpointing_policy={Block} or activation_checkpointing={Block})",
        )
    if isinstance(activation_checkpointing_policy, (set, frozenset, list, tuple)):
        return set(activation_checkpointing_policy)
    classes = classes_of(activation_checkpointing_policy)
    if classes is None:
        raise config_error(
            "activation_checkpointing_policy",
            activation_checkpointing_policy,
            "is a callable policy, which this strategy cannot apply (it checkpoints modules by class)",
            "pass the classes, e.g. activation_checkpointing_policy={Block}, or activation_checkpointing=True for "
            "the wrapped blocks",
        )
    return classes


def cpu_offload_of(cpu_offload: Any) -> Any:
    """``CPUOffload(offload_params=...)`` as a bool; a bool or ``None`` as it is."""
    from torch.distributed.fsdp import CPUOffload

    return bool(cpu_offload.offload_params) if isinstance(cpu_offload, CPUOffload) else cpu_offload


def mixed_precision_of(mixed_precision: Any) -> Any:
    """FSDP1's ``MixedPrecision`` (what Lightning's ``FSDPStrategy`` takes) as FSDP2's ``MixedPrecisionPolicy``."""
    from torch.distributed.fsdp import MixedPrecision, MixedPrecisionPolicy

    if not isinstance(mixed_precision, MixedPrecision):
        return mixed_precision
    if mixed_precision.keep_low_precision_grads:
        raise config_error(
            "mixed_precision",
            mixed_precision,
            "keeps low-precision gradients, but this strategy keeps gradients and master weights in fp32",
            "drop keep_low_precision_grads (or pass mixed_precision='bf16-true' for bf16 parameters throughout)",
        )
    return MixedPrecisionPolicy(
        param_dtype=mixed_precision.param_dtype,
        reduce_dtype=mixed_precision.reduce_dtype,
        cast_forward_inputs=mixed_precision.cast_forward_inputs or mixed_precision.cast_root_forward_inputs,
    )


def check_lightning_keywords(extra: dict[str, Any]) -> list[str]:
    """Take FSDPStrategy's keywords out of ``extra``: refuse those with no FSDP2 meaning; return one note per
    keyword accepted without effect."""
    notes = []
    for key in sorted(set(extra) & LIGHTNING_KEYWORDS):
        value = extra.pop(key)
        if key in REFUSED:
            raise config_error(key, value, "is an FSDPStrategy keyword with no FSDP2 meaning here", REFUSED[key])
        if key == "sync_module_states":
            if value:
                raise config_error(
                    key,
                    value,
                    "broadcasts rank 0's weights, which FSDP2 does not (it shards each rank's own copy)",
                    "seed the initialisation (lightning.seed_everything) or load the weights (a checkpoint, or in "
                    "configure_model), and drop sync_module_states",
                )
            continue
        notes.append(f"{key}={value!r}: no effect ({NO_EFFECT[key]})")
    return notes


def translate(arguments: dict[str, Any], lightning_keywords: dict[str, Any], extra: dict[str, Any]) -> list[str]:
    """FSDPStrategy's keywords as this strategy's, in place: ``arguments`` holds the strategy's ``sharding``,
    ``reshard_after_forward``, ``auto_wrap_policy``, ``activation_checkpointing``, ``cpu_offload`` and
    ``mixed_precision``; ``lightning_keywords`` FSDPStrategy's ``sharding_strategy`` and
    ``activation_checkpointing_policy``; ``extra`` the keywords outside the signature (FSDPStrategy's are taken
    out). Returns one note per keyword accepted without effect."""
    notes = check_lightning_keywords(extra)
    sharding_strategy = lightning_keywords.get("sharding_strategy")
    if sharding_strategy is not None:
        sharding, reshard = arguments["sharding"], arguments["reshard_after_forward"]
        if sharding != "full" or reshard is not True:
            raise config_error(
                "sharding_strategy",
                sharding_strategy,
                f"is given together with sharding={sharding!r}/reshard_after_forward={reshard!r}",
                "pass one of them: FSDPStrategy's sharding_strategy, or this strategy's sharding and "
                "reshard_after_forward",
            )
        arguments["sharding"], arguments["reshard_after_forward"] = sharding_of(sharding_strategy)
    arguments["auto_wrap_policy"] = wrap_policy(arguments["auto_wrap_policy"])
    policy = lightning_keywords.get("activation_checkpointing_policy")
    if policy is not None:
        arguments["activation_checkpointing"] = checkpointing_of(arguments["activation_checkpointing"], policy)
    arguments["cpu_offload"] = cpu_offload_of(arguments["cpu_offload"])
    arguments["mixed_precision"] = mixed_precision_of(arguments["mixed_precision"])
    return notes
