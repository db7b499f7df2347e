"""Small Triton helpers shared by the kernel files, and the interpreter switch.

``INTERPRET`` is ``TRITON_INTERPRET=1``, read once at import: the kernels then run in Triton's
interpreter (the CPU tests), which computes bf16 ``tl.dot`` wrongly and cannot autotune over
several configs, so the launchers pick other tiles and configs and the kernels IEEE fp32
products under it. It must be set before any kernel module is imported (docs/architecture.md,
'Testing').

* ``jit_helper``: ``triton.jit`` for device helpers, a plain function under the interpreter;
* ``reduce_sum``, ``prefix_sum``: ``tl.sum`` and ``tl.cumsum``, cheap under the interpreter;
* ``column_mask``: the mask of a block of columns, constant when the block divides D;
* ``dot``, ``dot_split``: ``acc + a @ b`` on tensor cores or in IEEE fp32, and fp32 coefficients
  times 16-bit weights as ``hi + lo`` pairs;
* ``rowmajor`` (host): a tensor with a contiguous last dimension.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def jit_helper(fn):
    """``triton.jit`` for device helpers; a plain function under the interpreter, which re-patches
    ``triton.language`` on every call of a jit function (about 2 ms each, most of the CPU test
    time) while a plain function runs inside the kernel's already patched scope."""
    return fn if INTERPRET else triton.jit(fn)


if INTERPRET:
    # tl.sum and tl.cumsum are jit functions too: call the reduction they wrap directly. (Kernels
    # use tl.full, a builtin, rather than the jit tl.zeros for the same reason.)
    def reduce_sum(x, axis):
        return tl.reduce(x, axis, tl.standard._sum_combine)

    def prefix_sum(x, axis):
        return tl.associative_scan(x, axis, tl.standard._sum_combine)

else:

    @triton.jit
    def reduce_sum(x, axis: tl.constexpr):
        return tl.sum(x, axis=axis)

    @triton.jit
    def prefix_sum(x, axis: tl.constexpr):
        return tl.cumsum(x, axis=axis)


@jit_helper
def column_mask(offs, D, EVEN: tl.constexpr):
    """``offs < D``, or a constant all-true mask when ``EVEN`` (D a multiple of the block). A mask
    the compiler cannot fold keeps a predicate per element: at D = 2048 on sm90 the pair loop of
    ``sparse_ffn`` needed 112 registers a thread against 64 without it, and so fewer programs per SM."""
    if EVEN:
        return tl.full(offs.shape, 1, tl.int1)
    else:
        return offs < D


@jit_helper
def dot(a, b, acc, NATIVE: tl.constexpr):
    """``acc + a @ b``: tensor cores on 16-bit operands (exact products, fp32 sums), else IEEE fp32
    (also under the interpreter, whose bf16 tl.dot is wrong)."""
    if NATIVE:
        acc = tl.dot(a, b, acc)
    else:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return acc


@jit_helper
def dot_split(c, w, acc, SPLIT: tl.constexpr, NATIVE: tl.constexpr):
    """``acc + c @ w`` for fp32 ``c`` and 16/32-bit ``w``.

    SPLIT: ``c = hi + lo``, both in w's dtype, through two ``dot`` products (on tensor cores when
    NATIVE: about 16 bits of ``c``, where one product would round it to w's 8 or 11); ``lo`` is 0
    where ``c`` is ±Inf or NaN. The caller makes sure ``hi`` cannot overflow w's dtype where ``c``
    is finite. Otherwise IEEE fp32 products.
    """
    if SPLIT:
        hi = c.to(w.dtype)
        lo = tl.where(tl.abs(c) < float("inf"), c - hi.to(tl.float32), 0.0).to(w.dtype)
        acc = dot(hi, w, acc, NATIVE)
        acc = dot(lo, w, acc, NATIVE)
    else:
        acc = dot(c, w, acc, False)
    return acc


def rowmajor(t: torch.Tensor) -> torch.Tensor:
    """``t`` with a contiguous last dimension (a copy only when it is not)."""
    return t if t.stride(-1) == 1 else t.contiguous()
