"""Wrappers that let twell see a training loop's loss scale (``loss_scaling.py``) with no change to it.

Root cause: twell injects the L1 gradient in the backward, outside the user's loss, so it cannot
see what the loss was multiplied by. Two libraries multiply it:

* ``torch.amp.GradScaler.scale(loss)`` multiplies by the scaler's scale (a device tensor that
  ``update()`` changes in place). The wrapper hooks the tensor it returns: when the backward of
  that tensor starts, the scale joins the loss scale, and it leaves when that backward ends
  (``queue_callback``). No host sync; a backward of anything else is not scaled. A backward that
  raises never runs its callback (nor does PyTorch free it), so the scale also leaves when the
  scaled tensor is released (``weakref.finalize``) and at the next host factor change.
  Every subclass that defines its own ``scale`` is wrapped too: FSDP's ``ShardedGradScaler`` does,
  and never calls ``GradScaler.scale``.
* ``accelerate.Accelerator.backward`` divides the loss by its ``gradient_accumulation_steps``
  (DeepSpeed divides inside its engine) unless called with ``scale_wrt_gas=False``; the wrapper
  multiplies the host factor by the same ``1 / steps`` for that backward.

Applied when twell first rewrites or patches a model (``install()``, idempotent, each wrapper once
per class), not at import: ``import torch`` must stay cheap. A library imported later is still
followed, since a loop may pick up the method before twell's first forward (``acc.backward(model(x))``
looks ``backward`` up first): a GradScaler subclass defined later is wrapped by an
``__init_subclass__`` on ``GradScaler``, and accelerate, if not imported yet, right after its
import (a finder on ``sys.meta_path`` that does nothing else and removes itself). A wrapper that
meets an unknown signature calls the original unchanged.
"""

from __future__ import annotations

import functools
import importlib.abc
import sys
import weakref

import torch

from . import loss_scaling

_WRAPPED = "_twell_loss_scale_wrapped"


def install() -> None:
    """Wrap ``scale`` of every GradScaler class, and ``Accelerator.backward`` now or once accelerate
    is imported (idempotent)."""
    _follow_grad_scalers(torch.amp.GradScaler)
    _follow_accelerate()


def _follow_grad_scalers(base) -> None:
    """Wrap ``scale`` where ``base`` or a subclass defines it, for the classes there are and, by an
    ``__init_subclass__`` on ``base``, for those defined later."""
    previous = base.__dict__.get("__init_subclass__")
    if getattr(getattr(previous, "__func__", None), _WRAPPED, False):
        return
    pending = [base]
    while pending:
        cls = pending.pop()
        pending.extend(cls.__subclasses__())
        if "scale" in cls.__dict__:
            _wrap_grad_scaler(cls)

    def __init_subclass__(cls, **kwargs):
        if previous is not None:
            previous.__get__(None, cls)(**kwargs)
        else:
            super(base, cls).__init_subclass__(**kwargs)
        if "scale" in cls.__dict__:
            _wrap_grad_scaler(cls)

    setattr(__init_subclass__, _WRAPPED, True)
    base.__init_subclass__ = classmethod(__init_subclass__)


def _wrap_grad_scaler(cls) -> None:
    original = cls.__dict__["scale"]
    if getattr(original, _WRAPPED, False) or not callable(original):
        return

    @functools.wraps(original)
    def scale(self, outputs):
        scaled = original(self, outputs)
        factor = getattr(self, "_scale", None)
        if getattr(self, "_enabled", False) and isinstance(factor, torch.Tensor):
            for t in _tensors(scaled):
                if t.requires_grad:
                    hook = _ScaledBackward(factor)
                    t.register_hook(hook)
                    if not torch.compiler.is_compiling():  # Dynamo cannot trace a finalizer
                        weakref.finalize(t, loss_scaling.end_scaled_backward, hook)
        return scaled

    setattr(scale, _WRAPPED, True)
    cls.scale = scale


class _ScaledBackward:
    """The hook on a tensor ``GradScaler.scale`` returned: its backward is scaled by ``factor``.
    Also the token that ends that scale, at the end of the backward or on the tensor's release."""

    __slots__ = ("factor",)

    def __init__(self, factor: torch.Tensor):
        self.factor = factor

    def __call__(self, grad):
        torch.autograd.Variable._execution_engine.queue_callback(
            functools.partial(loss_scaling.end_scaled_backward, self))
        loss_scaling.begin_scaled_backward(self.factor, self)
        return None


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)


def _follow_accelerate() -> None:
    accelerate = sys.modules.get("accelerate")
    if accelerate is not None:
        _wrap_accelerator_of(accelerate)
    elif not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport("accelerate", _wrap_accelerator_of))


def _wrap_accelerator_of(accelerate) -> None:
    accelerator = getattr(accelerate, "Accelerator", None)
    if isinstance(accelerator, type):
        _wrap_accelerator(accelerator)


def _wrap_accelerator(cls) -> None:
    original = cls.backward
    if getattr(original, _WRAPPED, False):
        return

    @functools.wraps(original)
    def backward(self, loss, **kwargs):
        steps = getattr(self, "gradient_accumulation_steps", 1)
        if not kwargs.get("scale_wrt_gas", True) or not isinstance(steps, int) or steps <= 1:
            return original(self, loss, **kwargs)
        with loss_scaling.loss_scale(loss_scaling.get_loss_scale() / steps):
            return original(self, loss, **kwargs)

    setattr(backward, _WRAPPED, True)
    cls.backward = backward


class _AfterImport(importlib.abc.MetaPathFinder):
    """Calls ``then(module)`` once the top-level module ``name`` has been imported, then leaves
    ``sys.meta_path``. It finds nothing itself: it asks the finders after it for the spec and
    wraps its loader."""

    def __init__(self, name: str, then):
        self.name, self.then = name, then

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name:
            return None
        for finder in sys.meta_path:
            find_spec = getattr(finder, "find_spec", None) if finder is not self else None
            spec = find_spec(fullname, path, target) if find_spec is not None else None
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _LoaderThen(spec.loader, self)
        return spec

    def imported(self, module) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        self.then(module)


class _LoaderThen(importlib.abc.Loader):
    """``loader``, then ``finder.imported(module)``; the module keeps ``loader`` as its own."""

    def __init__(self, loader, finder: _AfterImport):
        self.loader, self.finder = loader, finder

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        module.__loader__ = self.loader
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        self.finder.imported(module)
