"""``twell::ffn_bwd``: the backward of a TwELL FFN, with the L1 gradient injected.

Computes the gradients of ``loss + l1_coeff · l1_factor · L1`` for one layer, where
``L1 = (1/T) Σ_t Σ_j |h[t, j]|`` over the T tokens and ``l1_factor = S / n`` (the backward's loss
scale over the model's layer count; docs/architecture.md, 'The L1 regularizer'): ``dh`` at the
active (token, neuron) pairs gets ``l1_coeff · l1_factor / T · sign(h)`` added before it is
back-propagated. Every product runs on the active pairs only; dense rows run densely.

Like ``twell::ffn_train`` it is defined with ``torch.library.Library`` and an autograd kernel of
its own (``op_dispatch``) rather than ``torch.library.custom_op``: compiled backward graphs call it
once per layer and step, and ``custom_op``'s wrappers cost ~28 µs of that call's host time on a
CPU (docs/design-notes.md). Its own gradient is refused (no double backward).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from twell_compile.kernels import TwellPacked

from . import impl
from .checks import check_dout, check_ffn_args, check_l1_args
from .op_dispatch import autograd_kernel, below_autograd, plain_eager

_EMPTY = (0,)


_LIB = torch.library.Library("twell", "FRAGMENT")  # the namespace is shared with the other ops
_LIB.define(
    "ffn_bwd(Tensor dout, Tensor x, Tensor? wg, Tensor wu, Tensor wd, Tensor? bg, Tensor? bu, Tensor? bd, Tensor idx, "
    "Tensor val, Tensor count, Tensor up_val, Tensor l1_coeff, Tensor l1_factor, SymInt layer) "
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
    tags=(torch.Tag.needs_contiguous_strides, torch.Tag.pt2_compliant_tag),
)


def ffn_bwd_impl(
    dout: Tensor,
    x: Tensor,
    wg: Optional[Tensor],
    wu: Tensor,
    wd: Tensor,
    bg: Optional[Tensor],
    bu: Optional[Tensor],
    bd: Optional[Tensor],
    idx: Tensor,
    val: Tensor,
    count: Tensor,
    up_val: Tensor,
    l1_coeff: Tensor,
    l1_factor: Tensor,
    layer: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients ``(dx, dwg, dwu, dwd, dbg, dbu, dbd)`` of one TwELL FFN.

    Args:
        dout: ``[..., D]`` gradient of the FFN output.
        x, wg, wu, wd, bg, bu, bd: the forward's inputs (``nn.Linear`` layouts).
        idx, val, count, up_val: the TwELL tensors ``twell::ffn_train`` returned.
        l1_coeff: 0-d tensor on x's device; 0 turns the L1 term off exactly.
        l1_factor: 0-d tensor on x's device, read now: the loss scale over the model's layer count.
        layer: telemetry id of the layer.

    Returns:
        One gradient per tensor input; an absent weight or bias gets an empty ``[0]`` tensor
        (ops cannot return None).
    """
    return _grads(dout, x, wg, wu, wd, bg, bu, bd, idx, val, count, up_val, l1_coeff, l1_factor, layer)


def _grads(dout, x, wg, wu, wd, bg, bu, bd, idx, val, count, up_val, l1_coeff, l1_factor, layer, *, placeholders=True):
    """``twell::ffn_bwd``'s implementation; ``placeholders=False`` gives ``None`` for absent inputs
    instead of the op's empty tensors (autograd wants ``None`` there: no allocation)."""
    check_ffn_args(x, wg, wu, wd, bg, bu, bd)
    check_l1_args(x, l1_coeff, l1_factor)
    check_dout(dout, x)
    packed = TwellPacked(
        idx=idx.reshape(-1, *idx.shape[-2:]), val=val.reshape(-1, *val.shape[-2:]), count=count.reshape(-1, count.shape[-1])
    )
    up2d = up_val.reshape(-1, *up_val.shape[-2:]) if wg is not None else up_val  # plain: empty
    grads = impl.backward(
        impl.flatten_tokens(dout), impl.flatten_tokens(x), wg, wu, wd, bg, bu, bd, packed, up2d, l1_coeff * l1_factor,
        layer=layer,
    )

    def out(t):
        if t is None:
            return x.new_empty(_EMPTY) if placeholders else None
        return t.contiguous()

    return (grads.dx.reshape(x.shape), out(grads.dwg), out(grads.dwu), out(grads.dwd), out(grads.dbg), out(grads.dbu), out(grads.dbd))


def backward_grads(dout, x, wg, wu, wd, bg, bu, bd, idx, val, count, up_val, l1_coeff, l1_factor, layer):
    """``torch.ops.twell.ffn_bwd(...)`` for the training ops' autograd. In plain eager mode (real
    tensors, no dispatch mode, no functorch transform, grad mode off) it calls the implementation
    directly: the op's dispatch costs ~50 µs of host time per call on the H200's hosts, in the gap
    between a step's forward and backward, where the GPU waits for it; absent inputs then get
    ``None``, not the op's empty placeholders. Traced (torch.compile, make_fx, fake tensors), it is
    the op, so graphs still record it."""
    args = (dout, x, wg, wu, wd, bg, bu, bd, idx, val, count, up_val, l1_coeff, l1_factor, layer)
    if plain_eager(args):
        return _grads(*args, placeholders=False)
    return ffn_bwd(*args)


@torch.library.register_fake("twell::ffn_bwd", lib=_LIB)
def _(dout, x, wg, wu, wd, bg, bu, bd, idx, val, count, up_val, l1_coeff, l1_factor, layer):
    def like(t):
        return x.new_empty(_EMPTY) if t is None else torch.empty_like(t)

    return (torch.empty_like(x), like(wg), torch.empty_like(wu), torch.empty_like(wd), like(bg), like(bu), like(bd))


class _NoDoubleBackward(torch.autograd.Function):
    """The op under grad mode (a backward with ``create_graph=True``): its gradients are refused."""

    @staticmethod
    def forward(ctx, keyset, *args):
        return below_autograd(_OP, keyset, args)

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError("twell: double backward through twell::ffn_bwd is not supported")


def _autograd_kernel(keyset, *args):
    return autograd_kernel(_NoDoubleBackward, ffn_bwd_impl, _OP, keyset, args)


_LIB.impl("ffn_bwd", ffn_bwd_impl, "CompositeExplicitAutograd")
_LIB.impl("ffn_bwd", _autograd_kernel, "Autograd", with_keyset=True)
ffn_bwd = torch.ops.twell.ffn_bwd
_OP = ffn_bwd.default
