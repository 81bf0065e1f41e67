"""Which entry of a table of module classes a module is: the nearest class in its MRO that a user registered, or a
Hugging Face class known by its name (matched on ``transformers.`` classes only, so that a class of your own with the
same name is not taken for it). It finds attention modules (``precursors/attention.py``) and MoE routers
(``moe/routers.py``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

from torch import nn

T = TypeVar("T")


def lookup(module: nn.Module, registered: Mapping[type, T], hf_by_name: Mapping[str, T]) -> T | None:
    """``registered[cls]`` or ``hf_by_name[cls.__name__]`` for the nearest class ``cls`` of ``module`` in either;
    ``None`` when none is."""
    for cls in type(module).__mro__:
        if cls in registered:
            return registered[cls]
        if cls.__module__.startswith("transformers.") and cls.__name__ in hf_by_name:
            return hf_by_name[cls.__name__]
    return None
