"""``twell::ffn``: the inference forward of a TwELL FFN.

On CUDA the gate GEMM packs its active entries into TwELL in its epilogue and a fused kernel
computes the up and down projections for the active neurons only; on CPU the PyTorch reference
does the same. Under autograd (rare: the rewrite picks ``twell::ffn_train`` when training) the
backward recomputes the forward with ``ffn_train`` and calls ``ffn_bwd`` with no L1 term, so the
gradients are exact.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import impl
from .checks import check_ffn_args
from .ffn_bwd import backward_grads
from .ffn_train import ffn_train, present_grads


@torch.library.custom_op("twell::ffn", mutates_args=(), tags=(torch.Tag.needs_contiguous_strides,))
def ffn(
    x: Tensor,
    wg: Optional[Tensor],
    wu: Tensor,
    wd: Tensor,
    bg: Optional[Tensor],
    bu: Optional[Tensor],
    bd: Optional[Tensor],
    layer: int,
) -> Tensor:
    """``out = (relu(x Wgᵀ + bg) ⊙ (x Wuᵀ + bu)) Wdᵀ + bd``, or ``relu(x Wuᵀ + bu) Wdᵀ + bd`` if ``wg`` is None.

    Args:
        x: ``[..., D]`` tokens; float16, bfloat16, float32 (float64 on CPU).
        wg, wu: ``[H, D]`` gate and up weights (``nn.Linear`` layout).
        wd: ``[D, H]`` down weight.
        bg, bu, bd: optional biases ``[H]``, ``[H]``, ``[D]``.
        layer: telemetry id (``twell_compile.stats()``).

    Returns:
        ``[..., D]`` in x's dtype. It equals the dense FFN for every input (DESIGN.md section 5).

    Example::

        >>> x, wg, wu, wd = torch.randn(8, 16), torch.randn(64, 16), torch.randn(64, 16), torch.randn(16, 64)
        >>> out = torch.ops.twell.ffn(x, wg, wu, wd, None, None, None, 0)
    """
    check_ffn_args(x, wg, wu, wd, bg, bu, bd)
    res = impl.forward(impl.flatten_tokens(x), wg, wu, wd, bg, bu, bd, layer=layer, training=False)
    return res.out.reshape(x.shape)


@ffn.register_fake
def _(x, wg, wu, wd, bg, bu, bd, layer):
    return torch.empty_like(x)


def _setup_context(ctx, inputs, output):
    x, wg, wu, wd, bg, bu, bd, layer = inputs
    ctx.save_for_backward(x, wg, wu, wd, bg, bu, bd)
    ctx.layer = layer


def _backward(ctx, dout):
    x, wg, wu, wd, bg, bu, bd = ctx.saved_tensors
    zero = torch.zeros((), dtype=torch.float32, device=x.device)
    _, idx, val, count, up_val = ffn_train(x, wg, wu, wd, bg, bu, bd, zero, 1, ctx.layer)
    grads = backward_grads(dout.contiguous(), x, wg, wu, wd, bg, bu, bd, idx, val, count, up_val, zero, 1, ctx.layer)
    return (*present_grads(grads, (wg, bg, bu, bd)), None)


ffn.register_autograd(_backward, setup_context=_setup_context)
