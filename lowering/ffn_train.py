"""``twell::ffn_train``: the training forward of a TwELL FFN, and its autograd.

It returns the FFN output plus the compact TwELL tensors its backward needs, so nothing dense of
size ``[tokens, H]`` is saved. Its autograd calls ``twell::ffn_bwd``, which injects the gradient
of ``l1_coeff · L1`` (docs/architecture.md, 'The L1 regularizer'). ``l1_coeff`` is a 0-d tensor,
so changing its value (schedules, warm-up) never recompiles.

The op is defined with ``torch.library.Library`` and has an autograd kernel of its own (an
``autograd.Function``) rather than ``torch.library.custom_op``'s: that one fills the schema's
defaults on every call with grad (a loop that rebuilds the schema's argument list twice per
argument), 54 µs of dispatch per training forward on a CPU against 14 µs for an
``autograd.Function``. In plain eager mode the forward also calls the implementation directly, as
the backward does (``ffn_bwd.backward_grads``); traced (``torch.compile``, ``make_fx``, fake
tensors) it redispatches the op, so graphs record it.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import impl
from .checks import check_ffn_args, check_l1_args
from .ffn_bwd import backward_grads
from .op_dispatch import autograd_kernel, below_autograd, plain_eager

_LIB = torch.library.Library("twell", "FRAGMENT")  # the namespace is shared with the other ops
_LIB.define(
    "ffn_train(Tensor x, Tensor? wg, Tensor wu, Tensor wd, Tensor? bg, Tensor? bu, Tensor? bd, Tensor l1_coeff, "
    "Tensor l1_factor, SymInt layer) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
    tags=(torch.Tag.needs_contiguous_strides, torch.Tag.pt2_compliant_tag),
)


def ffn_train_impl(
    x: Tensor,
    wg: Optional[Tensor],
    wu: Tensor,
    wd: Tensor,
    bg: Optional[Tensor],
    bu: Optional[Tensor],
    bd: Optional[Tensor],
    l1_coeff: Tensor,
    l1_factor: Tensor,
    layer: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Forward of a gated (``wg`` given) or plain ReLU FFN for training.

    Args:
        x: ``[..., D]`` tokens; float16, bfloat16, float32 (float64 on CPU).
        wg, wu: ``[H, D]`` gate and up weights (``nn.Linear`` layout); ``wg=None`` is a plain FFN.
        wd: ``[D, H]`` down weight.
        bg, bu, bd: optional biases ``[H]``, ``[H]``, ``[D]``.
        l1_coeff: 0-d float32 tensor on x's device: the layer's L1 coefficient for this forward (a
            value that later writes do not change: the caller's snapshot).
        l1_factor: 0-d float32 tensor on x's device, read when the backward runs: ``S / n``, the
            loss scale of that backward over the number of layers of the model, which the L1
            term is a mean over (docs/architecture.md, 'The L1 regularizer').
        layer: telemetry id (``twell_compile.stats()``).

    Returns:
        ``(out, idx, val, count, up_val)``: ``out [..., D]`` and the TwELL buffers of the gate
        (``[..., n_tiles, slots]``; ``count [..., n_tiles]``) with the up values at its slots
        (gated) or an empty ``up_val`` (plain). Only ``out`` is differentiable.

    Example::

        >>> x, wg, wu, wd = torch.randn(8, 16), torch.randn(64, 16), torch.randn(64, 16), torch.randn(16, 64)
        >>> out = torch.ops.twell.ffn_train(x, wg, wu, wd, None, None, None, torch.tensor(2e-5), torch.tensor(1.0), 0)[0]
    """
    check_ffn_args(x, wg, wu, wd, bg, bu, bd)
    check_l1_args(x, l1_coeff, l1_factor)
    lead = x.shape[:-1]
    res = impl.forward(impl.flatten_tokens(x), wg, wu, wd, bg, bu, bd, layer=layer, training=True)
    shapes = impl.saved_shapes(lead, wu.shape[0], wg is not None)
    return (
        res.out.reshape(x.shape),
        res.packed.idx.reshape(shapes["idx"]),
        res.packed.val.reshape(shapes["val"]),
        res.packed.count.reshape(shapes["count"]),
        res.up_val.reshape(shapes["up_val"]),
    )


@torch.library.register_fake("twell::ffn_train", lib=_LIB)
def _(x, wg, wu, wd, bg, bu, bd, l1_coeff, l1_factor, layer):
    shapes = impl.saved_shapes(x.shape[:-1], wu.shape[0], wg is not None)
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    return (
        torch.empty_like(x),
        x.new_empty(shapes["idx"], dtype=torch.int32),
        x.new_empty(shapes["val"], dtype=acc),
        x.new_empty(shapes["count"], dtype=torch.int32),
        x.new_empty(shapes["up_val"], dtype=acc),
    )


class _Train(torch.autograd.Function):
    """The op's autograd: its forward (the implementation in plain eager mode, else the op below
    autograd), with the op's inputs and TwELL outputs saved for its backward."""

    @staticmethod
    def forward(ctx, keyset, x, wg, wu, wd, bg, bu, bd, l1_coeff, l1_factor, layer):
        args = (x, wg, wu, wd, bg, bu, bd, l1_coeff, l1_factor, layer)
        output = ffn_train_impl(*args) if plain_eager(args) else below_autograd(_OP, keyset, args)
        _, idx, val, count, up_val = output
        ctx.mark_non_differentiable(idx, val, count, up_val)
        # Without this, eager autograd hands the backward zero-filled gradients of the four TwELL
        # outputs: four [tokens, n_tiles, slots]-sized memsets per step, never read (on the H200 at
        # the 2B shape ~0.13 ms of host time, ~35 us of GPU time and 135 MB of the step's peak).
        ctx.set_materialize_grads(False)
        # l1_factor is written through .data (no version bump) while a backward may be pending.
        ctx.save_for_backward(x, wg, wu, wd, bg, bu, bd, idx, val, count, up_val, l1_coeff, l1_factor)
        ctx.layer = layer
        return output

    @staticmethod
    def backward(ctx, dout, _didx, _dval, _dcount, _dup):
        x, wg, wu, wd, bg, bu, bd, idx, val, count, up_val, l1_coeff, l1_factor = ctx.saved_tensors
        if dout is None:  # no gradient reached out (grads are not materialised); the L1 term still has one
            dout = torch.zeros_like(x)
        grads = backward_grads(dout.contiguous(), x, wg, wu, wd, bg, bu, bd, idx, val, count, up_val, l1_coeff,
                               l1_factor, ctx.layer)
        return (None, *present_grads(grads, (wg, bg, bu, bd)), None, None, None)


def _autograd_kernel(keyset, x, wg, wu, wd, bg, bu, bd, l1_coeff, l1_factor, layer):
    return autograd_kernel(_Train, ffn_train_impl, _OP, keyset, (x, wg, wu, wd, bg, bu, bd, l1_coeff, l1_factor, layer))


def present_grads(grads, optional_inputs):
    """Map ``ffn_bwd``'s empty placeholders back to ``None`` for absent inputs."""
    dx, dwg, dwu, dwd, dbg, dbu, dbd = grads
    wg, bg, bu, bd = optional_inputs
    return (
        dx,
        None if wg is None else dwg,
        dwu,
        dwd,
        None if bg is None else dbg,
        None if bu is None else dbu,
        None if bd is None else dbd,
    )


_LIB.impl("ffn_train", ffn_train_impl, "CompositeExplicitAutograd")
_LIB.impl("ffn_train", _autograd_kernel, "Autograd", with_keyset=True)
ffn_train = torch.ops.twell.ffn_train
_OP = ffn_train.default
