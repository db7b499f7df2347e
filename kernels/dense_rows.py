"""Dense rows of the sparse kernels: their list, and their fp32 coefficients times weights over H.

A few rows of a sparse batch are computed densely: rows with many overflowed tiles, rows of the
finiteness guard. The forward (``sparse_ffn``) and the backward (``sparse_ffn_backward``) first
write those rows' per-neuron values (``h``; ``dgate`` and ``dup``) into an fp32 scratch
``[planes, r_cap, H]``, one ``[16, BH]`` tile per program. This module turns the scratch into rows
of the output: ``dst[rows[i]] = Σ_planes coef[p, i, :] @ W_p (+ bias)``.

H is split over programs, then the splits are summed in a fixed order (deterministic, one writer
per output element). Before the split, the H200 took milliseconds for a single dense row at
D = 2048, H = 5632: a handful of programs each looped over all of H (4.7 ms in the backward, 1.5 ms
in the forward); split, it takes tens of microseconds.

Everything runs on the device from ``n_dense`` (an int32 ``[1]`` tensor): no host sync, CUDA-graph
capturable. List positions past ``n_dense`` cost one early return per program.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# Set before import (DESIGN.md section 9): the interpreter computes bf16 tl.dot wrongly.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

# Rows per dense tile: the smallest tl.dot M dimension on tensor cores.
BR = 16
# Scratch budget of each launcher's dense rows (fp32 values of the first r_cap list positions);
# rows past it take that launcher's blocked kernels.
SCRATCH_BYTES = 32 << 20


def jit_helper(fn):
    """``triton.jit`` for device helpers; a plain function under the interpreter, which re-patches
    ``triton.language`` on every call of a jit function (about 2 ms each, most of the CPU test
    time) while a plain function runs inside the kernel's already patched scope."""
    return fn if INTERPRET else triton.jit(fn)


def rowmajor(t: torch.Tensor) -> torch.Tensor:
    """``t`` with a contiguous last dimension (a copy only when it is not)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def dense_list(flags: torch.Tensor):
    """``(rows, n_dense)``: int32 ``[M]`` list of the flagged rows in increasing order (entries past
    ``n_dense`` are unspecified) and int32 ``[1]`` count. Device ops, unique scatter targets."""
    m = flags.shape[0]
    dev = flags.device
    csum = torch.cumsum(flags.to(torch.int32), 0, dtype=torch.int32)
    ar = torch.arange(m, dtype=torch.int32, device=dev)
    target = torch.where(flags, csum - 1, ar + m).long()  # the others go to a dump half
    rows = torch.zeros(2 * m, dtype=torch.int32, device=dev)
    rows.scatter_(0, target, ar)
    return rows, csum[-1:]


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


@triton.jit
def _split_product_kernel(
    # pointers (w2, plane 1: read only when TWO)
    coef_ptr, w1_ptr, w2_ptr, ndense_ptr, part_ptr,
    # dimensions (PLANE = R_CAP · H; H_PER: the H columns of one split)
    D, H, R_CAP, PLANE, H_PER,
    # row strides (elements)
    stride_w1, stride_w2,
    # meta-parameters
    TWO: tl.constexpr, SPLIT: tl.constexpr, NATIVE: tl.constexpr, BR: tl.constexpr, BH: tl.constexpr, BD: tl.constexpr,
):
    """``part[s, i, dblock] = Σ_{j in split s} coef[0, i, j] · W1[j, dblock] (+ coef[1, i, j] ·
    W2[j, dblock])`` for the ``BR`` list positions ``i < n_dense`` of this program."""
    i0 = tl.program_id(0) * BR
    n_dense = tl.load(ndense_ptr)
    if i0 < n_dense:
        i = i0 + tl.arange(0, BR)
        r_ok = i < n_dense
        offs_d = tl.program_id(1) * BD + tl.arange(0, BD)
        d_ok = offs_d < D
        h_lo = tl.program_id(2) * H_PER
        h_hi = tl.minimum(H, h_lo + H_PER)
        acc = tl.full((BR, BD), 0.0, tl.float32)
        for h0 in range(h_lo, h_hi, BH):
            hc = h0 + tl.arange(0, BH)
            h_ok = hc < h_hi
            hc = hc.to(tl.int64)
            at = i.to(tl.int64)[:, None] * H + hc[None, :]
            ok = r_ok[:, None] & h_ok[None, :]
            w_mask = h_ok[:, None] & d_ok[None, :]
            c1 = tl.load(coef_ptr + at, mask=ok, other=0.0)
            w1 = tl.load(w1_ptr + hc[:, None] * stride_w1 + offs_d[None, :], mask=w_mask, other=0.0)
            acc = dot_split(c1, w1, acc, SPLIT, NATIVE)
            if TWO:
                c2 = tl.load(coef_ptr + PLANE + at, mask=ok, other=0.0)
                w2 = tl.load(w2_ptr + hc[:, None] * stride_w2 + offs_d[None, :], mask=w_mask, other=0.0)
                acc = dot_split(c2, w2, acc, SPLIT, NATIVE)
        part = part_ptr + tl.program_id(2).to(tl.int64) * R_CAP * D
        tl.store(part + i.to(tl.int64)[:, None] * D + offs_d[None, :], acc, mask=r_ok[:, None] & d_ok[None, :])


@triton.jit
def _split_sum_kernel(
    part_ptr, rows_ptr, ndense_ptr, bias_ptr, dst_ptr,
    D, R_CAP, N_SPLIT, stride_dst,
    HAS_BIAS: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr,
):
    """``dst[rows[i], dblock] = Σ_s part[s, i, dblock] (+ bias)``, one rounding, for ``i < n_dense``."""
    i0 = tl.program_id(0) * BR
    n_dense = tl.load(ndense_ptr)
    if i0 < n_dense:
        i = i0 + tl.arange(0, BR)
        r_ok = i < n_dense
        offs_d = tl.program_id(1) * BD + tl.arange(0, BD)
        d_ok = offs_d < D
        ok = r_ok[:, None] & d_ok[None, :]
        at = i.to(tl.int64)[:, None] * D + offs_d[None, :]
        acc = tl.full((BR, BD), 0.0, tl.float32)
        for s in range(N_SPLIT):
            acc += tl.load(part_ptr + s * R_CAP * D + at, mask=ok, other=0.0)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
        rows = tl.load(rows_ptr + i, mask=r_ok, other=0).to(tl.int64)
        tl.store(dst_ptr + rows[:, None] * stride_dst + offs_d[None, :], acc.to(dst_ptr.dtype.element_ty), mask=ok)


def split_count(h: int, bh: int) -> int:
    """H splits of ``scratch_product``: about 8 ``bh`` blocks per program, at most 16 splits."""
    return max(1, min(16, triton.cdiv(h, 8 * bh)))


def scratch_product(coef: torch.Tensor, rows: torch.Tensor, n_dense: torch.Tensor, weights, dst: torch.Tensor,
                    bias=None, *, split: bool, bh: int, bd: int, warps: int) -> None:
    """``dst[rows[i]] = Σ_p coef[p, i] @ weights[p] (+ bias)`` for list positions ``i < n_dense``.

    ``coef``: fp32 ``[planes, r_cap, H]`` (``r_cap`` a multiple of ``BR``; planes past
    ``len(weights)`` are not read); ``weights``: one or two ``[H, D]`` tensors with a contiguous
    last dimension; ``dst``: ``[M, D]``, rows not in the list are left alone; ``split``: the
    ``hi + lo`` products of ``dot_split``. Temporary: fp32 ``[split_count, r_cap, D]``.
    """
    r_cap, h = coef.shape[1], coef.shape[2]
    d = weights[0].shape[1]
    n_split = split_count(h, bh)
    h_per = triton.cdiv(triton.cdiv(h, n_split), bh) * bh
    n_split = triton.cdiv(h, h_per)
    part = torch.empty(n_split, r_cap, d, dtype=torch.float32, device=coef.device)
    w1, w2 = weights[0], weights[-1]
    _split_product_kernel[(r_cap // BR, triton.cdiv(d, bd), n_split)](
        coef, w1, w2, n_dense, part, d, h, r_cap, r_cap * h, h_per, w1.stride(0), w2.stride(0),
        TWO=len(weights) == 2, SPLIT=split, NATIVE=not INTERPRET, BR=BR, BH=bh, BD=bd, num_warps=warps,
    )
    _split_sum_kernel[(r_cap // BR, triton.cdiv(d, bd))](
        part, rows, n_dense, bias if bias is not None else part, dst, d, r_cap, n_split, dst.stride(0),
        HAS_BIAS=bias is not None, BR=BR, BD=bd, num_warps=4,
    )
