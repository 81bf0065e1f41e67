"""Which modules become FSDP2 units, and how they are wrapped.

Pure module-tree logic, unit-tested without processes: :func:`select_blocks` turns an auto-wrap policy
into the list of modules to shard (children before parents), :func:`top_level_units` adds the
LightningModule's own submodules, and :func:`shard_module` applies activation checkpointing and
``fully_shard`` to all of them and to a root that covers what is left.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from typing import Any

from torch import nn

from lightning_stability import _compat
from lightning_stability.errors import StabilityConfigError, config_error
from lightning_stability.norms import local_tensor

#: A set of module classes, a predicate on modules, a minimum parameter count, or ``None`` (automatic).
WrapPolicy = Collection[type[nn.Module]] | Callable[[nn.Module], bool] | int | None

_CONTAINERS = (nn.ModuleList, nn.ModuleDict)


def validate_policy(policy: Any) -> WrapPolicy:
    """Check the type of an ``auto_wrap_policy`` argument (at construction)."""
    if policy is None:
        return None
    if isinstance(policy, bool):
        raise config_error(
            "auto_wrap_policy",
            policy,
            "is not a policy",
            "pass None (find the repeated blocks), a set of module classes, a callable or a parameter count",
        )
    if isinstance(policy, int):
        if policy < 1:
            raise config_error("auto_wrap_policy", policy, "must be a parameter count >= 1", "pass e.g. 1_000_000")
        return policy
    if isinstance(policy, type) and issubclass(policy, nn.Module):
        return {policy}
    if isinstance(policy, (set, frozenset, list, tuple)):
        bad = [c for c in policy if not (isinstance(c, type) and issubclass(c, nn.Module))]
        if bad or not policy:
            raise config_error(
                "auto_wrap_policy",
                policy,
                "must hold nn.Module subclasses only",
                "pass e.g. {TransformerBlock} (the classes, not instances)",
            )
        return set(policy)
    if callable(policy):
        return policy
    raise config_error(
        "auto_wrap_policy",
        policy,
        "is not a policy",
        "pass None, a set of module classes, a callable `fn(module) -> bool` or a parameter count",
    )


def _owns_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _outermost(root: nn.Module, chosen: set[int]) -> list[nn.Module]:
    """Modules whose id is in ``chosen`` and that lie inside no other chosen module, in tree order."""
    out: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if id(child) in chosen:
                out.append(child)
            else:
                visit(child)

    visit(root)
    return out


def find_repeated_blocks(root: nn.Module) -> list[nn.Module]:
    """The repeated blocks of a model (e.g. its transformer layers), outermost first.

    A block class is one that appears at least twice, with parameters, among the children of a
    ``nn.ModuleList`` / ``nn.Sequential`` / ``nn.ModuleDict``; failing that, any class that appears at
    least twice with parameters. Every instance of such a class is returned unless it lies inside
    another one.
    """
    instances: dict[type[nn.Module], list[nn.Module]] = {}
    for module in root.modules():
        if isinstance(module, (*_CONTAINERS, nn.Sequential)):
            for child in module.children():
                if _owns_params(child):
                    instances.setdefault(type(child), []).append(child)
    if not any(len(found) >= 2 for found in instances.values()):
        instances = {}
        for module in root.modules():
            if module is not root and _owns_params(module) and not isinstance(module, (*_CONTAINERS, nn.Sequential)):
                instances.setdefault(type(module), []).append(module)
    classes = {cls for cls, found in instances.items() if len(found) >= 2}
    # A class all of whose repeats sit inside another repeated class (the Linear layers of an MLP inside
    # each transformer block) is part of that block, not a block of its own.
    inside: dict[type[nn.Module], set[int]] = {cls: set() for cls in classes}
    for module in root.modules():
        if type(module) in classes:
            inside[type(module)].update(id(d) for d in module.modules() if d is not module)
    kept = {
        cls
        for cls in classes
        if not all(any(id(m) in inside[other] for other in classes if other is not cls) for m in instances[cls])
    }
    chosen = {id(m) for m in root.modules() if m is not root and type(m) in kept and _owns_params(m)}
    return _outermost(root, chosen)


def _post_order(module: nn.Module) -> Iterator[nn.Module]:
    for child in module.children():
        yield from _post_order(child)
    yield module


def select_blocks(root: nn.Module, policy: WrapPolicy) -> list[nn.Module]:
    """The modules ``policy`` wraps, children before parents (the order ``fully_shard`` needs).

    Args:
        root: the model (never returned itself).
        policy: see :data:`WrapPolicy`. A parameter count wraps, bottom-up, every module whose
            parameters not yet inside a wrapped descendant number at least that many. The count is of the
            elements each rank holds after ``configure_model``: under tensor parallelism a split layer counts
            its local slice (what one all-gather of the unit moves per tensor-parallel rank), so the same count
            gives units of the same communication size with or without tensor parallelism.
    """
    if policy is None:
        blocks = find_repeated_blocks(root)
        ids = {id(m) for m in blocks}
        return [m for m in _post_order(root) if id(m) in ids]
    if isinstance(policy, int):
        covered: set[int] = set()
        picked: list[nn.Module] = []
        for module in _post_order(root):
            if module is root or isinstance(module, _CONTAINERS):
                continue
            free = sum(local_tensor(p).numel() for p in module.parameters() if id(p) not in covered)
            if free >= policy:
                picked.append(module)
                covered.update(id(p) for p in module.parameters())
        return picked
    if isinstance(policy, (set, frozenset)):
        classes = tuple(policy)
        return [m for m in _post_order(root) if m is not root and isinstance(m, classes) and _owns_params(m)]
    assert callable(policy)
    return [m for m in _post_order(root) if m is not root and policy(m) and _owns_params(m)]


def top_level_units(root: nn.Module, blocks: Collection[nn.Module]) -> list[nn.Module]:
    """The root's own submodules that hold parameters outside ``blocks`` (containers are looked into).

    Making each of them a unit means its parameters are gathered when it is called and its floating
    inputs are cast to the compute dtype, however the LightningModule's steps call into it.
    """
    block_params = {id(p) for b in blocks for p in b.parameters()}
    block_ids = {id(b) for b in blocks}
    out: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if id(child) in block_ids:
                continue
            if isinstance(child, _CONTAINERS):
                visit(child)
            elif any(id(p) not in block_params for p in child.parameters()):
                out.append(child)

    visit(root)
    return out


def describe_classes(root: nn.Module, limit: int = 8) -> str:
    """``"Block x4, Linear x9, ..."``: the parameter-owning classes of a model, for error messages."""
    counts = Counter(type(m).__name__ for m in root.modules() if m is not root and _owns_params(m))
    return ", ".join(f"{name} x{n}" for name, n in counts.most_common(limit)) or "none"


class ShardedRoot(nn.Module):
    """The outermost FSDP2 unit: holds the LightningModule so that its step methods, routed through
    ``forward`` by Lightning's forward redirection, run inside FSDP's root pre/post-forward hooks."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)


@dataclass(frozen=True)
class WrapPlan:
    """What becomes an FSDP unit: ``blocks`` (by the policy), top-level ``units``, and the blocks whose
    activations are recomputed in backward (``checkpointed``)."""

    blocks: list[nn.Module]
    units: list[nn.Module]
    checkpointed: list[nn.Module]


def plan_wrapping(
    module: nn.Module,
    policy: WrapPolicy,
    activation_checkpointing: bool | tuple[type[nn.Module], ...],
    *,
    native: bool = True,
) -> WrapPlan:
    """Select the units of ``module``; a module that ``configure_model`` already sharded is left as is.

    Raises:
        StabilityConfigError: for a user policy that wraps nothing, or activation checkpointing that
            selects nothing or is asked of modules already sharded.
    """
    if native and any(is_fsdp_module(m) for m in module.modules()):
        if activation_checkpointing:
            raise config_error(
                "activation_checkpointing",
                activation_checkpointing,
                "cannot be added to modules that configure_model already sharded",
                "apply torch.distributed._composable.checkpoint in configure_model before fully_shard",
            )
        return WrapPlan([], [], [])
    blocks = select_blocks(module, policy)
    check_wraps_something(policy, blocks, module)
    units = top_level_units(module, blocks)
    if activation_checkpointing is False:
        return WrapPlan(blocks, units, [])
    if activation_checkpointing is True:
        checkpointed = blocks
    else:
        checkpointed = [m for m in module.modules() if isinstance(m, activation_checkpointing)]
    if not checkpointed:
        raise config_error(
            "activation_checkpointing",
            activation_checkpointing,
            f"selects no module of {type(module).__name__} (modules with parameters: {describe_classes(module)})",
            "name a block class, or set an auto_wrap_policy",
        )
    return WrapPlan(blocks, units, checkpointed)


def shard_module(
    module: nn.Module,
    plan: WrapPlan,
    *,
    mesh: Any,
    reshard_after_forward: bool | int,
    block_policy: Any,
    root_policy: Any,
    unit_policy: Any,
    offload_policy: Any,
) -> ShardedRoot:
    """Checkpoint, then ``fully_shard`` the blocks, the top-level units and a :class:`ShardedRoot`."""
    from torch.distributed.fsdp import fully_shard

    for block in plan.checkpointed:
        _compat.activation_checkpoint(block)  # non-reentrant recomputation; parameter names unchanged
    for group, policy in ((plan.blocks, block_policy), (plan.units, unit_policy)):
        for unit in group:
            fully_shard(
                unit,
                mesh=mesh,
                reshard_after_forward=reshard_after_forward,
                mp_policy=policy,
                offload_policy=offload_policy,
            )
    root = ShardedRoot(module)
    fully_shard(root, mesh=mesh, mp_policy=root_policy, offload_policy=offload_policy)
    return root


def is_fsdp_module(module: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def check_wraps_something(policy: WrapPolicy, blocks: list[nn.Module], model: nn.Module) -> None:
    """A user policy that selects no module is a configuration error (the default may select none)."""
    if policy is not None and not blocks:
        shown = (
            policy
            if not callable(policy) or isinstance(policy, (set, frozenset))
            else getattr(policy, "__name__", repr(policy))
        )
        raise StabilityConfigError(
            f"`auto_wrap_policy={shown!r}` wraps no module of {type(model).__name__}: every parameter would "
            f"sit in one FSDP unit, with no overlap of communication and compute. Modules with parameters: "
            f"{describe_classes(model)}. Fix: name one of these classes (e.g. the transformer block), lower "
            "the parameter count, or pass auto_wrap_policy=None to find the repeated blocks automatically."
        )
