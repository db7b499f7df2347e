"""Fused TwELL consumer: the up and down projections on the packed (token, neuron) pairs only.

Math (``reference.ffn_forward_ref``). For every stored pair ``(t, j)`` of a row that is not dense:

* gated: ``up = x_t · Wu_j + bu_j`` and ``h = relu(g_tj) · up``, with ``g`` the packed gate value;
* plain: ``h = relu(u_tj)``, with ``u`` the packed up pre-activation;

and ``out_t = Σ_j h · Wd[:, j] + bd``, accumulated in fp32 and cast once to the output dtype.

Two ways a row leaves the pair loop, both exact:

* a tile row whose ``count`` exceeds its slots (overflow) is recomputed densely over its
  ``tile_n`` columns inside the same program, from ``x`` (gate and up for gated, up for plain);
* rows flagged in ``dense_rows`` (overflow rows and the finiteness guard of
  ``reference.dense_rows_ref``) are computed by a second kernel as a blocked dense FFN over all H.

Kernels:

* ``_sparse_ffn_kernel``: a program owns ``TOKENS`` consecutive tokens (neighbouring tokens share
  neurons, so their weight rows hit in L1/L2) and handles them one after the other with the whole
  x row and output row in registers. A token's stored pairs are enumerated as one compact list
  (a prefix sum over its tile counts, then a search per chunk), ``CH`` pairs at a time: one
  ``[CH, D]`` gather of ``Wu`` rows, ``CH`` dot products, one ``[CH, D]`` gather of ``Wdᵀ`` rows.
* ``_dense_rows_kernel``: one program per (``BM`` rows, ``BD`` output columns); it returns at once
  unless a row of its block is flagged, then runs gate/up/down with ``tl.dot`` over all H and
  stores the flagged rows only.

Bytes, 16-bit weights (``e = 2``), ``a`` stored pairs per token:

* read per token: x row ``D·e``, the packed row (``n_tiles·4`` + ``a·8``), and ``a`` weight rows
  of ``Wu`` and ``Wdᵀ``: ``2·a·D·e`` (8 KiB per pair at D=2048), served from L2 (the 46 MB of
  bf16 weights fit the H200's 60 MB L2);
* written per token: ``D·e_out`` (+ ``n_tiles·slots·4`` with ``return_up``).

``Wd`` is ``[D, H]`` (``nn.Linear``); its columns are rows of ``Wdᵀ``, so the launcher makes
``wd.t().contiguous()`` ([H, D]) on every call: ``2·H·D·e`` bytes of copy traffic (46 MB, about
10 µs on an H200 at D=2048, H=5632). No copy is made when ``wd`` already is the transposed view of
a contiguous ``[H, D]`` tensor, so a caller that keeps ``Wdᵀ`` can pass ``wdt.t()``.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import triton
import triton.language as tl

from .format import DEFAULT_LAYOUT, TwellLayout, TwellPacked
from .reference import _finite, _may_overflow

# Set before import (DESIGN.md section 9): the interpreter computes bf16 tl.dot wrongly and cannot
# autotune over several configs.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# ---------------------------------------------------------------------------------------------
# Sparse rows: one program per TOKENS tokens
# ---------------------------------------------------------------------------------------------


def _sparse_configs():
    if INTERPRET:
        return [triton.Config({"CH": 4, "TOKENS": 2}, num_warps=4, num_stages=1)]
    # (pairs per chunk, warps, tokens per program). The naive floor (DESIGN.md section 10) was
    # one token per program, one pair at a time, 4 warps; 8 warps were slower there.
    shapes = [(4, 4, 1), (2, 4, 1), (8, 8, 1), (4, 8, 1), (4, 4, 4), (2, 4, 4), (16, 16, 1)]
    return [triton.Config({"CH": c, "TOKENS": t}, num_warps=w, num_stages=1) for c, w, t in shapes]


def _prune_sparse(configs, nargs, **kwargs):
    """Keep configs whose ``[CH, BLOCK_D]`` weight tile fits in ≤ 64 fp32 registers per thread."""
    block_d = kwargs["BLOCK_D"]
    keep = [c for c in configs if c.kwargs["CH"] * block_d <= 64 * 32 * c.num_warps]
    if keep:
        return keep
    return [triton.Config({"CH": max(1, 64 * 32 * 16 // block_d), "TOKENS": 1}, num_warps=16, num_stages=1)]


@triton.autotune(configs=_sparse_configs(), key=["D", "H", "GATED"], prune_configs_by={"early_config_prune": _prune_sparse})
@triton.jit
def _sparse_ffn_kernel(
    # pointers
    x_ptr, wg_ptr, bg_ptr, wu_ptr, bu_ptr, wdt_ptr, bd_ptr,
    idx_ptr, val_ptr, count_ptr, dense_ptr, out_ptr, up_ptr,
    # dimensions
    M, D, H, N_TILES,
    # row strides (elements; every last dimension is contiguous)
    stride_xm, stride_wg, stride_wu, stride_wdt, stride_om,
    # meta-parameters
    GATED: tl.constexpr, HAS_BG: tl.constexpr, HAS_BU: tl.constexpr, HAS_BD: tl.constexpr,
    STORE_UP: tl.constexpr, SLOTS: tl.constexpr, SLOTS_P2: tl.constexpr, TILE_N: tl.constexpr,
    NT_P2: tl.constexpr, BLOCK_D: tl.constexpr, CH: tl.constexpr, TOKENS: tl.constexpr,
):
    """``out[t] = Σ_pairs h · Wdᵀ[j] + bd`` for every token ``t`` with ``dense[t]`` false.

    x ``[M, D]``; wg, wu ``[H, D]``; wdt ``[H, D]`` (= Wdᵀ); biases ``[H]``/``[D]``; TwELL
    ``idx``/``val`` ``[M, N_TILES, SLOTS]`` and ``count [M, N_TILES]``; dense bool ``[M]``;
    out ``[M, D]``. Tiles with ``count > SLOTS`` are computed densely over their TILE_N columns.
    With STORE_UP, ``up [M, N_TILES, SLOTS]`` fp32 receives the up value of each stored pair of a
    sparse row and 0 in every other slot. Rows flagged dense are left to ``_dense_rows_kernel``.
    """
    pid = tl.program_id(0)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    tiles = tl.arange(0, NT_P2)
    t_ok = tiles < N_TILES
    offs_c = tl.arange(0, CH)
    slots = tl.arange(0, SLOTS_P2)

    for i in range(TOKENS):
        t = pid * TOKENS + i
        if t < M:
            t64 = t.to(tl.int64)
            sparse_row = tl.load(dense_ptr + t64) == 0
            cnt = tl.load(count_ptr + t64 * N_TILES + tiles, mask=t_ok, other=0)
            over = cnt > SLOTS
            # Pairs the loop below handles: none in overflowed tiles or dense rows.
            stored = tl.where(over | (sparse_row == 0), 0, cnt)
            slot0 = t64 * N_TILES * SLOTS  # first slot of this token's TwELL row
            if STORE_UP:
                zero_mask = t_ok[:, None] & (slots[None, :] < SLOTS) & (slots[None, :] >= stored[:, None])
                tl.store(up_ptr + slot0 + tiles[:, None] * SLOTS + slots[None, :],
                         tl.zeros((NT_P2, SLOTS_P2), dtype=tl.float32), mask=zero_mask)

            if sparse_row:
                x_row = tl.load(x_ptr + t64 * stride_xm + offs_d, mask=d_ok, other=0.0).to(tl.float32)
                acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
                # The token's whole TwELL row in one load (no dependent load per chunk), each stored
                # pair numbered by its position in the compact list of the row's pairs.
                incl = tl.cumsum(stored, axis=0)
                total = tl.sum(stored, axis=0)
                in_row = slots[None, :] < stored[:, None]  # [NT_P2, SLOTS_P2]
                off2d = tiles[:, None] * SLOTS + slots[None, :]
                pos = tl.reshape(tl.where(in_row, (incl - stored)[:, None] + slots[None, :], -1), (NT_P2 * SLOTS_P2,))
                off = tl.reshape(off2d, (NT_P2 * SLOTS_P2,))
                idx_row = tl.reshape(tl.load(idx_ptr + slot0 + off2d, mask=in_row, other=0), (NT_P2 * SLOTS_P2,))
                val_row = tl.reshape(tl.load(val_ptr + slot0 + off2d, mask=in_row, other=0.0), (NT_P2 * SLOTS_P2,))
                for k0 in range(0, total, CH):
                    k = k0 + offs_c
                    k_ok = k < total
                    hit = pos[None, :] == k[:, None]  # [CH, NT_P2 * SLOTS_P2], one hit per valid k
                    j = tl.sum(tl.where(hit, idx_row[None, :], 0), axis=1).to(tl.int64)
                    g = tl.sum(tl.where(hit, val_row[None, :], 0.0), axis=1)
                    act = tl.where(g <= 0.0, 0.0, g)  # relu that keeps NaN, as torch.relu does
                    w_mask = k_ok[:, None] & d_ok[None, :]
                    if GATED:
                        wu = tl.load(wu_ptr + j[:, None] * stride_wu + offs_d[None, :], mask=w_mask, other=0.0)
                        up = tl.sum(wu.to(tl.float32) * x_row[None, :], axis=1)
                        if HAS_BU:
                            up += tl.load(bu_ptr + j, mask=k_ok, other=0.0).to(tl.float32)
                        if STORE_UP:
                            slot = slot0 + tl.sum(tl.where(hit, off[None, :], 0), axis=1)
                            tl.store(up_ptr + slot, up, mask=k_ok)
                        hv = act * up
                    else:
                        hv = act
                    hv = tl.where(k_ok, hv, 0.0)
                    wd = tl.load(wdt_ptr + j[:, None] * stride_wdt + offs_d[None, :], mask=w_mask, other=0.0)
                    acc += tl.sum(hv[:, None] * wd.to(tl.float32), axis=0)

                # Overflowed tiles: every column of the tile, recomputed from x (rare).
                n_over = tl.sum(over.to(tl.int32), axis=0)
                if n_over > 0:
                    for tau in range(0, N_TILES):
                        c = tl.load(count_ptr + t64 * N_TILES + tau)
                        if c > SLOTS:
                            for c0 in range(0, TILE_N, CH):
                                jj = tau * TILE_N + c0 + offs_c
                                j_ok = jj < H
                                j = jj.to(tl.int64)
                                w_mask = j_ok[:, None] & d_ok[None, :]
                                wu = tl.load(wu_ptr + j[:, None] * stride_wu + offs_d[None, :], mask=w_mask, other=0.0)
                                up = tl.sum(wu.to(tl.float32) * x_row[None, :], axis=1)
                                if HAS_BU:
                                    up += tl.load(bu_ptr + j, mask=j_ok, other=0.0).to(tl.float32)
                                if GATED:
                                    wg = tl.load(wg_ptr + j[:, None] * stride_wg + offs_d[None, :], mask=w_mask, other=0.0)
                                    g = tl.sum(wg.to(tl.float32) * x_row[None, :], axis=1)
                                    if HAS_BG:
                                        g += tl.load(bg_ptr + j, mask=j_ok, other=0.0).to(tl.float32)
                                    hv = tl.where(g <= 0.0, 0.0, g) * up
                                else:
                                    hv = tl.where(up <= 0.0, 0.0, up)
                                hv = tl.where(j_ok, hv, 0.0)
                                wd = tl.load(wdt_ptr + j[:, None] * stride_wdt + offs_d[None, :], mask=w_mask, other=0.0)
                                acc += tl.sum(hv[:, None] * wd.to(tl.float32), axis=0)

                if HAS_BD:
                    acc += tl.load(bd_ptr + offs_d, mask=d_ok, other=0.0).to(tl.float32)
                tl.store(out_ptr + t64 * stride_om + offs_d, acc.to(out_ptr.dtype.element_ty), mask=d_ok)


# ---------------------------------------------------------------------------------------------
# Dense rows: blocked dense FFN over all H for the flagged rows
# ---------------------------------------------------------------------------------------------


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr, INTERPRET: tl.constexpr):
    if INTERPRET:  # the interpreter's bf16 tl.dot is wrong (DESIGN.md section 9)
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if IEEE:
        acc = tl.dot(a, b, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _dense_rows_kernel(
    # pointers
    x_ptr, wg_ptr, bg_ptr, wu_ptr, bu_ptr, wdt_ptr, bd_ptr, dense_ptr, out_ptr,
    # dimensions
    M, D, H,
    # row strides (elements; every last dimension is contiguous)
    stride_xm, stride_wg, stride_wu, stride_wdt, stride_om,
    # meta-parameters
    GATED: tl.constexpr, HAS_BG: tl.constexpr, HAS_BU: tl.constexpr, HAS_BD: tl.constexpr,
    IEEE: tl.constexpr, INTERPRET: tl.constexpr,
    BM: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr,
):
    """The dense FFN ``out[r, dblock]`` for the rows ``r`` of block ``pid_m`` with ``dense[r]``.

    Shapes as in ``_sparse_ffn_kernel``. Gate and up tiles ``[BM, BH]`` come from ``tl.dot`` over
    all of D (bf16/fp16 on tensor cores, fp32 in IEEE); ``h`` stays fp32 and is multiplied by the
    ``[BH, BD]`` tile of Wdᵀ (TF32 for 16-bit inputs, IEEE fp32 for fp32 inputs). Every output
    column block recomputes gate and up: ``D / BD`` times the gate/up FLOPs of the block's rows.
    """
    pid_m = tl.program_id(0)
    pid_d = tl.program_id(1)
    rows = pid_m * BM + tl.arange(0, BM)
    r_ok = rows < M
    flag = tl.load(dense_ptr + rows, mask=r_ok, other=0) != 0
    if tl.sum(flag.to(tl.int32), axis=0) > 0:
        rows_ld = tl.minimum(rows, M - 1).to(tl.int64)
        offs_d = pid_d * BD + tl.arange(0, BD)
        d_ok = offs_d < D
        offs_h = tl.arange(0, BH)
        offs_k = tl.arange(0, BK)
        acc = tl.zeros((BM, BD), dtype=tl.float32)
        for h0 in range(0, H, BH):
            hc = h0 + offs_h
            h_ok = hc < H
            hc_ld = tl.minimum(hc, H - 1).to(tl.int64)
            up = tl.zeros((BM, BH), dtype=tl.float32)
            gate = tl.zeros((BM, BH), dtype=tl.float32)
            for k0 in range(0, D, BK):
                kk = k0 + offs_k
                k_ok = kk < D
                xa = tl.load(x_ptr + rows_ld[:, None] * stride_xm + kk[None, :], mask=k_ok[None, :], other=0.0)
                wut = tl.load(wu_ptr + hc_ld[None, :] * stride_wu + kk[:, None], mask=k_ok[:, None], other=0.0)
                up = _dot(xa, wut, up, IEEE, INTERPRET)
                if GATED:
                    wgt = tl.load(wg_ptr + hc_ld[None, :] * stride_wg + kk[:, None], mask=k_ok[:, None], other=0.0)
                    gate = _dot(xa, wgt, gate, IEEE, INTERPRET)
            if HAS_BU:
                up += tl.load(bu_ptr + hc, mask=h_ok, other=0.0).to(tl.float32)[None, :]
            if GATED:
                if HAS_BG:
                    gate += tl.load(bg_ptr + hc, mask=h_ok, other=0.0).to(tl.float32)[None, :]
                hv = tl.where(gate <= 0.0, 0.0, gate) * up  # relu keeps NaN
            else:
                hv = tl.where(up <= 0.0, 0.0, up)
            hv = tl.where(h_ok[None, :], hv, 0.0)
            wd = tl.load(wdt_ptr + hc_ld[:, None] * stride_wdt + offs_d[None, :],
                         mask=h_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
            if IEEE:
                acc = tl.dot(hv, wd, acc, input_precision="ieee")
            else:
                acc = tl.dot(hv, wd, acc)  # TF32: h keeps 10 mantissa bits, more than bf16's 7
        if HAS_BD:
            acc += tl.load(bd_ptr + offs_d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
        out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_om + offs_d[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=(flag & r_ok)[:, None] & d_ok[None, :])


# ---------------------------------------------------------------------------------------------
# Host launcher
# ---------------------------------------------------------------------------------------------


def _check(name: str, t, shape, dtypes, device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but x is on {device}")


def _rowmajor(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def guard_rows(x, wg, wu, wd, bg, bu, bd) -> torch.Tensor:
    """bool [M]: the finiteness guard of ``reference.dense_rows_ref`` without its overflow rows.

    Rows with a non-finite x, rows whose gated up product may overflow, and every row when a
    weight or bias is non-finite. Device ops only, no host sync. Overflowed tiles of the other
    rows are exact anyway (``sparse_ffn`` recomputes them densely, per tile).
    """
    rows = ~torch.isfinite(x).all(-1)
    if wg is not None and x.shape[0] > 0:
        rows |= _may_overflow(x, wu, bu, x.dtype)
    return rows | ~_finite(wg, wu, wd, bg, bu, bd)


def sparse_ffn(
    x: torch.Tensor,
    packed: TwellPacked,
    wu: torch.Tensor,
    wd: torch.Tensor,
    bu: Optional[torch.Tensor] = None,
    bd: Optional[torch.Tensor] = None,
    dense_rows: Optional[torch.Tensor] = None,
    wg: Optional[torch.Tensor] = None,
    bg: Optional[torch.Tensor] = None,
    out_dtype: Optional[torch.dtype] = None,
    *,
    layout: TwellLayout = DEFAULT_LAYOUT,
    return_up: bool = False,
):
    """The FFN output from its packed gate (gated) or packed up pre-activation (plain).

    Matches ``reference.ffn_forward_ref(x, wg, wu, wd, bg, bu, bd).out`` (fp32 arithmetic, one
    rounding at the output) for the ``packed`` that ``gate_pack`` (or ``reference.gate_pack_ref``)
    makes from ``(x, wg, bg)`` (gated) or ``(x, wu, bu)`` (plain).

    Args:
        x: ``[M, D]`` float16/bfloat16/float32.
        packed: TwELL buffer of ``M`` rows and ``H`` columns (``format.TwellPacked``) in ``layout``.
        wu: ``[H, D]`` up weight (``nn.Linear`` layout), dtype of x.
        wd: ``[D, H]`` down weight (``nn.Linear`` layout), dtype of x. Transposed inside (see the
            module docstring for the cost).
        bu, bd, bg: optional biases ``[H]``, ``[D]``, ``[H]`` (any float dtype).
        dense_rows: bool ``[M]`` on x's device: rows computed by the dense formula over all H.
            Use ``reference.dense_rows_ref`` semantics. ``None``: ``guard_rows(...)``, computed
            here (it reads every weight once); overflowed tiles stay exact either way.
        wg: ``[H, D]`` gate weight for a gated FFN; ``None`` for a plain one.
        out_dtype: dtype of the output (float16/bfloat16/float32); default x's dtype.
        layout: the TwELL layout ``packed`` was made with.
        return_up: also return ``up_val``, fp32 ``[M, n_tiles, slots]``: the up value of each
            stored pair of the sparse rows, 0 in every other slot (``ForwardResult.up_val``);
            an empty ``[0]`` tensor for a plain FFN.

    Returns:
        ``out [M, D]``, or ``(out, up_val)`` with ``return_up``.

    Example::

        packed = gate_pack(x, wg, bg)
        out = sparse_ffn(x, packed, wu, wd, bu, bd, wg=wg, bg=bg)
    """
    # 1. Check shapes, dtypes and devices.
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"x must be a 2-D tensor [M, D], got {getattr(x, 'shape', type(x).__name__)}")
    if not isinstance(wu, torch.Tensor) or wu.dim() != 2:
        raise ValueError(f"wu must be a 2-D tensor [H, D], got {getattr(wu, 'shape', type(wu).__name__)}")
    m, d = x.shape
    h = wu.shape[0]
    dev = x.device
    floats = (torch.float16, torch.bfloat16, torch.float32)
    _check("x", x, (m, d), _DTYPES, dev)
    _check("wu", wu, (h, d), (x.dtype,), dev)
    _check("wd", wd, (d, h), (x.dtype,), dev)
    gated = wg is not None
    if gated:
        _check("wg", wg, (h, d), (x.dtype,), dev)
    elif bg is not None:
        raise ValueError("bg was given without wg: a plain FFN has no gate bias")
    for name, b, n in (("bu", bu, h), ("bd", bd, d), ("bg", bg, h)):
        if b is not None:
            _check(name, b, (n,), floats, dev)
    if not isinstance(packed, TwellPacked):
        raise TypeError(f"packed must be a TwellPacked, got {type(packed).__name__}")
    n_tiles, slots = layout.n_tiles(h), layout.slots
    _check("packed.idx", packed.idx, (m, n_tiles, slots), (torch.int32,), dev)
    _check("packed.val", packed.val, (m, n_tiles, slots), (torch.float32,), dev)
    _check("packed.count", packed.count, (m, n_tiles), (torch.int32,), dev)
    if dense_rows is not None:
        _check("dense_rows", dense_rows, (m,), (torch.bool,), dev)
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if out_dtype not in floats:
        raise TypeError(f"out_dtype must be one of {[str(t) for t in floats]}, got {out_dtype}")
    if not INTERPRET and dev.type != "cuda":
        raise ValueError(f"x must be a CUDA tensor (or set TRITON_INTERPRET=1), got device {dev}")

    # 2. Allocate the outputs (and Wdᵀ, the only temporary).
    out = torch.empty(m, d, dtype=out_dtype, device=dev)
    store_up = return_up and gated
    if store_up:
        up_val = torch.empty(m, n_tiles, slots, dtype=torch.float32, device=dev)
    else:
        up_val = torch.zeros(0, dtype=torch.float32, device=dev)
    if m == 0:
        return (out, up_val) if return_up else out
    if dense_rows is None:
        dense_rows = guard_rows(x, wg, wu, wd, bg, bu, bd)
    x, wu = _rowmajor(x), _rowmajor(wu)
    wg = _rowmajor(wg) if gated else wu
    wdt = wd.t().contiguous()  # [H, D]: column j of Wd as a contiguous row
    idx, val, count = packed.idx.contiguous(), packed.val.contiguous(), packed.count.contiguous()
    dense_rows = dense_rows.contiguous()
    dummy = val  # stands in for absent biases; never read
    common = (
        m, d, h,
    )
    strides = (x.stride(0), wg.stride(0), wu.stride(0), wdt.stride(0), out.stride(0))
    flags = dict(GATED=gated, HAS_BG=bg is not None, HAS_BU=bu is not None, HAS_BD=bd is not None)

    # 3. Launch: sparse rows, then dense rows (disjoint output rows).
    block_d = max(16, triton.next_power_of_2(d))
    _sparse_ffn_kernel[lambda meta: (triton.cdiv(m, meta["TOKENS"]),)](
        x, wg, bg if bg is not None else dummy, wu, bu if bu is not None else dummy, wdt,
        bd if bd is not None else dummy,
        idx, val, count, dense_rows, out, up_val if store_up else dummy,
        *common, n_tiles, *strides,
        **flags, STORE_UP=store_up, SLOTS=slots, SLOTS_P2=triton.next_power_of_2(slots),
        TILE_N=layout.tile_n, NT_P2=max(2, triton.next_power_of_2(n_tiles)), BLOCK_D=block_d,
    )
    if d > 0:
        if INTERPRET:
            bm, bh, bk, bd_blk, warps = 16, 32, 32, min(64, block_d), 4
        else:
            # Flagged rows are expected to be rare (overflow, non-finite inputs): small row blocks
            # waste less on an isolated row; BD=256 recomputes gate/up D/256 times.
            bm, bh, bk, bd_blk, warps = 32, 64, 64, min(256, block_d), 8
        grid = (triton.cdiv(m, bm), triton.cdiv(d, bd_blk))
        _dense_rows_kernel[grid](
            x, wg, bg if bg is not None else dummy, wu, bu if bu is not None else dummy, wdt,
            bd if bd is not None else dummy, dense_rows, out,
            *common, *strides,
            **flags, IEEE=x.dtype == torch.float32, INTERPRET=INTERPRET,
            BM=bm, BH=bh, BK=bk, BD=bd_blk, num_warps=warps,
        )
    return (out, up_val) if return_up else out
