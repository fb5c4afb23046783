"""Construct a network with no storage and no initialisation: the loader assigns every tensor.

Why not just `with torch.device("meta")`: torch's layers still initialise themselves there, and
`nn.init.normal_` on a meta tensor runs a Python decomposition that imports `torch._dynamo`
(~1.5 s on a 2-core machine, more than mapping a 0.5B model's weights takes). Skipping the
`torch.nn.init` calls makes construction a few milliseconds for any size.
"""

from __future__ import annotations

import itertools
from typing import Callable, TypeVar

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

M = TypeVar("M", bound=nn.Module)


class _SkipInit(TorchFunctionMode):
    """Turns every `torch.nn.init.*` call into a no-op returning its tensor (this thread only:
    torch function modes are thread-local, so a network built elsewhere meanwhile is unaffected)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else kwargs["tensor"]
        return func(*args, **kwargs)


def build_on_meta(factory: Callable[[], M]) -> M:
    """factory() with every parameter and buffer on the meta device and left uninitialised."""
    with torch.device("meta"), _SkipInit():
        return factory()


def still_on_meta(module: nn.Module) -> list[str]:
    """Names of parameters/buffers that nothing was assigned to (they would fail at run time)."""
    tensors = itertools.chain(module.named_parameters(), module.named_buffers())
    return [name for name, t in tensors if t is not None and t.is_meta]
