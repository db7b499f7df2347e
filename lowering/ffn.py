"""``twell::ffn``: the inference forward of a TwELL FFN.

On CUDA the gate GEMM packs its active entries into TwELL in its epilogue and a fused kernel
computes the up and down projections for the active neurons only; on CPU the PyTorch reference
does the same. Under autograd (rare: the rewrite picks ``twell::ffn_train`` when training) the
backward recomputes the forward with ``ffn_train`` and calls ``ffn_bwd`` with no L1 term, so the
gradients are exact.

The op is defined with ``torch.library.Library`` and an autograd kernel of its own, as
``twell::ffn_train`` is, rather than with ``torch.library.custom_op``, whose Python wrappers
(autograd, a ``torch._dynamo.disable`` frame, an aliasing check) cost every call host time: on
an H200 host a sparse call's best host time is 403-415 µs this way against 422-478 µs. Called
with real tensors and nothing to record for autograd, the autograd kernel runs the
implementation directly; traced (``torch.compile``, ``make_fx``, fake tensors) it redispatches
the op, so graphs record it.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import impl
from .checks import check_ffn_args
from .ffn_bwd import backward_grads
from .ffn_train import ffn_train, present_grads
from .op_dispatch import autograd_kernel, below_autograd, plain_eager

_LIB = torch.library.Library("twell", "FRAGMENT")  # the namespace is shared with the other ops
_LIB.define(
    "ffn(Tensor x, Tensor? wg, Tensor wu, Tensor wd, Tensor? bg, Tensor? bu, Tensor? bd, SymInt layer) -> Tensor",
    tags=(torch.Tag.needs_contiguous_strides, torch.Tag.pt2_compliant_tag),
)


def ffn_impl(
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
        ``[..., D]`` in x's dtype. It equals the dense FFN for every input (docs/architecture.md,
        'Exactness contract').

    Example::

        >>> x, wg, wu, wd = torch.randn(8, 16), torch.randn(64, 16), torch.randn(64, 16), torch.randn(16, 64)
        >>> out = torch.ops.twell.ffn(x, wg, wu, wd, None, None, None, 0)
    """
    check_ffn_args(x, wg, wu, wd, bg, bu, bd)
    res = impl.forward(impl.flatten_tokens(x), wg, wu, wd, bg, bu, bd, layer=layer, training=False)
    return res.out.reshape(x.shape)


@torch.library.register_fake("twell::ffn", lib=_LIB)
def _(x, wg, wu, wd, bg, bu, bd, layer):
    return torch.empty_like(x)


class _Ffn(torch.autograd.Function):
    """The op's autograd: its forward (the implementation in plain eager mode, else the op below
    autograd), with the op's inputs saved; the backward recomputes the TwELL tensors with
    ``ffn_train`` and takes the gradients with no L1 term."""

    @staticmethod
    def forward(ctx, keyset, x, wg, wu, wd, bg, bu, bd, layer):
        args = (x, wg, wu, wd, bg, bu, bd, layer)
        out = ffn_impl(*args) if plain_eager(args) else below_autograd(_OP, keyset, args)
        ctx.save_for_backward(x, wg, wu, wd, bg, bu, bd)
        ctx.layer = layer
        return out

    @staticmethod
    def backward(ctx, dout):
        x, wg, wu, wd, bg, bu, bd = ctx.saved_tensors
        zero = torch.zeros((), dtype=torch.float32, device=x.device)
        _, idx, val, count, up_val = ffn_train(x, wg, wu, wd, bg, bu, bd, zero, zero, ctx.layer)
        grads = backward_grads(dout.contiguous(), x, wg, wu, wd, bg, bu, bd, idx, val, count, up_val, zero, zero,
                               ctx.layer)
        return (None, *present_grads(grads, (wg, bg, bu, bd)), None)


def _autograd_kernel(keyset, x, wg, wu, wd, bg, bu, bd, layer):
    return autograd_kernel(_Ffn, ffn_impl, _OP, keyset, (x, wg, wu, wd, bg, bu, bd, layer))


_LIB.impl("ffn", ffn_impl, "CompositeExplicitAutograd")
_LIB.impl("ffn", _autograd_kernel, "Autograd", with_keyset=True)
ffn = torch.ops.twell.ffn
_OP = ffn.default
