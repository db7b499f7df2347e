"""The dense rows' scratch product: fp32 per-neuron coefficients times weights, over all of H.

The forward (``dense_rows_fwd``) and the backward (``dense_rows_bwd``) first write their dense rows'
per-neuron values (``h``; ``dgate`` and ``dup``) into an fp32 scratch ``[planes, r_cap, H]``, one
``[BR, BH]`` tile per program. ``scratch_product`` turns the scratch into rows of the output:

    dst[rows[i]] = Σ_p coef[p, i, :] @ W_p (+ bias)        for the list positions i < n_dense

H is split over ``split_count`` programs per output tile, each writing an fp32 partial; the last
split of each tile to finish (a ticket, ``tickets.last_to_arrive``) sums the partials in split
order: deterministic, one writer per output element, one rounding. Coefficients times 16-bit
weights go through ``dot_split``'s ``hi + lo`` pairs on tensor cores.

Bytes: the coefficients, ``planes·r_cap·H·4``, read once; each weight read once per ``BR`` list
positions; the partials, ``splits·r_cap·D·4``, written and read once; the listed rows of ``dst``
written once. On the H200 at D=2048, H=5632 a dense row costs tens of microseconds this way (the
backward 3.04 ms with one dense row, 2.95 ms with none).

The scratch holds the first ``r_cap`` list positions (``scratch_capacity``); the launchers' blocked
kernels compute the positions past it, in ``BLOCKED_ROW_PROGRAMS`` programs that loop over them.
Everything runs from ``n_dense`` on the device: no host sync, CUDA-graph capturable, and list
positions past ``n_dense`` cost one early return per program.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from .launch import cdiv, launch
from .tickets import last_to_arrive, zeroed_scratch
from .triton_helpers import INTERPRET, dot_split


# Rows per dense tile: the smallest tl.dot M dimension on tensor cores.
BR = 16
# Scratch budget of each launcher's dense rows (fp32 values of the first r_cap list positions);
# rows past it take that launcher's blocked kernels.
SCRATCH_BYTES = 32 << 20
# The scratch also holds at least this fraction of a call's rows, the most that the dispatch
# (the lowering's SPARSE_MAX_DENSE_ROWS) lets the sparse path compute densely: rows past the
# scratch are slow, above all in the backward (on the H200, 16 rows past it cost a training step
# ~3.4 ms).
DENSE_ROW_FRACTION_MAX = 0.02
# Row blocks in the grids of the kernels for list positions past the scratch, which loop over the
# rest: a program per block of M - r_cap rows, nearly all returning at once, cost the H200 18 us
# of a training step (16 thousand programs). Two in the interpreter, so the CPU tests run the loop.
BLOCKED_ROW_PROGRAMS = 2 if INTERPRET else 128


@triton.jit
def _split_product_kernel(
    # pointers (w2, plane 1: read only when TWO)
    coef_ptr, w1_ptr, w2_ptr, rows_ptr, ndense_ptr, part_ptr, tickets_ptr, bias_ptr, dst_ptr,
    # dimensions (PLANE = R_CAP · H; H_PER: the H columns of one split)
    D, H, R_CAP, PLANE, H_PER,
    # row strides (elements)
    stride_w1, stride_w2, stride_dst,
    # meta-parameters
    TWO: tl.constexpr, SPLIT: tl.constexpr, NATIVE: tl.constexpr, HAS_BIAS: tl.constexpr, BR: tl.constexpr,
    BH: tl.constexpr, BD: tl.constexpr,
):
    """``part[s, i, dblock] = Σ_{j in split s} coef[0, i, j] · W1[j, dblock] (+ coef[1, i, j] ·
    W2[j, dblock])`` for the ``BR`` list positions ``i < n_dense`` of this program; the last split
    of each ``(i, dblock)`` tile to finish (a ticket per tile) then writes ``dst[rows[i], dblock] =
    Σ_s part[s, i, dblock] (+ bias)``, summed in split order (deterministic, one rounding)."""
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
        ok = r_ok[:, None] & d_ok[None, :]
        at = i.to(tl.int64)[:, None] * D + offs_d[None, :]
        tl.store(part_ptr + tl.program_id(2).to(tl.int64) * R_CAP * D + at, acc, mask=ok)
        tile = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
        if last_to_arrive(tickets_ptr + tile, tl.num_programs(2), True):
            acc = tl.full((BR, BD), 0.0, tl.float32)
            for s in range(tl.num_programs(2)):
                acc += tl.load(part_ptr + s * R_CAP * D + at, mask=ok, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                acc += tl.load(bias_ptr + offs_d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
            rows = tl.load(rows_ptr + i, mask=r_ok, other=0).to(tl.int64)
            tl.store(dst_ptr + rows[:, None] * stride_dst + offs_d[None, :], acc.to(dst_ptr.dtype.element_ty), mask=ok)


def scratch_capacity(m: int, bytes_per_row: int, requested: Optional[int] = None) -> int:
    """``r_cap``: the dense-row list positions given scratch, a multiple of ``BR`` and at most
    ``m`` rounded up to one: ``requested`` (tests), else ``SCRATCH_BYTES`` worth and at least
    ``DENSE_ROW_FRACTION_MAX`` of the rows."""
    m_pad = cdiv(m, BR) * BR
    if requested is not None:
        return min(m_pad, cdiv(requested, BR) * BR)
    budget = max(BR, SCRATCH_BYTES // bytes_per_row // BR * BR)
    return min(m_pad, max(budget, cdiv(math.ceil(DENSE_ROW_FRACTION_MAX * m), BR) * BR))


def scratch_tiles(dtype: torch.dtype) -> tuple[int, int, int, int]:
    """``(BH, BK, BD, warps)`` of the kernels that write the scratch and of ``scratch_product``, for
    inputs of ``dtype``; ``BK`` is also the weight-gradient kernel's for the rows past the scratch."""
    if INTERPRET:
        return 32, 32, 32, 4  # the interpreter needs tl.dot dims >= 16, and small ones are fast
    # Dense rows are rare (overflow, guard): small row tiles waste little on an isolated row.
    # fp32 tiles take twice the shared memory: 128-wide D blocks needed 240 KiB on the H200
    # (limit 227 KiB), so fp32 uses 64.
    return 64, 64, (64 if dtype == torch.float32 else 128), 4


def split_count(h: int, bh: int) -> int:
    """H splits of ``scratch_product``: about 8 ``bh`` blocks per program, at most 16 splits."""
    return max(1, min(16, cdiv(h, 8 * bh)))


def scratch_product(coef: torch.Tensor, rows: torch.Tensor, n_dense: torch.Tensor, weights, dst: torch.Tensor,
                    bias=None, *, split: bool, bh: int, bd: int, warps: int, reuse_tickets: bool = False) -> None:
    """``dst[rows[i]] = Σ_p coef[p, i] @ weights[p] (+ bias)`` for list positions ``i < n_dense``.

    ``coef``: fp32 ``[planes, r_cap, H]`` (``r_cap`` a multiple of ``BR``; planes past
    ``len(weights)`` are not read); ``weights``: one or two ``[H, D]`` tensors with a contiguous
    last dimension; ``dst``: ``[M, D]``, rows not in the list are left alone; ``split``: the
    ``hi + lo`` products of ``dot_split``. One launch: each output tile's last split sums the
    splits. Temporaries: fp32 ``[split_count, r_cap, D]`` and an int32 ticket per output tile
    (``zeroed_scratch``, kept with ``reuse_tickets``).
    """
    r_cap, h = coef.shape[1], coef.shape[2]
    d = weights[0].shape[1]
    n_split = split_count(h, bh)
    h_per = cdiv(cdiv(h, n_split), bh) * bh
    n_split = cdiv(h, h_per)
    part = torch.empty(n_split, r_cap, d, dtype=torch.float32, device=coef.device)
    grid = (r_cap // BR, cdiv(d, bd), n_split)
    tickets = zeroed_scratch(grid[0] * grid[1], coef.device, reuse=reuse_tickets)
    w1, w2 = weights[0], weights[-1]
    launch(_split_product_kernel, grid,
        coef, w1, w2, rows, n_dense, part, tickets, bias if bias is not None else part, dst,
        d, h, r_cap, r_cap * h, h_per, w1.stride(0), w2.stride(0), dst.stride(0),
        TWO=len(weights) == 2, SPLIT=split, NATIVE=not INTERPRET, HAS_BIAS=bias is not None, BR=BR, BH=bh, BD=bd,
        num_warps=warps,
    )


KERNELS = {"split_product": _split_product_kernel}
