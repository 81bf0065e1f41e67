"""Mixtures of experts: each router's health, found by itself and logged on logging steps.

The Lightning callback, :class:`RouterHealthMonitor` (``callback``), logs each MoE layer's routing figures as
``stability/router/...`` metrics. Its parts:

* ``routers``: :func:`find_routers` (Hugging Face transformers 5's Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE,
  DeepSeek-V2/V3 routers, and any registered with :func:`register_router`: :class:`Routing`, :class:`RouterSpec`),
  :class:`RouterHooks` (a forward hook per router, no host read).
* ``load``: pure: :func:`routing_stats` (one forward's counts and sums), :class:`RouterWindow` (the totals of a
  window, summed over ranks), :func:`layer_figures` (load share, MaxVio, dead experts, entropy, logit max, z-loss).
"""

from lightning_stability.moe.callback import RouterHealthMonitor
from lightning_stability.moe.load import LayerFigures, RouterWindow, layer_figures, routing_stats
from lightning_stability.moe.routers import (
    Router,
    RouterHooks,
    RouterSpec,
    Routing,
    find_routers,
    register_router,
)

__all__ = [
    "LayerFigures",
    "Router",
    "RouterHealthMonitor",
    "RouterHooks",
    "RouterSpec",
    "RouterWindow",
    "Routing",
    "find_routers",
    "layer_figures",
    "register_router",
    "routing_stats",
]
