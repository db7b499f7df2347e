"""What the sparse kernels need from the weights, made on the device in one pass each.

* ``transposed(wd)``: ``Wdᵀ`` as a contiguous ``[H, D]`` tensor, so that column ``j`` of the
  ``nn.Linear`` down weight ``Wd [D, H]`` is a contiguous row the pair loops can gather (and, in
  the backward, ``dWd`` from the rows of ``dWdᵀ`` the kernel writes). A tiled transpose: each
  program moves a ``64 × 64`` tile, read along one dimension and written along the other.
* ``guard_bounds(...)``: the bounds of the finiteness guard (``row_lists.flag_rows``): the largest
  row norm of ``Wu``, the largest column norm of ``Wd``, the largest ``|bu|``, and whether every
  weight and bias is finite. One launch reads each weight once (norms as fp32 sums of squares,
  reduced across programs with atomic maxima) and its last program turns them into bounds.

``weight_prep`` makes both in one launch (the ops use it). They run again whenever a weight
changes (an optimizer step, or every replay of a CUDA graph, where no host code runs to notice),
so their cost is paid per training step. On the H200 at D=2048, H=5632 (bf16): the transpose 33 µs
against 79 µs for PyTorch's strided copy, the bounds 0.08–0.09 ms against 0.47–0.58 ms for the ~10
tensor ops that compute them (docs/benchmarks.md).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .launch import cdiv, launch
from .tickets import zeroed_scratch
from .triton_helpers import INTERPRET, jit_helper

TRANSPOSE_TILE = 16 if INTERPRET else 64  # transpose tile
NORM_ROWS = 4 if INTERPRET else 32  # norm rows (or columns) per program
NORM_CHUNK = 16 if INTERPRET else 128  # reduced elements per step
# facts int32 [5]: max Σ Wu_j², max Σ Wd[:, j]² (fp32 bits), any non-finite (0/1), max |bu| (fp32
# bits), and the programs' ticket
_UP, _DOWN, _BAD, _BIAS, _TICKET = (tl.constexpr(i) for i in range(5))


@triton.jit
def _transpose_kernel(src_ptr, dst_ptr, R, C, stride_src, stride_dst, TILE: tl.constexpr):
    """``dst[c, r] = src[r, c]`` for one ``TILE × TILE`` tile; src ``[R, C]``, dst ``[C, R]``."""
    r = tl.program_id(0) * TILE + tl.arange(0, TILE)
    c = tl.program_id(1) * TILE + tl.arange(0, TILE)
    ok = (r < R)[:, None] & (c < C)[None, :]
    tile = tl.load(src_ptr + r.to(tl.int64)[:, None] * stride_src + c[None, :], mask=ok)
    tl.store(dst_ptr + c.to(tl.int64)[:, None] * stride_dst + r[None, :], tl.trans(tile), mask=tl.trans(ok))


def transposed(t: torch.Tensor) -> torch.Tensor:
    """``t.t().contiguous()`` for a 2-D ``t``, bitwise, in one launch (PyTorch's copy is a strided
    kernel: 79 µs for ``Wd`` at D=2048, H=5632 on the H200, against 33). Returns ``t.t()`` itself
    (no copy) when that already is contiguous."""
    out = t.t()
    if out.is_contiguous() or out.numel() == 0 or (not INTERPRET and t.device.type != "cuda"):
        return out.contiguous()
    t = t if t.stride(1) == 1 else t.contiguous()
    r, c = t.shape
    out = torch.empty(c, r, dtype=t.dtype, device=t.device)
    launch(_transpose_kernel, (cdiv(r, TRANSPOSE_TILE), cdiv(c, TRANSPOSE_TILE)), t, out, r, c, t.stride(0),
           out.stride(0), TILE=TRANSPOSE_TILE, num_warps=4)
    return out


@jit_helper
def _block_facts(ptr, j, j_ok, K, stride_j, stride_k, out_ptr, ROWS: tl.constexpr, CHUNK: tl.constexpr,
                 STORE: tl.constexpr):
    """``(max over the block of Σ_k w[j, k]², any non-finite)`` for vectors ``j`` of ``w``, each
    reduced over ``K`` elements; NaN sums become +Inf so the atomic maximum stays ordered. With
    ``STORE``, the vectors are also written as contiguous rows of ``out [*, K]``."""
    k = tl.arange(0, CHUNK)
    # Element-wise partial sums, reduced once at the end, so that no reduction's shuffles stand
    # between one step's loads and the next (a reduction per step: 47 us for the 2B shape's three
    # weights on the H200, 1.5 TB/s).
    sq = tl.full((ROWS, CHUNK), 0.0, tl.float32)
    bad = tl.full((ROWS, CHUNK), 0, tl.int32)
    for k0 in range(0, K, CHUNK):
        kk = k0 + k
        ok = j_ok[:, None] & (kk < K)[None, :]
        v = tl.load(ptr + j[:, None] * stride_j + kk[None, :] * stride_k, mask=ok, other=0.0)
        if STORE:
            tl.store(out_ptr + j[:, None] * K + kk[None, :], v, mask=ok)
        v = v.to(tl.float32)
        sq += v * v
        bad = tl.maximum(bad, ((v - v) != 0).to(tl.int32))  # NaN exactly for NaN and Inf
    sq = tl.sum(sq, axis=1)
    sq = tl.where(sq == sq, sq, float("inf"))
    return tl.max(sq, axis=0), tl.max(tl.max(bad, axis=1), axis=0)


@jit_helper
def _any_nonfinite(v):
    """int32 0/1: does the vector ``v`` hold a NaN or an Inf (``v - v`` is NaN exactly then)."""
    v = v.to(tl.float32)
    return tl.max(((v - v) != 0).to(tl.int32), axis=0)


@triton.jit
def _weight_facts_kernel(
    wu_ptr, wd_ptr, wg_ptr, bg_ptr, bu_ptr, bd_ptr, facts_ptr, fwd_ptr, bwd_ptr, wdt_ptr,
    H, D, stride_wu, stride_wd_j, stride_wd_k, stride_wg,
    LIMIT: tl.constexpr, GATED: tl.constexpr, HAS_BG: tl.constexpr, HAS_BU: tl.constexpr, HAS_BD: tl.constexpr,
    STORE_WDT: tl.constexpr, ROWS: tl.constexpr, CHUNK: tl.constexpr,
):
    """Program ``(b, w)``: vectors ``b·ROWS ...`` of weight ``w`` (0: rows of Wu, 1: columns of Wd,
    2: rows of Wg, 3: the biases, split the same way), folded into the zeroed int32 ``facts`` by
    atomic maxima (of fp32 bit patterns: non-negative floats order as integers); the last program
    to arrive (a ticket) turns them into the ``[3]`` bounds. With ``STORE_WDT`` the programs of
    Wd's columns also write them as the rows of ``wdt [H, D]`` (``transposed``'s copy, in the same
    pass)."""
    which = tl.program_id(1)
    j = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    bad = tl.full([], 0, tl.int32)
    if which == 0:
        sq, bad = _block_facts(wu_ptr, j.to(tl.int64), j < H, D, stride_wu, 1, wdt_ptr, ROWS, CHUNK, False)
        tl.atomic_max(facts_ptr + _UP, sq.to(tl.int32, bitcast=True))
    elif which == 1:
        sq, bad = _block_facts(wd_ptr, j.to(tl.int64), j < H, D, stride_wd_j, stride_wd_k, wdt_ptr, ROWS, CHUNK,
                               STORE_WDT)
        tl.atomic_max(facts_ptr + _DOWN, sq.to(tl.int32, bitcast=True))
    elif which == 2:
        if GATED:
            sq, bad = _block_facts(wg_ptr, j.to(tl.int64), j < H, D, stride_wg, 1, wdt_ptr, ROWS, CHUNK, False)
    else:
        if HAS_BG:
            bad = tl.maximum(bad, _any_nonfinite(tl.load(bg_ptr + j, mask=j < H, other=0.0)))
        if HAS_BU:
            v = tl.load(bu_ptr + j, mask=j < H, other=0.0).to(tl.float32)
            bad = tl.maximum(bad, _any_nonfinite(v))
            top = tl.max(tl.abs(v), axis=0)
            tl.atomic_max(facts_ptr + _BIAS, tl.where(top == top, top, float("inf")).to(tl.int32, bitcast=True))
        if HAS_BD:
            bad = tl.maximum(bad, _any_nonfinite(tl.load(bd_ptr + j, mask=j < D, other=0.0)))
    tl.atomic_max(facts_ptr + _BAD, bad)
    last = tl.num_programs(0) * tl.num_programs(1) - 1
    if tl.atomic_add(facts_ptr + _TICKET, 1) == last:  # acq_rel: every other program's maxima are in
        # read and zero: the buffer is left as found (``zeroed_scratch``)
        up = tl.atomic_xchg(facts_ptr + _UP, 0).to(tl.float32, bitcast=True)
        down = tl.atomic_xchg(facts_ptr + _DOWN, 0).to(tl.float32, bitcast=True)
        offset = tl.where(tl.atomic_xchg(facts_ptr + _BAD, 0) > 0, float("inf"), 0.0)
        top_bias = tl.atomic_xchg(facts_ptr + _BIAS, 0).to(tl.float32, bitcast=True)
        tl.atomic_xchg(facts_ptr + _TICKET, 0)
        if GATED:
            tl.store(fwd_ptr, tl.sqrt_rn(up))
            tl.store(fwd_ptr + 1, offset + top_bias)
            tl.store(bwd_ptr, tl.sqrt_rn(down))
        else:
            tl.store(fwd_ptr, 0.0)
            tl.store(fwd_ptr + 1, offset)
            tl.store(bwd_ptr, 0.0)
        tl.store(bwd_ptr + 1, 0.0)
        tl.store(fwd_ptr + 2, LIMIT)
        tl.store(bwd_ptr + 2, LIMIT)


def guard_bounds(wg: Optional[torch.Tensor], wu: torch.Tensor, wd: torch.Tensor, bg: Optional[torch.Tensor],
                 bu: Optional[torch.Tensor], bd: Optional[torch.Tensor], *, reuse_tickets: bool = False):
    """``(forward, backward)`` fp32 ``[3]`` bounds for ``row_lists.flag_rows``: the finiteness
    guard of ``reference.dense_rows_ref`` on rows of x, and the ``dout`` terms of
    ``reference.backward_dense_rows_ref`` on rows of dout (``reference.guard_bounds_ref``).

    Gated: ``‖x_t‖·max‖Wu_j‖ + max|bu|`` bounds the up projection and ``‖dout_t‖·max‖Wd[:, j]‖``
    bounds ``dh``; both must stay below the dtype's largest value. Plain: scale 0, so only a
    non-finite norm (NaN after ``·0``) flags. A non-finite weight or bias flags every forward row
    (offset +Inf). One pass over the weights whose last program writes the bounds, on a zeroed
    buffer that it leaves zeroed (``zeroed_scratch``: kept with ``reuse_tickets``, else a fill);
    no host sync.
    """
    forward, backward, _ = weight_prep(wg, wu, wd, bg, bu, bd, reuse_tickets=reuse_tickets)
    return forward, backward


def weight_prep(wg: Optional[torch.Tensor], wu: torch.Tensor, wd: torch.Tensor, bg: Optional[torch.Tensor],
                bu: Optional[torch.Tensor], bd: Optional[torch.Tensor], *, reuse_tickets: bool = False,
                down_rows: bool = False):
    """``(forward, backward, wd_rows)``: ``guard_bounds``' two bounds and, with ``down_rows``, ``Wdᵀ``
    for the sparse kernels as ``transposed(wd).t()`` would give it (``wd`` itself when ``wd.t()``
    is already contiguous), made in the same pass: the programs that read Wd's columns for their
    norms write them as rows too. One launch where the bounds and ``transposed`` took two, and Wd
    is read once. ``wd_rows`` is None without ``down_rows``."""
    gated = wg is not None
    h, d = wu.shape
    dev = wu.device
    if not INTERPRET and dev.type != "cuda":
        raise ValueError(f"wu must be a CUDA tensor (or set TRITON_INTERPRET=1), got device {dev}")
    facts = zeroed_scratch(5, dev, reuse=reuse_tickets)
    bounds = torch.empty(2, 3, dtype=torch.float32, device=dev)
    wu_ = wu if wu.stride(1) == 1 else wu.contiguous()
    wg_ = (wg if wg.stride(1) == 1 else wg.contiguous()) if gated else wu_
    store = down_rows and not wd.t().is_contiguous()
    wdt = torch.empty(h, d, dtype=wd.dtype, device=dev) if store else bounds
    launch(_weight_facts_kernel, (max(1, cdiv(max(h, d), NORM_ROWS)), 4),
        wu_, wd, wg_, bg if bg is not None else bounds, bu if bu is not None else bounds,
        bd if bd is not None else bounds, facts, bounds[0], bounds[1], wdt,
        h, d, wu_.stride(0), wd.stride(1), wd.stride(0), wg_.stride(0),
        LIMIT=torch.finfo(wu.dtype).max, GATED=gated, HAS_BG=bg is not None, HAS_BU=bu is not None,
        HAS_BD=bd is not None, STORE_WDT=store, ROWS=NORM_ROWS, CHUNK=NORM_CHUNK, num_warps=4,
    )
    wd_rows = (wdt.t() if store else wd) if down_rows else None
    return bounds[0], bounds[1], wd_rows


KERNELS = {"transpose": _transpose_kernel, "weight_facts": _weight_facts_kernel}
