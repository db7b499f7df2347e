"""The backward's dense rows: their coefficients over all H, their ``dx``, and optionally their
weight gradients as GEMMs.

Math (the dense rows of ``reference.ffn_backward_ref``): for a listed row ``r`` and every neuron
``j``, gate and up recomputed from ``x_r``, ``dh = dout_r · Wd[:, j] + scale · sign(h)``, then
``dgate``, ``dup`` and ``h`` as for a pair (``grad_math``); ``dx_r = Σ_j dgate_rj · Wg_j + dup_rj ·
Wu_j``, and the rows' shares of the weight gradients ``dWg_j += dgate_rj · x_r``, ``dWu_j += dup_rj
· x_r``, ``dWdᵀ_j += h_rj · dout_r``. Gate, up and ``dh`` come from ``[16, BH]`` tiles of ``tl.dot``
over D (``_dense_tile``).

* ``_dense_coef_dx_kernel``: two independent jobs in one launch (one launch's host time fewer):
  ``dgate``, ``dup`` and ``h`` of the first ``r_cap`` list positions into an fp32 scratch
  ``[planes, r_cap, H]`` (``r_cap`` from a 32 MiB budget, 496 rows at H = 5632, or 2% of the rows
  if more: ``dense_rows.scratch_capacity``); and ``dx`` of the positions past ``r_cap``, the
  coefficients recomputed over all H for each ``BD`` column block (exact, slow).
* ``dx`` of the scratch rows: ``dense_rows.scratch_product`` (H split over programs, bf16
  coefficients as ``hi + lo`` pairs on tensor cores).
* With ``dense_wgrad_gemm``, ``_dense_wgrad_kernel`` sums the scratch rows' share of the weight
  gradients as GEMMs (``[BJ, 16] @ [16, BD]`` tiles, bf16 coefficients as ``hi + lo``) into an fp32
  ``[planes, H, D]`` buffer that the weight-gradient kernel starts from, instead of that kernel
  gathering each dense row's ``x`` and ``dout`` once per neuron: on the H200 (M=16384, 0.5% density)
  a training step with 256 dense rows took 4.66 ms instead of 6.94 (46 rows: 4.24 against 4.52;
  none: the same), for 112 MB more at the step's peak.

Bytes per ``BR`` scratch rows: their ``x`` and ``dout`` rows, the three weights once (``3·H·D·e``),
the coefficients ``planes·BR·H·4`` written once and read by ``scratch_product`` (and by
``_dense_wgrad_kernel`` or the weight-gradient kernel); past ``r_cap``, the weights ``D / BD``
times per ``BR`` rows.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .dense_rows import BLOCKED_ROW_PROGRAMS, BR, scratch_capacity, scratch_product, scratch_tiles
from .grad_math import hidden_values, pair_grads, sign_of
from .launch import cdiv, launch
from .row_lists import RowList
from .triton_helpers import INTERPRET, dot, dot_split, jit_helper, reduce_sum


class DenseScratch(NamedTuple):
    """What the weight-gradient kernel reads of the dense rows: the ``r_cap`` list positions whose
    coefficients ``coef`` (fp32 ``[planes, r_cap, H]``) holds, and with ``partial`` their weight
    gradients already summed: ``part`` fp32 ``[planes, H, D]`` and its bias sums ``psum`` ``[2, H]``
    (otherwise both are the stand-in tensor, never read)."""

    r_cap: int
    coef: torch.Tensor
    part: torch.Tensor
    psum: torch.Tensor
    partial: bool


# _dense_wgrad_kernel's (BJ neurons, BD columns, warps) on the GPU. Not tuned: at 256 dense rows it
# reads ~0.7 GB, mostly L2 hits, and writes the partial once.
DENSE_WGRAD_TILES = (64, 64, 4)


@jit_helper
def _dense_tile(
    x_ptr, dout_ptr, wg_ptr, wu_ptr, wdt_ptr, bg_ptr, bu_ptr, rows, r_ok, hc, h_ok, D,
    stride_xm, stride_gm, stride_wg, stride_wu, stride_wdt,
    GATED: tl.constexpr, HAS_BG: tl.constexpr, HAS_BU: tl.constexpr, NATIVE: tl.constexpr,
    BR: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr,
):
    """``(pre, up, dout·Wd)`` ``[BR, BH]`` for dense rows ``rows`` and neurons ``hc``, over all D.

    ``pre`` is the gate pre-activation (gated) or the up one (plain, then ``up == pre``).
    """
    offs_k = tl.arange(0, BK)
    up = tl.full((BR, BH), 0.0, tl.float32)
    gate = tl.full((BR, BH), 0.0, tl.float32)
    dhd = tl.full((BR, BH), 0.0, tl.float32)
    for k0 in range(0, D, BK):
        kk = k0 + offs_k
        k_ok = kk < D
        a_mask = r_ok[:, None] & k_ok[None, :]
        b_mask = k_ok[:, None] & h_ok[None, :]
        xa = tl.load(x_ptr + rows[:, None] * stride_xm + kk[None, :], mask=a_mask, other=0.0)
        ga = tl.load(dout_ptr + rows[:, None] * stride_gm + kk[None, :], mask=a_mask, other=0.0)
        wut = tl.load(wu_ptr + hc[None, :] * stride_wu + kk[:, None], mask=b_mask, other=0.0)
        wdtt = tl.load(wdt_ptr + hc[None, :] * stride_wdt + kk[:, None], mask=b_mask, other=0.0)
        up = dot(xa, wut, up, NATIVE)
        dhd = dot(ga, wdtt, dhd, NATIVE)
        if GATED:
            wgt = tl.load(wg_ptr + hc[None, :] * stride_wg + kk[:, None], mask=b_mask, other=0.0)
            gate = dot(xa, wgt, gate, NATIVE)
    if HAS_BU:
        up += tl.load(bu_ptr + hc, mask=h_ok, other=0.0).to(tl.float32)[None, :]
    if GATED:
        if HAS_BG:
            gate += tl.load(bg_ptr + hc, mask=h_ok, other=0.0).to(tl.float32)[None, :]
        pre = gate
    else:
        pre = up
    return pre, up, dhd


@jit_helper
def _dense_coefs(
    x_ptr, dout_ptr, wg_ptr, wu_ptr, wdt_ptr, bg_ptr, bu_ptr, scale, rows, r_ok, hc, h_ok, D,
    stride_xm, stride_gm, stride_wg, stride_wu, stride_wdt,
    GATED: tl.constexpr, HAS_BG: tl.constexpr, HAS_BU: tl.constexpr, NATIVE: tl.constexpr,
    BR: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr,
):
    """``(dgate, dup, h)`` ``[BR, BH]`` of dense rows, zero outside ``r_ok × h_ok``."""
    pre, up, dhd = _dense_tile(x_ptr, dout_ptr, wg_ptr, wu_ptr, wdt_ptr, bg_ptr, bu_ptr, rows, r_ok, hc, h_ok, D,
                               stride_xm, stride_gm, stride_wg, stride_wu, stride_wdt,
                               GATED, HAS_BG, HAS_BU, NATIVE, BR, BH, BK)
    act, hv = hidden_values(pre, up, GATED)
    d_gate, d_up = pair_grads(pre, up, act, dhd + scale * sign_of(hv), GATED)
    ok = r_ok[:, None] & h_ok[None, :]
    return tl.where(ok, d_gate, 0.0), tl.where(ok, d_up, 0.0), tl.where(ok, hv, 0.0)


@jit_helper
def _store_planes(ptr, PLANE, d_gate, d_up, hv, ok, GATED: tl.constexpr):
    """Store per-plane values at ``ptr + p·PLANE``: ``dgate``, ``dup``, ``h`` (gated) or ``dup``,
    ``h`` (plain), the planes of the dense-row scratch and of the GEMM buffer."""
    if GATED:
        tl.store(ptr, d_gate, mask=ok)
        tl.store(ptr + PLANE, d_up, mask=ok)
        tl.store(ptr + 2 * PLANE, hv, mask=ok)
    else:
        tl.store(ptr, d_up, mask=ok)
        tl.store(ptr + PLANE, hv, mask=ok)


@triton.jit
def _dense_coef_dx_kernel(
    # pointers
    x_ptr, dout_ptr, wg_ptr, wu_ptr, wdt_ptr, bg_ptr, bu_ptr, scale_ptr, rows_ptr, ndense_ptr, coef_ptr, dx_ptr,
    # dimensions (PLANE = R_CAP · H, the stride between coefficient planes; the programs of each role)
    D, H, R_CAP, PLANE, COEF_PROGRAMS, DX_ROW_PROGRAMS,
    # row strides (elements)
    stride_xm, stride_gm, stride_wg, stride_wu, stride_wdt, stride_dxm,
    # meta-parameters
    GATED: tl.constexpr, HAS_BG: tl.constexpr, HAS_BU: tl.constexpr, NATIVE: tl.constexpr,
    BR: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr,
):
    """The dense rows' two independent jobs, one launch (a 1-D grid, the first ``COEF_PROGRAMS``
    programs take the first):

    * scratch ``coef[0|1|2, i, j]`` = ``dgate``, ``dup``, ``h`` of dense row ``rows[i]``, neuron
      ``j``, for the list positions ``i < min(n_dense, R_CAP)``, one ``BR × BH`` block a program
      (plain FFNs store ``dup`` and ``h`` at planes 0 and 1);
    * ``dx[rows[i], dblock] = Σ_j dgate[i, j] · Wg[j, dblock] + dup[i, j] · Wu[j, dblock]`` for the
      list positions past ``R_CAP``: ``DX_ROW_PROGRAMS`` programs per ``BD`` columns, each taking
      ``BR`` positions and every ``DX_ROW_PROGRAMS·BR`` after them below ``n_dense`` (none: it
      returns at once), coefficients recomputed over all D (``D / BD`` times the dense
      gate/up/down-grad products).
    """
    pid = tl.program_id(0)
    n_dense = tl.load(ndense_ptr)
    if pid < COEF_PROGRAMS:
        h_blocks = tl.cdiv(H, BH)
        i = (pid // h_blocks) * BR + tl.arange(0, BR)
        if (pid // h_blocks) * BR < n_dense:
            r_ok = i < n_dense
            rows = tl.load(rows_ptr + i, mask=r_ok, other=0).to(tl.int64)
            hc = (pid % h_blocks) * BH + tl.arange(0, BH)
            h_ok = hc < H
            hc = hc.to(tl.int64)
            d_gate, d_up, hv = _dense_coefs(x_ptr, dout_ptr, wg_ptr, wu_ptr, wdt_ptr, bg_ptr, bu_ptr,
                                            tl.load(scale_ptr), rows, r_ok, hc, h_ok, D, stride_xm, stride_gm,
                                            stride_wg, stride_wu, stride_wdt, GATED, HAS_BG, HAS_BU, NATIVE, BR, BH,
                                            BK)
            at = i.to(tl.int64)[:, None] * H + hc[None, :]
            _store_planes(coef_ptr + at, PLANE, d_gate, d_up, hv, r_ok[:, None] & h_ok[None, :], GATED)
    else:
        q = pid - COEF_PROGRAMS
        offs_d = (q // DX_ROW_PROGRAMS) * BD + tl.arange(0, BD)
        d_ok = offs_d < D
        for i0 in range(R_CAP + (q % DX_ROW_PROGRAMS) * BR, n_dense, DX_ROW_PROGRAMS * BR):
            i = i0 + tl.arange(0, BR)
            r_ok = i < n_dense
            rows = tl.load(rows_ptr + i, mask=r_ok, other=0).to(tl.int64)
            scale = tl.load(scale_ptr)
            acc = tl.full((BR, BD), 0.0, tl.float32)
            for h0 in range(0, H, BH):
                hc = h0 + tl.arange(0, BH)
                h_ok = hc < H
                hc = hc.to(tl.int64)
                d_gate, d_up, _ = _dense_coefs(x_ptr, dout_ptr, wg_ptr, wu_ptr, wdt_ptr, bg_ptr, bu_ptr, scale,
                                               rows, r_ok, hc, h_ok, D, stride_xm, stride_gm, stride_wg, stride_wu,
                                               stride_wdt, GATED, HAS_BG, HAS_BU, NATIVE, BR, BH, BK)
                w_mask = h_ok[:, None] & d_ok[None, :]
                wu = tl.load(wu_ptr + hc[:, None] * stride_wu + offs_d[None, :], mask=w_mask, other=0.0)
                acc = dot(d_up, wu, acc, False)
                if GATED:
                    wg = tl.load(wg_ptr + hc[:, None] * stride_wg + offs_d[None, :], mask=w_mask, other=0.0)
                    acc = dot(d_gate, wg, acc, False)
            tl.store(dx_ptr + rows[:, None] * stride_dxm + offs_d[None, :], acc.to(dx_ptr.dtype.element_ty),
                     mask=r_ok[:, None] & d_ok[None, :])


@triton.jit
def _dense_wgrad_kernel(
    # pointers
    x_ptr, dout_ptr, rows_ptr, ndense_ptr, coef_ptr, part_ptr, psum_ptr,
    # dimensions (PLANE = R_CAP · H, the stride between coefficient planes)
    D, H, R_CAP, PLANE,
    # row strides (elements)
    stride_xm, stride_gm,
    # meta-parameters
    GATED: tl.constexpr, SPLIT: tl.constexpr, NATIVE: tl.constexpr,
    BR: tl.constexpr, BJ: tl.constexpr, BD: tl.constexpr,
):
    """The dense rows' share of the weight gradients, as GEMMs over their list positions
    ``i < min(n_dense, R_CAP)``: ``part[p, j, dblock] = Σ_i coef[p, i, j] · (x | dout)[rows[i],
    dblock]`` (x for ``dgate`` and ``dup``, dout for ``h``) and, from the first D block,
    ``psum[p, j] = Σ_i coef[p, i, j]`` for ``dgate`` and ``dup`` (plain: ``dup`` at 0). fp32; the
    coefficients through ``dot_split`` (``hi + lo`` on tensor cores for bf16). Writes nothing when
    there is no dense row: ``_wgrad_kernel`` then reads nothing."""
    n = tl.minimum(tl.load(ndense_ptr), R_CAP)
    if n > 0:
        offs_j = tl.program_id(0) * BJ + tl.arange(0, BJ)
        j_ok = offs_j < H
        offs_d = tl.program_id(1) * BD + tl.arange(0, BD)
        d_ok = offs_d < D
        acc_g = tl.full((BJ, BD), 0.0, tl.float32)
        acc_u = tl.full((BJ, BD), 0.0, tl.float32)
        acc_d = tl.full((BJ, BD), 0.0, tl.float32)
        sum_g = tl.full((BJ,), 0.0, tl.float32)
        sum_u = tl.full((BJ,), 0.0, tl.float32)
        for i0 in range(0, n, BR):
            i = i0 + tl.arange(0, BR)
            r_ok = i < n
            rows = tl.load(rows_ptr + i, mask=r_ok, other=0).to(tl.int64)
            m2 = r_ok[:, None] & d_ok[None, :]
            xr = tl.load(x_ptr + rows[:, None] * stride_xm + offs_d[None, :], mask=m2, other=0.0)
            gr = tl.load(dout_ptr + rows[:, None] * stride_gm + offs_d[None, :], mask=m2, other=0.0)
            at = i.to(tl.int64)[None, :] * H + offs_j[:, None]  # [BJ, BR]: coefficients transposed
            cm = j_ok[:, None] & r_ok[None, :]
            if GATED:
                c_g = tl.load(coef_ptr + at, mask=cm, other=0.0)
                c_u = tl.load(coef_ptr + PLANE + at, mask=cm, other=0.0)
                c_h = tl.load(coef_ptr + 2 * PLANE + at, mask=cm, other=0.0)
                acc_g = dot_split(c_g, xr, acc_g, SPLIT, NATIVE)
                sum_g += reduce_sum(c_g, axis=1)
            else:
                c_u = tl.load(coef_ptr + at, mask=cm, other=0.0)
                c_h = tl.load(coef_ptr + PLANE + at, mask=cm, other=0.0)
            acc_u = dot_split(c_u, xr, acc_u, SPLIT, NATIVE)
            acc_d = dot_split(c_h, gr, acc_d, SPLIT, NATIVE)
            sum_u += reduce_sum(c_u, axis=1)
        out = offs_j.to(tl.int64)[:, None] * D + offs_d[None, :]
        _store_planes(part_ptr + out, H.to(tl.int64) * D, acc_g, acc_u, acc_d, j_ok[:, None] & d_ok[None, :], GATED)
        if tl.program_id(1) == 0:
            tl.store(psum_ptr + offs_j, sum_u, mask=j_ok)
            if GATED:
                tl.store(psum_ptr + H + offs_j, sum_g, mask=j_ok)


def dense_rows_backward(x: torch.Tensor, dout: torch.Tensor, wg: torch.Tensor, wu: torch.Tensor, wdt: torch.Tensor,
                        bg: torch.Tensor, bu: torch.Tensor, scale: torch.Tensor, listed: RowList, dx: torch.Tensor, *,
                        flags: dict, scratch_rows, wgrad_gemm: bool, reuse_tickets: bool,
                        dummy: torch.Tensor) -> DenseScratch:
    """``dx`` of the listed rows, and their coefficients for the weight-gradient kernel (with
    ``wgrad_gemm``, their weight gradients summed as GEMMs too); other rows of ``dx`` are left alone.

    The operands as ``sparse_ffn_backward`` prepares them: row-major, ``wdt`` = Wdᵀ ``[H, D]``,
    plain FFNs pass ``wu`` as ``wg``, and ``dummy`` for absent biases (``flags``: ``GATED``,
    ``HAS_BG``, ``HAS_BU``); ``scale`` fp32 ``[]`` = ``l1_scale / M``; ``scratch_rows``: the list
    positions given scratch (``None``: ``dense_rows.scratch_capacity``'s budget).
    """
    m, d = x.shape
    h = wu.shape[0]
    gated = flags["GATED"]
    rows, n_dense = listed
    planes = 3 if gated else 2
    m_pad = cdiv(m, BR) * BR
    # The coefficients [planes, r_cap, H] only (496 rows at H=5632, or 2% of M if more); the split
    # products' partial sums come on top (45 MB at D=2048).
    r_cap = scratch_capacity(m, 4 * planes * h, scratch_rows)
    coef = torch.empty(planes, r_cap, h, dtype=torch.float32, device=x.device) if r_cap else dummy
    native = x.dtype != torch.float32 and not INTERPRET
    bh, bk, bd_blk, warps = scratch_tiles(x.dtype)
    # The scratch of the first r_cap list positions and dx of the positions past it: one launch.
    coef_programs = (r_cap // BR) * cdiv(h, bh)
    dx_row_programs = min((m_pad - r_cap) // BR, BLOCKED_ROW_PROGRAMS)
    if coef_programs or dx_row_programs:
        launch(_dense_coef_dx_kernel, (coef_programs + dx_row_programs * cdiv(d, bd_blk),),
            x, dout, wg, wu, wdt, bg, bu, scale, rows, n_dense, coef, dx,
            d, h, r_cap, r_cap * h, coef_programs, max(1, dx_row_programs),
            x.stride(0), dout.stride(0), wg.stride(0), wu.stride(0), wdt.stride(0), dx.stride(0),
            **flags, NATIVE=native, BR=BR, BH=bh, BK=bk, BD=bd_blk, num_warps=warps,
        )
    if r_cap:
        # hi + lo in bf16 only: fp16's range cannot hold every finite fp32 coefficient.
        scratch_product(coef, rows, n_dense, (wg, wu) if gated else (wu,), dx,
                        split=x.dtype == torch.bfloat16, bh=bh, bd=bd_blk, warps=warps, reuse_tickets=reuse_tickets)
    partial = wgrad_gemm and r_cap > 0
    part = psum = dummy
    if partial:
        part = torch.empty(planes, h, d, dtype=torch.float32, device=x.device)
        psum = torch.empty(2, h, dtype=torch.float32, device=x.device)
        bj, bd_w, warps_w = (32, 32, 4) if INTERPRET else DENSE_WGRAD_TILES
        launch(_dense_wgrad_kernel, (cdiv(h, bj), cdiv(d, bd_w)),
            x, dout, rows, n_dense, coef, part, psum, d, h, r_cap, r_cap * h, x.stride(0), dout.stride(0),
            GATED=gated, SPLIT=x.dtype == torch.bfloat16, NATIVE=native, BR=BR, BJ=bj, BD=bd_w, num_warps=warps_w,
        )
    return DenseScratch(r_cap, coef, part, psum, partial)


KERNELS = {"dense_coef_dx": _dense_coef_dx_kernel, "dense_wgrad": _dense_wgrad_kernel}
