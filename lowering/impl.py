"""Device dispatch for the TwELL ops: the CPU reference, or the Triton kernels on CUDA.

Both paths compute the same function as the dense FFN for every input (docs/architecture.md,
'Exactness contract'): overflowed rows and rows the finiteness guard flags are computed densely.
This module also records each call's counters (``telemetry``) without synchronising the host.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import Tensor

from twell_compile.kernels import DEFAULT_LAYOUT, TwellPacked, reference

from . import telemetry


def flatten_tokens(x: Tensor) -> Tensor:
    """``[..., D]`` → contiguous ``[M, D]``; M = product of the leading dims (the tokens)."""
    return x.reshape(-1, x.shape[-1]).contiguous()


def _no_autocast(fn):
    """Run an op implementation with autocast off: the op's inputs already carry the dtype the
    rewrite chose, and the reference's own matmuls must keep its wider compute dtype."""

    x_index = 1 if fn.__name__ == "backward" else 0

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        device_type = args[x_index].device.type
        if not torch.is_autocast_enabled(device_type):  # the usual case: no context to enter (host time)
            return fn(*args, **kwargs)
        with torch.autocast(device_type, enabled=False):
            return fn(*args, **kwargs)

    return wrapper


@_no_autocast
def forward(x2d: Tensor, wg, wu, wd, bg, bu, bd, *, layer: int, training: bool) -> reference.ForwardResult:
    """One FFN forward on ``[M, D]`` tokens; records ``layer``'s counters."""
    if x2d.is_cuda:
        from . import cuda_ffn

        return cuda_ffn.forward(x2d, wg, wu, wd, bg, bu, bd, layer=layer, training=training)[0]
    res, sparse = reference.ffn_forward_ref(x2d, wg, wu, wd, bg, bu, bd), True
    if training:
        hidden = wu.shape[0]
        telemetry.record_fired_packed(layer, res.packed, hidden, x2d.shape[0])
    telemetry.record(
        layer,
        tokens=x2d.shape[0],
        active=res.packed.count.sum(),
        dense_rows=res.dense_rows.sum(),
        l1=res.l1 if training else None,
        sparse=sparse,
    )
    return res


@_no_autocast
def backward(dout2d: Tensor, x2d: Tensor, wg, wu, wd, bg, bu, bd, packed: TwellPacked, up_val: Tensor, l1_scale: Tensor,
             *, layer: Optional[int] = None) -> reference.Grads:
    """Gradients of ``loss + l1_scale · L1`` (docs/architecture.md, 'The L1 regularizer') on ``[M, D]``
    tokens."""
    if x2d.is_cuda:
        from . import cuda_ffn

        return cuda_ffn.backward(dout2d, x2d, wg, wu, wd, bg, bu, bd, packed, up_val, l1_scale, layer=layer)
    return reference.ffn_backward_ref(dout2d, x2d, wg, wu, wd, bg, bu, bd, packed, up_val, l1_scale)


def saved_shapes(lead, hidden, gated: bool):
    """Shapes of the TwELL tensors the training op saves, from input shapes only (fake impls)."""
    n_tiles = (hidden + DEFAULT_LAYOUT.tile_n - 1) // DEFAULT_LAYOUT.tile_n
    slots = DEFAULT_LAYOUT.slots
    packed = (*lead, n_tiles, slots)
    return {
        "idx": packed,
        "val": packed,
        "count": (*lead, n_tiles),
        "up_val": packed if gated else (0,),
    }

