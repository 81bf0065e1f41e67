"""The routers of a mixture of experts, found by themselves: which module scores the experts, how many, top-k.

A router is the module whose forward produces a token's routing logits (one per expert) and the experts it
chooses. :func:`find_routers` finds every router of a model, :class:`RouterHooks` reads each one's forward with a
forward hook (no change to the model's code, no host read) into a :class:`~lightning_stability.moe.load.RouterWindow`.

Known routers (Hugging Face transformers 5): ``MixtralTopKRouter``, ``Qwen2MoeTopKRouter``, ``Qwen3MoeTopKRouter``,
``OlmoeTopKRouter``, ``DeepseekV2TopkRouter`` (softmax scores), ``DeepseekV3TopkRouter`` (sigmoid scores; its
``e_score_correction_bias`` moves the choice, not the logits). Each returns ``(router_logits, routing_weights,
chosen_experts)`` from its forward and holds ``num_experts`` and ``top_k``.

Your own router, the protocol: :func:`register_router` with your module's class. A class that follows the same
convention (its forward returns ``(logits, weights, experts)``, it holds ``num_experts`` and ``top_k``) needs no
more; otherwise pass ``routing(module, args, kwargs, output) -> Routing`` (what one call routed) and
``spec(module) -> RouterSpec`` (its number of experts, top-k and how its logits become scores).

Refused at setup, with the fix: a model with no router; a router whose number of experts or top-k cannot be read
or make no sense; a module that looks like a mixture of experts (its class name ends in ``SparseMoeBlock``,
``MoeBlock``, ``MoE``, ``Moe``, ``Router``, ``Gating``) with no router this module knows inside it (e.g. an older
transformers' ``MixtralSparseMoeBlock``, whose gate is a plain ``nn.Linear``, or a family not listed above).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn

from lightning_stability import _compat
from lightning_stability.errors import StabilityConfigError, config_error
from lightning_stability.known_modules import lookup
from lightning_stability.moe.load import RouterWindow

Scores = Literal["softmax", "sigmoid"]


@dataclass(frozen=True)
class RouterSpec:
    """What the monitor must know of a router before its first forward.

    Attributes:
        num_experts: the experts it scores (the last dim of its logits).
        top_k: the experts it chooses per token.
        scores: how its logits become scores: ``"softmax"`` over the experts (Mixtral, Qwen, OLMoE, DeepSeek-V2) or
            ``"sigmoid"`` per expert (DeepSeek-V3); the routing entropy is that of these scores, normalized to sum
            to one.
    """

    num_experts: int
    top_k: int
    scores: Scores = "softmax"


@dataclass
class Routing:
    """What one router call routed.

    Attributes:
        logits: ``(..., num_experts)``: each token's routing logits (before the softmax or sigmoid).
        experts: ``(..., top_k)``, integer: the experts chosen for each token, each in ``[0, num_experts)``.
    """

    logits: Tensor
    experts: Tensor


#: ``routing(module, args, kwargs, output) -> Routing`` from a forward call; ``None``: nothing routed this call
RoutingFn = Callable[[nn.Module, tuple[Any, ...], dict[str, Any], Any], "Routing | None"]
#: ``spec(module) -> RouterSpec``, read once at setup
SpecFn = Callable[[nn.Module], RouterSpec]

_REGISTRY: dict[type[nn.Module], tuple[RoutingFn, SpecFn]] = {}
_HF_BY_NAME: dict[str, tuple[RoutingFn, SpecFn]] = {}
#: class-name endings of modules that hold a router (or are one): refused when no known router is found in them
_MOE_LIKE = ("SparseMoeBlock", "MoeBlock", "MoE", "Moe", "Router", "Gating")


def convention_routing(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Routing:
    """The routing of a module whose forward returns ``(logits, weights, experts)`` (Hugging Face's routers)."""
    if not isinstance(output, (tuple, list)) or len(output) < 3:
        raise StabilityConfigError(
            f"{type(module).__name__}'s forward returned {type(output).__name__}, not (logits, weights, experts). "
            "Fix: register it with register_router(cls, routing=...) reading its output."
        )
    return Routing(output[0], output[2])


def convention_spec(module: nn.Module) -> RouterSpec:
    """The spec of a module holding ``num_experts`` and ``top_k`` (Hugging Face's routers; softmax scores)."""
    return RouterSpec(getattr(module, "num_experts", None), getattr(module, "top_k", None))  # type: ignore[arg-type]


def _sigmoid_spec(module: nn.Module) -> RouterSpec:
    spec = convention_spec(module)
    return RouterSpec(spec.num_experts, spec.top_k, "sigmoid")


def register_router(cls: type[nn.Module], routing: RoutingFn | None = None, spec: SpecFn | None = None) -> None:
    """Teach :class:`RouterHooks` (and ``RouterHealthMonitor``) your router module.

    Args:
        cls: the router's class (the module whose forward produces the routing logits); subclasses match too (the
            nearest registered class wins).
        routing: ``routing(module, args, kwargs, output) -> Routing`` (or ``None`` to skip a call), called in a
            forward hook. Default: the forward returns ``(logits, weights, experts)``. For the router z-loss
            (``RouterHealthMonitor(z_loss=...)``) its ``logits`` must be the tensor the routing weights are
            computed from, in the autograd graph (not a detached copy): the z-loss's gradient is added there.
        spec: ``spec(module) -> RouterSpec``, read once at setup. Default: ``module.num_experts``,
            ``module.top_k``, softmax scores.

    Raises:
        StabilityConfigError: when ``cls`` is not an ``nn.Module`` subclass, or ``routing`` or ``spec`` is not
            callable.

    Example::

        from lightning_stability.moe import Routing, RouterSpec, register_router

        class MyRouter(nn.Module):  # forward(x) -> (topk_weights, topk_idx, logits)
            ...

        register_router(
            MyRouter,
            routing=lambda module, args, kwargs, out: Routing(logits=out[2], experts=out[1]),
            spec=lambda module: RouterSpec(num_experts=module.n_experts, top_k=module.k),
        )
    """
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise config_error("cls", cls, "is not an nn.Module subclass", "pass your router module's class")
    if routing is not None and not callable(routing):
        raise config_error("routing", routing, "is not callable", "pass routing(module, args, kwargs, output)")
    if spec is not None and not callable(spec):
        raise config_error("spec", spec, "is not callable", "pass spec(module) -> RouterSpec")
    _REGISTRY[cls] = (routing or convention_routing, spec or convention_spec)


def _known(module: nn.Module) -> tuple[RoutingFn, SpecFn] | None:
    return lookup(module, _REGISTRY, _HF_BY_NAME)


@dataclass(frozen=True)
class Router:
    """One router found in a model: its name (as in ``named_modules``), the module, its spec, how to read it."""

    name: str
    module: nn.Module
    spec: RouterSpec
    routing: RoutingFn


def find_routers(model: nn.Module) -> list[Router]:
    """Every router of ``model``, in ``named_modules`` order, its spec read and checked.

    Raises:
        StabilityConfigError: when ``model`` has no router, when a router's spec cannot be read or makes no sense,
            or when a module that looks like a mixture of experts holds no known router (see the module's doc).
    """
    found: list[Router] = []
    for name, module in model.named_modules():
        known = _known(module)
        if known is not None:
            found.append(Router(name, module, _checked_spec(name, module, known[1]), known[0]))
    names = [r.name for r in found]
    unread = [
        f"{name} ({type(module).__name__})"
        for name, module in model.named_modules()
        if name  # the model itself: "no router" below says it better
        and type(module).__name__.endswith(_MOE_LIKE)
        and _known(module) is None
        and not any(r.startswith(f"{name}.") for r in names)
    ]
    if unread:
        raise StabilityConfigError(
            f"{', '.join(unread[:4])}{' and more' if len(unread) > 4 else ''} look like a mixture of experts, with no "
            "router RouterHealthMonitor can read inside (known: Hugging Face transformers 5's Mixtral, Qwen2-MoE, "
            "Qwen3-MoE, OLMoE, DeepSeek-V2/V3 routers). Fix: register the module that produces the routing logits "
            "with lightning_stability.moe.register_router(YourRouter, routing=..., spec=...)."
        )
    if not found:
        raise StabilityConfigError(
            f"{type(model).__name__} has no router RouterHealthMonitor knows (Hugging Face transformers 5's "
            "Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V2/V3). Fix: register the module that produces the "
            "routing logits with lightning_stability.moe.register_router(YourRouter, routing=..., spec=...), or "
            "leave RouterHealthMonitor out for a model without experts (a preset: router=False, or the 'gpt' preset)."
        )
    return found


def _checked_spec(name: str, module: nn.Module, spec_fn: SpecFn) -> RouterSpec:
    try:
        spec = spec_fn(module)
    except Exception as error:  # the user's function: say whose it is
        raise StabilityConfigError(
            f"Reading router {name!r} ({type(module).__name__}) failed: {error!r}. Fix: its spec function must "
            "return RouterSpec(num_experts, top_k)."
        ) from error
    if not isinstance(spec, RouterSpec):
        raise config_error(f"spec({name})", spec, "is not a RouterSpec", "return RouterSpec(num_experts, top_k)")
    experts, top_k = spec.num_experts, spec.top_k
    if isinstance(experts, bool) or not isinstance(experts, int) or experts < 2:
        raise config_error(
            f"router {name!r} num_experts",
            experts,
            "is not a number of experts (an int >= 2)",
            "give the router a num_experts attribute, or register it with spec=...",
        )
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= experts:
        raise config_error(
            f"router {name!r} top_k",
            top_k,
            f"is not a top-k in [1, num_experts={experts}]",
            "give the router a top_k attribute, or register it with spec=...",
        )
    if spec.scores not in ("softmax", "sigmoid"):
        raise config_error(f"router {name!r} scores", spec.scores, "is not a choice", "pass 'softmax' or 'sigmoid'")
    return spec


class RouterHooks:
    """A forward hook on every router of a model, adding each call's routing to a :class:`RouterWindow`.

    The hooks count while :attr:`active` (the monitor turns it on as a training step's micro-batches begin and off
    as the step opens, so a validation forward or a replayed one is not counted) and skip a forward run inside
    backward (activation checkpointing's recomputation of a forward already counted). No host read. For the
    router's actions they also keep, when asked, each forward's logits in the graph (:attr:`grad_logits`) and each
    router's logit max and load in the step (:attr:`step_max`, :attr:`step_counts`).

    Args:
        model: the model; every router of it is hooked (:func:`find_routers`, which raises when there is none).
        window: where the counts go (one layer per router, by name).

    Example::

        window = RouterWindow()
        hooks = RouterHooks(model, window)
        hooks.active = True
        model(batch)
        figures = window.figures()  # per router, device tensors
    """

    def __init__(self, model: nn.Module, window: RouterWindow) -> None:
        self.routers = find_routers(model)
        self.window = window
        for router in self.routers:
            window.add_layer(router.name, router.spec.num_experts, router.spec.top_k, router.spec.scores)
        self.active = False
        #: when a list: the logits of every forward run with gradients (a training forward, or ``StepReplay``'s
        #: rerun of one), in the autograd graph, until the coming backward takes them (the router z-loss)
        self.grad_logits: list[Tensor] | None = None
        #: when a dict: each router's largest logit over the counted forwards since the last clear (0-dim fp32)
        self.step_max: dict[str, Tensor] | None = None
        #: when a dict: each router's tokens routed to each expert over the counted forwards since the last clear
        #: (``(E,)`` int64)
        self.step_counts: dict[str, Tensor] | None = None
        #: the routers whose logits a training-mode forward returned without a gradient (a frozen router, or the
        #: first forward of reentrant activation checkpointing, run under ``no_grad``): the z-loss cannot reach them
        self.no_grad_logits: set[str] = set()
        self._handles = [r.module.register_forward_hook(self._hook(r), with_kwargs=True) for r in self.routers]

    def _hook(self, router: Router) -> Callable[..., None]:
        name, read = router.name, router.routing

        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
            if _compat.in_backward():
                return
            kept = self.grad_logits if torch.is_grad_enabled() else None
            if self.grad_logits is not None and kept is None and module.training:
                self.no_grad_logits.add(name)  # reentrant checkpointing's first forward: no graph to hook
            if not self.active and kept is None:
                return
            routing = read(module, args, kwargs, output)
            if routing is None:
                return
            if kept is not None:
                if routing.logits.requires_grad:
                    kept.append(routing.logits)
                else:
                    self.no_grad_logits.add(name)
            if self.active:
                with torch.no_grad():
                    self.window.add(name, routing.logits, routing.experts)
                    if self.step_counts is not None:
                        chosen = routing.experts.detach().reshape(-1).long()
                        counts = self.step_counts.get(name)
                        if counts is None:
                            counts = torch.zeros(router.spec.num_experts, dtype=torch.int64, device=chosen.device)
                        self.step_counts[name] = counts.scatter_add_(0, chosen, torch.ones_like(chosen))
                    if self.step_max is not None:
                        top = routing.logits.detach().float().amax()
                        seen = self.step_max.get(name)
                        self.step_max[name] = top if seen is None else torch.maximum(seen, top)

        return hook

    def remove(self) -> None:
        """Remove the hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles = []


_HF_BY_NAME.update(
    {
        name: (convention_routing, convention_spec)
        for name in (
            "MixtralTopKRouter",
            "Qwen2MoeTopKRouter",
            "Qwen3MoeTopKRouter",
            "OlmoeTopKRouter",
            "DeepseekV2TopkRouter",
        )
    },
    DeepseekV3TopkRouter=(convention_routing, _sigmoid_spec),
)
