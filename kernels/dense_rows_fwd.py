"""The forward's whole-dense rows: a dense FFN over all H for the rows the pair loop cannot finish.

Math (the dense rows of ``reference.ffn_forward_ref``): ``out[r] = h_r @ Wdᵀ + bd`` with
``h_r = relu(x_r Wgᵀ + bg) ⊙ (x_r Wuᵀ + bu)`` (gated) or ``relu(x_r Wuᵀ + bu)`` (plain), in fp32;
gate, up and h overflow to ±Inf where dense PyTorch's rounding to the input dtype would, and
``relu`` keeps NaN, as in ``sparse_ffn``'s pair loop; one rounding at the output.

The rows come listed on the device (``row_lists.RowList``). The first ``r_cap`` list positions
(288 at D=2048, H=5632: a 32 MiB scratch budget, or 2% of the rows if more;
``dense_rows.scratch_capacity``): ``_dense_hidden_kernel`` writes their ``h`` as fp32 ``[16, BH]``
tiles from ``tl.dot`` over D, then ``dense_rows.scratch_product`` multiplies by ``Wdᵀ`` with H split
over programs. Past ``r_cap``: ``_dense_rows_kernel``, one program per (``BM`` list positions,
``BD`` output columns), gate and up recomputed for each of the ``D / BD`` column blocks (exact,
slow). On the H200 (bf16, D=2048, H=5632) the scratch path takes 0.05 ms for 1–14 rows and
0.17 ms for 288.

Bytes per ``BR`` scratch rows: their x rows, ``BR·D·e``; ``Wg`` and ``Wu`` once (``2·H·D·e``); ``h``,
``BR·H·4``, written and read once; then ``Wdᵀ`` once in ``scratch_product``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .dense_rows import BLOCKED_ROW_PROGRAMS, BR, scratch_capacity, scratch_product, scratch_tiles, split_count
from .launch import cdiv, launch, next_power_of_2
from .triton_helpers import INTERPRET, dot, dot_split, jit_helper


# Blocked dense kernel (BM, BH, BK, BD, warps, stages) for list positions past r_cap, by input
# element size. GPU: the largest tiles that compile without spills on sm90 (ptxas -v, D=2048,
# H=5632: 215 registers for bf16, 212 for fp32).
DENSE_TILES = {2: (32, 64, 64, 512, 8, 3), 4: (32, 64, 64, 256, 8, 3)}
_DENSE_TILES_INTERPRET = (16, 32, 32, 64, 4, 1)


@jit_helper
def _dense_hidden(
    x_ptr, wg_ptr, bg_ptr, wu_ptr, bu_ptr, rows, r_ok, hc, h_ok, D, stride_xm, stride_wg, stride_wu,
    GATED: tl.constexpr, HAS_BG: tl.constexpr, HAS_BU: tl.constexpr, NATIVE: tl.constexpr, OVF: tl.constexpr,
    BM: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr,
):
    """``h [BM, BH]`` fp32 of x rows ``rows`` (int64) and neurons ``hc`` (int64), 0 outside
    ``r_ok × h_ok``: gate and up tiles from ``tl.dot`` over all of D, then the element-wise steps
    of ``_sparse_ffn_kernel`` (bias, overflow points of the input dtype, relu that keeps NaN)."""
    offs_k = tl.arange(0, BK)
    up = tl.full((BM, BH), 0.0, tl.float32)
    gate = tl.full((BM, BH), 0.0, tl.float32)
    for k0 in range(0, D, BK):
        kk = k0 + offs_k
        k_ok = kk < D
        b_mask = k_ok[:, None] & h_ok[None, :]
        xa = tl.load(x_ptr + rows[:, None] * stride_xm + kk[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0)
        wut = tl.load(wu_ptr + hc[None, :] * stride_wu + kk[:, None], mask=b_mask, other=0.0)
        up = dot(xa, wut, up, NATIVE)
        if GATED:
            wgt = tl.load(wg_ptr + hc[None, :] * stride_wg + kk[:, None], mask=b_mask, other=0.0)
            gate = dot(xa, wgt, gate, NATIVE)
    if HAS_BU:
        up += tl.load(bu_ptr + hc, mask=h_ok, other=0.0).to(tl.float32)[None, :]
    if OVF > 0:  # dense rounds gate, up and h to the input dtype: its overflow points
        up = tl.where(tl.abs(up) >= OVF, tl.where(up > 0, float("inf"), float("-inf")), up)
    if GATED:
        if HAS_BG:
            gate += tl.load(bg_ptr + hc, mask=h_ok, other=0.0).to(tl.float32)[None, :]
        if OVF > 0:
            gate = tl.where(tl.abs(gate) >= OVF, tl.where(gate > 0, float("inf"), float("-inf")), gate)
        hv = tl.where(gate <= 0.0, 0.0, gate) * up  # relu keeps NaN
        if OVF > 0:
            hv = tl.where(tl.abs(hv) >= OVF, tl.where(hv > 0, float("inf"), float("-inf")), hv)
    else:
        hv = tl.where(up <= 0.0, 0.0, up)
    return tl.where(r_ok[:, None] & h_ok[None, :], hv, 0.0)


@triton.jit
def _dense_hidden_kernel(
    # pointers
    x_ptr, wg_ptr, bg_ptr, wu_ptr, bu_ptr, rows_ptr, ndense_ptr, hid_ptr,
    # dimensions, row strides (elements)
    D, H, stride_xm, stride_wg, stride_wu,
    # meta-parameters
    GATED: tl.constexpr, HAS_BG: tl.constexpr, HAS_BU: tl.constexpr, NATIVE: tl.constexpr, OVF: tl.constexpr,
    BR: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr,
):
    """Scratch ``hid[i, j]`` = h of whole-dense row ``rows[i]``, neuron ``j``, fp32, for the list
    positions ``i < n_dense`` of this program's ``BR × BH`` block (the grid covers ``r_cap``)."""
    i0 = tl.program_id(0) * BR
    n_dense = tl.load(ndense_ptr)
    if i0 < n_dense:
        i = i0 + tl.arange(0, BR)
        r_ok = i < n_dense
        rows = tl.load(rows_ptr + i, mask=r_ok, other=0).to(tl.int64)
        hc = tl.program_id(1) * BH + tl.arange(0, BH)
        h_ok = hc < H
        hc = hc.to(tl.int64)
        hv = _dense_hidden(x_ptr, wg_ptr, bg_ptr, wu_ptr, bu_ptr, rows, r_ok, hc, h_ok, D, stride_xm, stride_wg,
                           stride_wu, GATED, HAS_BG, HAS_BU, NATIVE, OVF, BR, BH, BK)
        tl.store(hid_ptr + i.to(tl.int64)[:, None] * H + hc[None, :], hv, mask=r_ok[:, None] & h_ok[None, :])


@triton.jit
def _dense_rows_kernel(
    # pointers
    x_ptr, wg_ptr, bg_ptr, wu_ptr, bu_ptr, wdt_ptr, bd_ptr, rows_ptr, ndense_ptr, out_ptr,
    # dimensions (R_CAP: the first list position this kernel handles)
    D, H, R_CAP,
    # row strides (elements; every last dimension is contiguous)
    stride_xm, stride_wg, stride_wu, stride_wdt, stride_om,
    # meta-parameters
    GATED: tl.constexpr, HAS_BG: tl.constexpr, HAS_BU: tl.constexpr, HAS_BD: tl.constexpr,
    NATIVE: tl.constexpr, SPLIT: tl.constexpr, OVF: tl.constexpr,
    BM: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr,
):
    """The dense FFN ``out[rows[i], dblock]`` for the ``BM`` list positions ``R_CAP + pid_m·BM ...``
    and every ``num_programs·BM`` after them below ``n_dense`` (the whole-dense rows the scratch
    path has no room for).

    ``h`` tiles ``[BM, BH]`` from ``_dense_hidden``, times the ``[BH, BD]`` tile of Wdᵀ by
    ``dot_split`` (``hi + lo`` 16-bit pairs on tensor cores, IEEE fp32 for fp32 inputs). Every
    output column block recomputes gate and up: ``D / BD`` times the gate/up FLOPs of its rows.
    """
    n_dense = tl.load(ndense_ptr)
    for i0 in range(R_CAP + tl.program_id(0) * BM, n_dense, tl.num_programs(0) * BM):
        i = i0 + tl.arange(0, BM)
        r_ok = i < n_dense
        rows = tl.load(rows_ptr + i, mask=r_ok, other=0).to(tl.int64)
        offs_d = tl.program_id(1) * BD + tl.arange(0, BD)
        d_ok = offs_d < D
        acc = tl.full((BM, BD), 0.0, tl.float32)
        for h0 in range(0, H, BH):
            hc = h0 + tl.arange(0, BH)
            h_ok = hc < H
            hc = hc.to(tl.int64)
            hv = _dense_hidden(x_ptr, wg_ptr, bg_ptr, wu_ptr, bu_ptr, rows, r_ok, hc, h_ok, D, stride_xm, stride_wg,
                               stride_wu, GATED, HAS_BG, HAS_BU, NATIVE, OVF, BM, BH, BK)
            wd = tl.load(wdt_ptr + hc[:, None] * stride_wdt + offs_d[None, :], mask=h_ok[:, None] & d_ok[None, :],
                         other=0.0)
            acc = dot_split(hv, wd, acc, SPLIT, NATIVE)
        if HAS_BD:
            acc += tl.load(bd_ptr + offs_d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
        out_ptrs = out_ptr + rows[:, None] * stride_om + offs_d[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=r_ok[:, None] & d_ok[None, :])


def whole_dense_rows(listed, x, wg, bg, wu, bu, wdt, bd, out, strides, flags, ovf, scratch_rows,
                     reuse_tickets: bool) -> None:
    """``out`` of the listed rows (``row_lists.RowList``, made on the device: no host sync).

    The operands as ``sparse_ffn`` prepares them: row-major, ``wdt`` = Wdᵀ ``[H, D]``, a stand-in
    tensor for absent weights and biases (``flags``: ``GATED``, ``HAS_BG``, ``HAS_BU``, ``HAS_BD``),
    ``strides``: the row strides of x, wg, wu, wdt and out; ``ovf``:
    ``pair_walk.overflow_threshold`` of the input dtype; ``scratch_rows``: the list positions given
    scratch (``None``: ``dense_rows.scratch_capacity``'s budget).

    The first ``r_cap`` list positions: ``h`` into an fp32 scratch (one ``[16, BH]`` tile per
    program), then ``dense_rows.scratch_product`` (H split over programs). Positions past
    ``r_cap``: the blocked kernel, which recomputes gate and up per output column block.
    """
    m, d = out.shape
    h = wu.shape[0]
    rows, n_dense = listed
    native = x.dtype != torch.float32 and not INTERPRET
    split = x.element_size() == 2  # h is already clipped to the input dtype's overflow points
    bh, bk, bd_blk, warps = scratch_tiles(x.dtype)
    bd_blk = min(bd_blk, max(16, next_power_of_2(d)))
    # h [r_cap, H] and the split products [splits, r_cap, D]: 288 rows at D=2048, H=5632 (336 at
    # M=16384, 2% of the rows).
    r_cap = scratch_capacity(m, 4 * (h + split_count(h, bh) * d), scratch_rows)
    x_args = (x, wg, bg, wu, bu)
    x_strides = (strides[0], strides[1], strides[2])
    hflags = dict(GATED=flags["GATED"], HAS_BG=flags["HAS_BG"], HAS_BU=flags["HAS_BU"])
    if r_cap:
        hid = torch.empty(1, r_cap, h, dtype=torch.float32, device=x.device)
        launch(_dense_hidden_kernel, (r_cap // BR, cdiv(h, bh)),
            *x_args, rows, n_dense, hid, d, h, *x_strides,
            **hflags, NATIVE=native, OVF=ovf, BR=BR, BH=bh, BK=bk, num_warps=warps,
        )
        scratch_product(hid, rows, n_dense, (wdt,), out, bd if flags["HAS_BD"] else None,
                        split=split, bh=bh, bd=bd_blk, warps=warps, reuse_tickets=reuse_tickets)
    if m > r_cap:
        bm, bh, bk, bd_blk, warps, stages = _DENSE_TILES_INTERPRET if INTERPRET else DENSE_TILES[x.element_size()]
        bd_blk = min(bd_blk, max(16, next_power_of_2(d)))
        launch(_dense_rows_kernel, (min(cdiv(m - r_cap, bm), BLOCKED_ROW_PROGRAMS), cdiv(d, bd_blk)),
            *x_args, wdt, bd, rows, n_dense, out, d, h, r_cap, *strides,
            **flags, NATIVE=native, SPLIT=split, OVF=ovf,
            BM=bm, BH=bh, BK=bk, BD=bd_blk, num_warps=warps, num_stages=stages,
        )


KERNELS = {"dense_hidden": _dense_hidden_kernel, "dense_rows": _dense_rows_kernel}
