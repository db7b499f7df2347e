"""Which model a rewritten FFN belongs to, and the FFN's full module path in it.

The L1 term is a mean over a *model's* FFN layers, and ``report()`` and ``stats()`` name each layer
by its full path (``model.layers.3.mlp``), whatever the route and however the model is compiled:
whole, per decoder layer, split by DDP buckets or graph breaks.

* ``patch(model)`` is handed the model.
* A compile route sees one graph at a time. Dynamo compiles a frame when it is first called, so the
  calling modules are still on the Python stack: the outermost module whose call is running is the
  model (``calling_model``). Dynamo's placeholders carry the real parameters (``grapharg``), whose
  names in that model give the path (``ModelIndex``).

Wrappers are looked through, so that a model has one identity and one set of names on every route:
``torch.compile``'s ``OptimizedModule`` (``_orig_mod``), DDP and DataParallel (``module``), and
activation-checkpoint wrappers (``_checkpoint_wrapped_module``).
"""

from __future__ import annotations

import sys
from typing import Optional

import torch
from torch import nn

# Path segments that wrappers insert and that the names leave out.
_WRAPPER_SEGMENTS = frozenset(("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"))
_CALL_FRAMES = frozenset(("_call_impl", "_wrapped_call_impl", "__call__", "forward"))


def unwrap(module: nn.Module) -> nn.Module:
    """The model inside ``torch.compile``, DDP and DataParallel wrappers."""
    while True:
        inner = getattr(module, "_orig_mod", None)
        if isinstance(inner, nn.Module):
            module = inner
            continue
        if isinstance(module, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            module = module.module
            continue
        return module


def calling_modules() -> tuple[Optional[nn.Module], Optional[nn.Module]]:
    """``(outermost, innermost)`` of the modules whose call is running on this thread's stack,
    unwrapped: the model, and the module whose forward is being compiled (None, None when the code
    was not called from a module: a compiled function)."""
    frame = sys._getframe(1)
    outermost = innermost = None
    while frame is not None:
        if frame.f_code.co_name in _CALL_FRAMES:
            candidate = frame.f_locals.get("self")
            if isinstance(candidate, nn.Module):
                outermost = candidate
                innermost = innermost if innermost is not None else candidate
        frame = frame.f_back
    if outermost is None:
        return None, None
    return unwrap(outermost), unwrap(innermost)


def gathers_weights(model: nn.Module) -> bool:
    """Whether ``model`` is sharded by FSDP2 (``fully_shard``), whose modules' parameters are
    gathered before each use and freed after it."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a build without torch.distributed
        return False
    return any(isinstance(m, FSDPModule) for m in model.modules())


def calling_model() -> Optional[nn.Module]:
    """The outermost module whose call is running on this thread's stack, unwrapped; None when the
    compiled code was not called from a module (a compiled function)."""
    return calling_modules()[0]


def clean_path(name: str) -> str:
    """A module or parameter name without wrapper segments (``layers.0._orig_mod.mlp`` → ``layers.0.mlp``)."""
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_SEGMENTS)


class ModelIndex:
    """Names of one model's parameters, looked up by identity."""

    def __init__(self, model: nn.Module):
        self.model = model
        self._names = {id(p): clean_path(name) for name, p in model.named_parameters(remove_duplicate=False)}
        self._modules = {clean_path(name): m for name, m in model.named_modules(remove_duplicate=False)}
        self._module_paths = {id(m): path for path, m in self._modules.items()}

    def parameter_name(self, tensor: Optional[torch.Tensor]) -> Optional[str]:
        return None if tensor is None else self._names.get(id(tensor))

    def module_path(self, module: nn.Module) -> Optional[str]:
        return self._module_paths.get(id(module))

    def ffn_path(self, down_weight: Optional[torch.Tensor]) -> Optional[str]:
        """The path of the module that owns an FFN, from its down projection's weight: the parent of
        the ``nn.Linear`` holding it, or the module holding it as a bare parameter."""
        name = self.parameter_name(down_weight)
        if name is None:
            return None
        owner = name.rpartition(".")[0]
        if isinstance(self._modules.get(owner), nn.Linear):
            owner = owner.rpartition(".")[0]
        return owner


def display_name(model: Optional[nn.Module], path: str) -> str:
    """``path``, or the model's class name for the model itself."""
    if path:
        return path
    return type(model).__name__ if model is not None else "model"


def real_tensor(node) -> Optional[torch.Tensor]:
    """The real tensor behind a Dynamo graph's placeholder (its ``grapharg``) or a ``get_attr``
    node of ``node.graph.owning_module``; None if there is none (fake-only graphs)."""
    grapharg = node.meta.get("grapharg")
    if grapharg is not None:
        try:
            value = grapharg.example
        except Exception:  # noqa: BLE001 - a dead weak reference, or an internal change
            value = None
        return value if isinstance(value, torch.Tensor) else None
    if node.op == "get_attr":
        owner = node.graph.owning_module
        try:
            value = owner.get_parameter(node.target) if owner is not None else None
        except AttributeError:
            try:
                value = owner.get_buffer(node.target)
            except AttributeError:
                value = None
        return value if isinstance(value, torch.Tensor) else None
    return None
