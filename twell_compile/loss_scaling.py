"""The loss scale: what the loss was multiplied by before ``backward``, which the injected L1
gradient must follow to behave as part of the loss.

twell injects ``l1_coeff · ∂L1/∂θ`` in the backward, outside the user's loss. A training loop that
back-propagates ``S · loss`` instead of ``loss`` expects every term of the loss scaled by ``S``:
``torch.amp.GradScaler`` multiplies by its scale and divides the gradients back before the step,
and gradient accumulation back-propagates ``loss / K`` per micro-batch. The injected term is
multiplied by the same ``S``, so that

* AMP with a GradScaler gives the unscaled gradients of ``loss + l1_coeff · L1``;
* K micro-batches with ``loss / K`` give one step on the whole batch.

``S`` is the product of two parts:

* the GradScaler's scale, read on the device (no host sync) for the backward of a tensor that
  ``GradScaler.scale`` returned (``loss_scaling_hooks.py``), and 1 otherwise. The end of that
  backward ends it; a backward that raises never gets there, so its scale also ends when the
  scaled tensor is released, or at the next host factor change made while no backward runs;
* a host factor, 1 unless the training loop says otherwise: ``set_loss_scale(1 / K)``, or
  ``with loss_scale(1 / K): ...`` around the backward. accelerate's ``Accelerator.backward`` and the
  Hugging Face Trainer (``integrations.TwellCallback``) set it from their accumulation steps.

The value reaches the ops through each model's live L1 factor (``layers.py``), which their
backward reads: ``layers`` subscribes to every change of ``S`` (``on_change``).
"""

from __future__ import annotations

import contextlib
import math
import threading
from typing import Callable, Iterator, Optional

import torch

_lock = threading.RLock()
_factor = 1.0  # the host factor
_scaler_scale: Optional[torch.Tensor] = None  # a GradScaler's scale, during the backward it scaled
_scaled_by: Optional[object] = None  # the hook that set it: only its end, or a stale check, clears it
_listeners: list[Callable[[], None]] = []  # called after every change of S


def on_change(listener: Callable[[], None]) -> None:
    """Call ``listener()`` after every change of ``S`` (under this module's lock)."""
    _listeners.append(listener)


def get_loss_scale() -> float:
    """The host factor of the loss scale (``set_loss_scale``'s value; 1 by default)."""
    return _factor


def set_loss_scale(factor: float) -> None:
    """Tell twell that the loss is multiplied by ``factor`` before ``backward`` (besides any
    ``torch.amp.GradScaler``, which twell follows itself), so the injected L1 gradient is too.

    For gradient accumulation over K micro-batches that back-propagates ``loss / K``::

        >>> twell_compile.set_loss_scale(1 / K)
    """
    global _factor
    _check_factor(factor)
    with _lock:
        _factor = float(factor)
        if _stale():
            _clear_scale()
        _refresh()


@contextlib.contextmanager
def loss_scale(factor: float) -> Iterator[None]:
    """``set_loss_scale(factor)`` for the ``with`` block, then back to the previous value::

        >>> with twell_compile.loss_scale(1 / K):
        ...     (loss / K).backward()
    """
    _check_factor(factor)
    previous = _factor
    set_loss_scale(factor)
    try:
        yield
    finally:
        set_loss_scale(previous)


def begin_scaled_backward(scale: torch.Tensor, token: object) -> None:
    """A backward of ``GradScaler.scale(loss)`` starts: ``scale`` (its device tensor) joins ``S``
    until ``end_scaled_backward(token)``."""
    global _scaler_scale, _scaled_by
    with _lock:
        _scaler_scale, _scaled_by = scale, token
        _refresh()


def end_scaled_backward(token: object) -> None:
    """The scaled backward ``token`` is over (a later one's scale, if any, stays)."""
    with _lock:
        if _scaled_by is token:
            _clear_scale()
            _refresh()


def _stale() -> bool:
    # -1: no backward is running on this thread, so none owns the scale.
    return _scaler_scale is not None and torch._C._current_graph_task_id() == -1


def _clear_scale() -> None:
    global _scaler_scale, _scaled_by
    _scaler_scale = _scaled_by = None


def write_scaled(dst: torch.Tensor, value: float, device: str) -> None:
    """``dst = value · S`` on ``dst``'s device, with no host sync."""
    scale = _scaler_scale
    if scale is None:
        dst.fill_(value * _factor)
    else:
        dst.copy_(scale.detach().reshape(()).to(dst.device, torch.float32, non_blocking=True))
        dst.mul_(value * _factor)


def _refresh() -> None:
    for listener in _listeners:
        listener()


def _check_factor(factor: float) -> None:
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not math.isfinite(factor) or factor <= 0:
        raise ValueError(f"twell: loss scale {factor!r} is not accepted; expected a finite number > 0 "
                         "(what the loss is multiplied by before backward, e.g. 1 / accumulation_steps)")
