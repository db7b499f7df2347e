"""Wrappers that let twell see a training loop's loss scale (``loss_scaling.py``) with no change to it.

Root cause: twell injects the L1 gradient in the backward, outside the user's loss, so it cannot
see what the loss was multiplied by. Two libraries multiply it:

* ``torch.amp.GradScaler.scale(loss)`` multiplies by the scaler's scale (a device tensor that
  ``update()`` changes in place). The wrapper hooks the tensor it returns: when the backward of
  that tensor starts, the scale joins the loss scale, and it leaves when that backward ends
  (``queue_callback``). No host sync; a backward of anything else is not scaled.
* ``accelerate.Accelerator.backward`` divides the loss by its ``gradient_accumulation_steps``
  (DeepSpeed divides inside its engine) unless called with ``scale_wrt_gas=False``; the wrapper
  multiplies the host factor by the same ``1 / steps`` for that backward.

Applied when twell first rewrites or patches a model (``install()``, idempotent, each wrapper once
per class, only for libraries already imported), not at import: ``import torch`` must stay cheap,
and a library twell never sees is never touched. A wrapper that meets an unknown signature calls
the original unchanged.
"""

from __future__ import annotations

import functools
import sys

import torch

from . import loss_scaling

_WRAPPED = "_twell_loss_scale_wrapped"


def install() -> None:
    """Wrap ``GradScaler.scale`` and, if accelerate is imported, ``Accelerator.backward`` (once)."""
    _wrap_grad_scaler(torch.amp.GradScaler)
    accelerate = sys.modules.get("accelerate")
    accelerator = getattr(accelerate, "Accelerator", None) if accelerate is not None else None
    if accelerator is not None:
        _wrap_accelerator(accelerator)


def _wrap_grad_scaler(cls) -> None:
    original = cls.scale
    if getattr(original, _WRAPPED, False):
        return

    @functools.wraps(original)
    def scale(self, outputs):
        scaled = original(self, outputs)
        factor = getattr(self, "_scale", None)
        if getattr(self, "_enabled", False) and isinstance(factor, torch.Tensor):
            for t in _tensors(scaled):
                if t.requires_grad:
                    t.register_hook(functools.partial(_scaled_backward_starts, factor))
        return scaled

    setattr(scale, _WRAPPED, True)
    cls.scale = scale


def _scaled_backward_starts(factor: torch.Tensor, grad):
    loss_scaling.begin_scaled_backward(factor)
    torch.autograd.Variable._execution_engine.queue_callback(loss_scaling.end_scaled_backward)
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
