"""The backward's element-wise formulas, ``reference.ffn_backward_ref``'s, in fp32: shared by its
pair loops (``tokens_bwd``, ``wgrad``) and its dense rows (``dense_rows_bwd``, ``wgrad``).

* ``hidden_values``: ``act = relu(pre)`` and ``h = act · up`` (gated) or ``act`` (plain);
* ``sign_of``: ``torch.sign``, 0 for NaN: the L1 gradient ``scale · sign(h)`` that ``dh`` adds;
* ``pair_grads``: gated ``dgate = 0 if pre <= 0 else dh · up`` (NaN passes) and ``dup = dh · act``;
  plain ``dup = 0 if pre <= 0 else dh``.
"""

from __future__ import annotations

import triton.language as tl

from .triton_helpers import jit_helper


@jit_helper
def hidden_values(pre, up, GATED: tl.constexpr):
    """``(relu(pre), h)``; relu keeps NaN, as ``torch.relu`` does."""
    act = tl.where(pre <= 0.0, 0.0, pre)
    if GATED:
        hv = act * up
    else:
        hv = act
    return act, hv


@jit_helper
def sign_of(v):
    """``torch.sign``: -1, 0 or 1, and 0 for NaN."""
    return tl.where(v > 0.0, 1.0, tl.where(v < 0.0, -1.0, 0.0))


@jit_helper
def pair_grads(pre, up, act, dh, GATED: tl.constexpr):
    """``(dgate, dup)`` from ``dh``; plain FFNs return ``dup`` twice."""
    if GATED:
        d_gate = tl.where(pre <= 0.0, 0.0, dh * up)
        d_up = dh * act
    else:
        d_up = tl.where(pre <= 0.0, 0.0, dh)
        d_gate = d_up
    return d_gate, d_up
