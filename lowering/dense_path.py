"""The CUDA ops' dense path: exactly the dense FFN, cuBLAS through PyTorch, with its element-wise
steps fused into one pass each way (``dense_activation``, ``dense_activation_backward``).

In training it keeps ``relu(gate)``, ``up`` and ``h`` for its backward, as dense autograd does,
and returns TwELL buffers of the right shapes with every tile marked overflowed, so that any
backward treats every row as dense.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from twell_compile.kernels import DEFAULT_LAYOUT, TwellPacked, dense_activation, dense_activation_backward, reference


def dense_forward(x2d, wg, wu, wd, bg, bu, bd, training: bool, want_l1: bool, record=None):
    """The dense FFN in the input dtype (exactly what the rewrite replaced), with ``relu(gate) · up``
    in one pass (``dense_activation``) that stores the call's ``record`` (telemetry's
    ``call_record``): its active entries and the rows that would overflow a TwELL tile.

    Returns the result and, in training, ``(act, up, h)`` for the backward: what dense autograd
    saves.
    """
    up = F.linear(x2d, wu, bu)
    pre = up if wg is None else F.linear(x2d, wg, bg)
    m, hidden = pre.shape
    n_tiles, slots = DEFAULT_LAYOUT.n_tiles(hidden), DEFAULT_LAYOUT.slots
    dev = x2d.device
    l1_sum = torch.zeros(1, dtype=torch.float32, device=dev) if want_l1 else None
    h, act = dense_activation(pre, None if wg is None else up, store_act=training, record=record, l1=l1_sum, check=False)
    del pre  # gated: dense autograd keeps relu(gate), not gate
    out = F.linear(h, wd, bd)
    if training:
        # TwELL buffers of the right shapes with every tile marked overflowed: the backward then
        # treats every row as dense, so even one that does not know this forward was dense is
        # exact. Slots are never read (dense rows skip their pairs), so they stay uninitialised.
        packed = TwellPacked(
            idx=torch.empty(m, n_tiles, slots, dtype=torch.int32, device=dev),
            val=torch.empty(m, n_tiles, slots, dtype=torch.float32, device=dev),
            count=torch.full((m, n_tiles), slots + 1, dtype=torch.int32, device=dev),
        )
        up_val = torch.empty(packed.val.shape if wg is not None else (0,), dtype=torch.float32, device=dev)
    else:
        packed, up_val = None, None
    l1 = l1_sum[0] / max(1, m) if want_l1 else None
    saved = (act, up, h) if training else None
    return reference.ForwardResult(out, packed, up_val, None, l1), saved


def dense_backward(dout, x, wg, wu, wd, bg, bu, bd, l1_scale, saved=None) -> reference.Grads:
    """Dense autograd's formulas in the input dtype, on the forward's ``saved = (act, up, h)``,
    or on them recomputed from ``x`` when the forward kept none.

    The element-wise steps (L1 term, ReLU's ``threshold_backward``: ``0 where act <= 0``, NaN
    passes, and the products) run as one pass, ``dense_activation_backward``, bitwise eager's
    result; the L1 scale is cast to the input dtype first, as autograd's scalar gradient is. Each
    ``[M, H]`` tensor is dropped as soon as it is used for the last time (autograd frees saved
    tensors node by node), and ``dh`` becomes ``d_up`` in place, so the peak stays near dense
    autograd's.
    """
    gated = wg is not None
    if saved is not None:
        act, up, h = saved
        saved = None  # the caller passes the registry's only reference
    else:
        up = F.linear(x, wu, bu)
        act = torch.relu(F.linear(x, wg, bg) if gated else up)
        h = act * up if gated else act
    coef = (l1_scale / max(1, x.shape[0])).to(x.dtype)
    dh = dout @ wd
    dwd = dout.T @ h
    # dh += sign(h)·coef, then d_gate and d_up (into dh's storage), in one pass
    d_gate, d_up = dense_activation_backward(dh, h, act, coef, up if gated else None, check=False)
    del h, up, act, dh
    dx = torch.addmm(d_gate @ wg, d_up, wu) if gated else d_up @ wu
    return reference.Grads(
        dx=dx,
        dwg=d_gate.T @ x if gated else None,
        dwu=d_up.T @ x,
        dwd=dwd,
        dbg=d_gate.sum(0) if (gated and bg is not None) else None,
        dbu=d_up.sum(0) if bu is not None else None,
        dbd=dout.sum(0) if bd is not None else None,
    )
