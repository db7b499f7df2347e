"""The weight gradients, neuron-major: ``dWg``, ``dWu``, ``dWdᵀ`` and the bias gradients, a neuron's
rows at a time.

Math (``reference.ffn_backward_ref``): for neuron ``j``, over its stored pairs ``(t, j)`` and then
the dense rows ``r``,

    dWg_j = Σ dgate · x,    dWu_j = Σ dup · x,    dWdᵀ_j = Σ h · dout,    dbg_j = Σ dgate,    dbu_j = Σ dup,

with a pair's ``dgate``, ``dup`` and ``h`` recomputed from its stored ``val``, ``up_val`` and the
``dh`` that ``tokens_bwd`` stored (``grad_math``), and a dense row's read from the coefficient
scratch (``dense_rows_bwd``), or already summed as GEMMs there, or recomputed past ``r_cap``. fp32
sums, one rounding at each output element, which has exactly one writer.

``_wgrad_kernel``: a program owns neuron ``j`` × a ``BD`` slice of D. It loops over ``j``'s pairs in
token order (``neuron_major``'s list), ``CK`` at a time, gathering their ``x`` and ``dout`` rows
(bf16 rows as int32 pairs: ``pair_walk.load_row``), then over the dense rows, ``CK`` at a time
too, which keeps every config at 113–123 registers on sm90 (the backward 2.00 ms at 0.5% density
on the H200). Neurons launch heaviest first (``neuron_major``'s order), each neuron's D slices
together, and the ``HOT_NEURONS`` hottest are split in ``HOT_SEGMENTS`` runs of pairs whose fp32
partials the last to finish sums in order (a ticket per neuron and slice; deterministic), so that
a skewed layer's hottest neurons do not end the kernel: on the H200 (M=16384, skewed neurons, 1%
density) the kernel takes 1.286 ms, against 2.880 ms unsplit.

Bytes, 16-bit tensors (``e = 2``): per pair its ``x`` and ``dout`` rows, ``2·D·e`` (8 KiB at
D = 2048), from L2 slabs; ``3·H·D·e`` written.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .dense_rows import scratch_tiles
from .dense_rows_bwd import DenseScratch
from .grad_math import hidden_values, pair_grads, sign_of
from .launch import cdiv, launch, next_power_of_2
from .pair_walk import join_row, load_row, overflow_up, paired, row_lanes, widen, zero_row
from .row_lists import RowList
from .tickets import last_to_arrive, zeroed_scratch
from .triton_helpers import INTERPRET, column_mask, jit_helper, reduce_sum


def _wgrad_configs():
    if INTERPRET:
        return [triton.Config({"BD": 32, "CK": 8}, num_warps=4, num_stages=1)]
    # (D slice, pairs per chunk, warps, stages). On the H200 (bf16, D=2048, H=5632, M=16384,
    # uniform neurons, 0.3-1% density), at 113-125 registers, the autotuner picks (1024, 2, 2, 1)
    # or (512, 2, 1, 1), run to run.
    shapes = [(1024, 2, 2, 1), (2048, 2, 4, 1), (1024, 4, 4, 1), (2048, 4, 8, 1), (1024, 4, 2, 1), (512, 2, 1, 1),
              (64, 8, 1, 1)]
    return [triton.Config({"BD": bd, "CK": ck}, num_warps=w, num_stages=st) for bd, ck, w, st in shapes]


# The narrowest D slice of _wgrad_configs (the tickets of the hottest neurons' segments).
_WGRAD_MIN_BD = min(c.kwargs["BD"] for c in _wgrad_configs())
# The hottest neurons' pairs are split over programs. One program walks a neuron's pairs one chunk
# at a time, so with skewed neurons (log-normal, the hottest at ~27x the mean pairs) the hottest
# neurons' programs would end the kernel. The HOT_NEURONS hottest, when they have HOT_SPLIT_MIN
# pairs or more (uniform neurons at 1% density have ~164), get HOT_SEGMENTS programs each. On the
# H200 (M=16384, configs tuned on uniform neurons first, as the bench does), with skewed neurons:
# 0.767 ms at 0.5% density against 1.449 unsplit, 1.497 against 2.880 at 1%, 2.94 against 5.96 at
# 2%; uniform neurons the same (0.605 / 0.614 ms at 0.5%).
HOT_NEURONS = 64
HOT_SEGMENTS = 16
HOT_SPLIT_MIN = 256


def _prune_wgrad(configs, nargs, **kwargs):
    """Drop D slices wider than D needs (keep the narrowest when none fits)."""
    d_p2 = max(16, next_power_of_2(nargs["D"]))
    keep = [c for c in configs if c.kwargs["BD"] <= d_p2]
    return keep or [min(configs, key=lambda c: c.kwargs["BD"])]


@jit_helper
def _neuron_dots(
    x_ptr, dout_ptr, wg_ptr, wu_ptr, wdt_ptr, rows, r_ok, j, D,
    stride_xm, stride_gm, stride_wg, stride_wu, stride_wdt,
    GATED: tl.constexpr, CR: tl.constexpr, BK: tl.constexpr,
):
    """``(x·Wg_j, x·Wu_j, dout·Wd[:, j])`` ``[CR]`` for dense rows ``rows``, over all D."""
    offs_k = tl.arange(0, BK)
    gate = tl.full((CR,), 0.0, tl.float32)
    up = tl.full((CR,), 0.0, tl.float32)
    dhd = tl.full((CR,), 0.0, tl.float32)
    for k0 in range(0, D, BK):
        kk = k0 + offs_k
        k_ok = kk < D
        a_mask = r_ok[:, None] & k_ok[None, :]
        xa = tl.load(x_ptr + rows[:, None] * stride_xm + kk[None, :], mask=a_mask, other=0.0).to(tl.float32)
        ga = tl.load(dout_ptr + rows[:, None] * stride_gm + kk[None, :], mask=a_mask, other=0.0).to(tl.float32)
        wu = tl.load(wu_ptr + j * stride_wu + kk, mask=k_ok, other=0.0).to(tl.float32)
        wdt = tl.load(wdt_ptr + j * stride_wdt + kk, mask=k_ok, other=0.0).to(tl.float32)
        up += reduce_sum(xa * wu[None, :], axis=1)
        dhd += reduce_sum(ga * wdt[None, :], axis=1)
        if GATED:
            wg = tl.load(wg_ptr + j * stride_wg + kk, mask=k_ok, other=0.0).to(tl.float32)
            gate += reduce_sum(xa * wg[None, :], axis=1)
    return gate, up, dhd


@jit_helper
def _row_update(acc, acc2, coef, rows, PAIRS: tl.constexpr):
    """``acc += Σ_k coef[k] · rows[k]`` on ``load_row``'s halves (``rows``: ``[CK, lanes]`` as loaded)."""
    ev, od = widen(rows, PAIRS)
    acc += reduce_sum(coef[:, None] * ev, axis=0)
    if PAIRS:
        acc2 += reduce_sum(coef[:, None] * od, axis=0)
    return acc, acc2


@jit_helper
def _rows_update(acc_u, acc_u2, acc_d, acc_d2, d_up, hv, xr, gr, PAIRS: tl.constexpr):
    """The up and down weight gradients' ``_row_update`` of one chunk (x rows ``xr``, dout rows ``gr``)."""
    acc_u, acc_u2 = _row_update(acc_u, acc_u2, d_up, xr, PAIRS)
    acc_d, acc_d2 = _row_update(acc_d, acc_d2, hv, gr, PAIRS)
    return acc_u, acc_u2, acc_d, acc_d2


@jit_helper
def _add_fp32_row(acc, acc2, ptr, base, lanes, ok, PAIRS: tl.constexpr):
    """``acc`` plus the fp32 row at ``ptr + base`` on ``load_row``'s halves."""
    if PAIRS:
        row = ptr + base + 2 * lanes.to(tl.int64)
        acc += tl.load(row, mask=ok, other=0.0)
        acc2 += tl.load(row + 1, mask=ok, other=0.0)
    else:
        acc += tl.load(ptr + base + lanes, mask=ok, other=0.0)
    return acc, acc2


@triton.autotune(configs=_wgrad_configs(), key=["D", "H", "GATED", "PARTIAL", "SEGS"],
                 prune_configs_by={"early_config_prune": _prune_wgrad})
@triton.heuristics({"EVEN_D": lambda a: a["D"] % a["BD"] == 0})
@triton.jit
def _wgrad_kernel(
    # pointers: activations, pair data, dense rows, weights (for recomputation), outputs
    x_ptr, dout_ptr, val_ptr, up_ptr, dh_ptr, nptr_ptr, list_ptr, order_ptr,
    rows_ptr, ndense_ptr, coef_ptr, part_ptr, psum_ptr,
    wg_ptr, wu_ptr, wdt_ptr, bg_ptr, bu_ptr, scale_ptr,
    dwg_ptr, dwu_ptr, dwdt_ptr, dbg_ptr, dbu_ptr,
    # the hottest neurons' segments: fp32 partial rows and bias sums, int32 tickets (zeroed)
    seg_part_ptr, seg_sum_ptr, tickets_ptr,
    # dimensions (SLOT_ROW = N_TILES · SLOTS; PLANE = R_CAP · H; TOP hottest neurons are split in
    # SEGS segments when they have SPLIT_MIN pairs or more)
    D, H, SLOT_ROW, R_CAP, PLANE, TOP, SPLIT_MIN,
    # row strides (elements)
    stride_xm, stride_gm, stride_wg, stride_wu, stride_wdt,
    # meta-parameters
    GATED: tl.constexpr, HAS_BG: tl.constexpr, HAS_BU: tl.constexpr, PARTIAL: tl.constexpr, SEGS: tl.constexpr,
    BK: tl.constexpr, BD: tl.constexpr, CK: tl.constexpr, PAIRS: tl.constexpr, EVEN_D: tl.constexpr,
    OVF: tl.constexpr,
):
    """``dWg[j, dblock]``, ``dWu[j, dblock]``, ``dWdᵀ[j, dblock]`` (and ``dbg[j]``, ``dbu[j]`` from
    the first D slice) for neuron ``j = order[p]`` and D slice ``c``, ``program_id(0) = p · slices + c``.

    Sparse pairs: ``list[nptr[j]:nptr[j + 1]]`` (slot numbers; token = slot // SLOT_ROW), with
    ``dgate``/``dup``/``h`` recomputed from TwELL ``val``, ``up`` and the ``dh`` that
    ``_tokens_dh_kernel`` stored. Dense rows: ``rows[:n_dense]``, coefficients from the scratch
    ``coef [planes, R_CAP, H]`` for list positions ``< R_CAP`` (a multiple of BR, so of CK), else
    recomputed.
    With PARTIAL, the positions ``< R_CAP`` come summed by ``_dense_wgrad_kernel`` (``part``,
    ``psum``) instead. dwg, dwu, dwdt ``[H, D]`` contiguous; every element written exactly once.

    Programs ``p = 0 .. TOP·SEGS - 1`` take the ``TOP`` hottest neurons (``order`` is by decreasing
    pair count), ``SEGS`` programs each; the rest one neuron each. A hot neuron with ``SPLIT_MIN``
    pairs or more is split: segment ``s`` takes list positions ``[n·s/SEGS, n·(s+1)/SEGS)`` (and
    segment 0 the dense rows), stores fp32 partial rows, and the last segment to arrive (a ticket
    per neuron and D slice) sums them in segment order and writes the result: deterministic, one
    rounding. Otherwise segment 0 takes every pair and the others return.
    """
    n_slices = tl.cdiv(D, BD)
    p0 = tl.program_id(0) // n_slices  # one axis: a neuron's D slices launch next to each other
    pd = tl.program_id(0) % n_slices
    heavy = p0 < TOP * SEGS
    rank = tl.where(heavy, p0 // SEGS, p0 - TOP * (SEGS - 1))
    seg = tl.where(heavy, p0 % SEGS, 0)
    j64 = tl.load(order_ptr + rank).to(tl.int64)
    start = tl.load(nptr_ptr + j64)
    end = tl.load(nptr_ptr + j64 + 1)
    split = heavy & (end - start >= SPLIT_MIN)
    if split:
        n = end - start
        start, end = start + n * seg // SEGS, start + n * (seg + 1) // SEGS
    elif seg > 0:
        return
    offs_d = pd * BD + tl.arange(0, BD)
    d_ok = column_mask(offs_d, D, EVEN_D)
    lanes, l_ok = row_lanes(pd, D, BD, PAIRS, EVEN_D)
    acc_g, acc_g2 = zero_row(lanes, PAIRS)
    acc_u, acc_u2 = zero_row(lanes, PAIRS)
    acc_d, acc_d2 = zero_row(lanes, PAIRS)

    # Sparse pairs, in token order.
    sum_g = tl.full((CK,), 0.0, tl.float32)
    sum_u = tl.full((CK,), 0.0, tl.float32)
    offs_k = tl.arange(0, CK)
    # Each iteration loads the next chunk's slot numbers while this chunk's rows are gathered.
    k_ok = start + offs_k < end
    slot = tl.load(list_ptr + start + offs_k, mask=k_ok, other=0).to(tl.int64)
    for k0 in range(start, end, CK):
        next_ok = k0 + CK + offs_k < end
        next_slot = tl.load(list_ptr + k0 + CK + offs_k, mask=next_ok, other=0).to(tl.int64)
        tok = slot // SLOT_ROW
        m2 = k_ok[:, None] & l_ok[None, :]
        xr = load_row(x_ptr, tok[:, None] * stride_xm, lanes[None, :], m2, PAIRS, "")
        gr = load_row(dout_ptr, tok[:, None] * stride_gm, lanes[None, :], m2, PAIRS, "")
        pre = overflow_up(tl.load(val_ptr + slot, mask=k_ok, other=0.0), OVF)
        dh = tl.load(dh_ptr + slot, mask=k_ok, other=0.0)
        if GATED:
            up = tl.load(up_ptr + slot, mask=k_ok, other=0.0)
        else:
            up = pre
        act, hv = hidden_values(pre, up, GATED)
        d_gate, d_up = pair_grads(pre, up, act, dh, GATED)
        d_up = tl.where(k_ok, d_up, 0.0)
        hv = tl.where(k_ok, hv, 0.0)
        acc_u, acc_u2, acc_d, acc_d2 = _rows_update(acc_u, acc_u2, acc_d, acc_d2, d_up, hv, xr, gr, PAIRS)
        sum_u += d_up
        if GATED:
            d_gate = tl.where(k_ok, d_gate, 0.0)
            acc_g, acc_g2 = _row_update(acc_g, acc_g2, d_gate, xr, PAIRS)
            sum_g += d_gate
        k_ok, slot = next_ok, next_slot

    # Dense rows, in list (= row) order, CK at a time like the pairs, which keeps every program at
    # 123 registers on sm90 even with no dense row.
    dsum_g = tl.full((CK,), 0.0, tl.float32)
    dsum_u = tl.full((CK,), 0.0, tl.float32)
    n_dense = tl.where(seg == 0, tl.load(ndense_ptr), 0)  # a split neuron's dense rows: segment 0's
    scale = tl.load(scale_ptr)
    offs_r = tl.arange(0, CK)
    first = 0
    if PARTIAL:  # the first R_CAP list positions, summed as GEMMs (written only if n_dense > 0)
        first = R_CAP
        if n_dense > 0:
            plane = H.to(tl.int64) * D
            at = j64 * D
            if GATED:
                acc_g, acc_g2 = _add_fp32_row(acc_g, acc_g2, part_ptr, at, lanes, l_ok, PAIRS)
                acc_u, acc_u2 = _add_fp32_row(acc_u, acc_u2, part_ptr, plane + at, lanes, l_ok, PAIRS)
                acc_d, acc_d2 = _add_fp32_row(acc_d, acc_d2, part_ptr, 2 * plane + at, lanes, l_ok, PAIRS)
                sum_g += tl.where(offs_k == 0, tl.load(psum_ptr + H + j64), 0.0)
            else:
                acc_u, acc_u2 = _add_fp32_row(acc_u, acc_u2, part_ptr, at, lanes, l_ok, PAIRS)
                acc_d, acc_d2 = _add_fp32_row(acc_d, acc_d2, part_ptr, plane + at, lanes, l_ok, PAIRS)
            sum_u += tl.where(offs_k == 0, tl.load(psum_ptr + j64), 0.0)
    for i0 in range(first, n_dense, CK):
        i = i0 + offs_r
        r_ok = i < n_dense
        rows = tl.load(rows_ptr + i, mask=r_ok, other=0).to(tl.int64)
        if i0 < R_CAP:
            at = i.to(tl.int64) * H + j64
            if GATED:
                d_gate = tl.load(coef_ptr + at, mask=r_ok, other=0.0)
                d_up = tl.load(coef_ptr + PLANE + at, mask=r_ok, other=0.0)
                hv = tl.load(coef_ptr + 2 * PLANE + at, mask=r_ok, other=0.0)
            else:
                d_up = tl.load(coef_ptr + at, mask=r_ok, other=0.0)
                hv = tl.load(coef_ptr + PLANE + at, mask=r_ok, other=0.0)
                d_gate = d_up
        else:
            gate, up, dhd = _neuron_dots(x_ptr, dout_ptr, wg_ptr, wu_ptr, wdt_ptr, rows, r_ok, j64, D,
                                         stride_xm, stride_gm, stride_wg, stride_wu, stride_wdt, GATED, CK, BK)
            if HAS_BU:
                up += tl.load(bu_ptr + j64).to(tl.float32)
            if GATED:
                if HAS_BG:
                    gate += tl.load(bg_ptr + j64).to(tl.float32)
                pre = gate
            else:
                pre = up
            act, hv = hidden_values(pre, up, GATED)
            d_gate, d_up = pair_grads(pre, up, act, dhd + scale * sign_of(hv), GATED)
            d_gate = tl.where(r_ok, d_gate, 0.0)
            d_up = tl.where(r_ok, d_up, 0.0)
            hv = tl.where(r_ok, hv, 0.0)
        m2 = r_ok[:, None] & l_ok[None, :]
        xr = load_row(x_ptr, rows[:, None] * stride_xm, lanes[None, :], m2, PAIRS, "")
        gr = load_row(dout_ptr, rows[:, None] * stride_gm, lanes[None, :], m2, PAIRS, "")
        acc_u, acc_u2, acc_d, acc_d2 = _rows_update(acc_u, acc_u2, acc_d, acc_d2, d_up, hv, xr, gr, PAIRS)
        dsum_u += d_up
        if GATED:
            acc_g, acc_g2 = _row_update(acc_g, acc_g2, d_gate, xr, PAIRS)
            dsum_g += d_gate

    row_u = join_row(acc_u, acc_u2, PAIRS)
    row_d = join_row(acc_d, acc_d2, PAIRS)
    row_g = join_row(acc_g, acc_g2, PAIRS)
    bias_u = reduce_sum(sum_u, axis=0) + reduce_sum(dsum_u, axis=0)
    bias_g = reduce_sum(sum_g, axis=0) + reduce_sum(dsum_g, axis=0)
    write = tl.full([], 1, tl.int32)
    if split:
        at = (rank * SEGS + seg).to(tl.int64)
        base = at * 3 * D
        tl.store(seg_part_ptr + base + offs_d, row_u, mask=d_ok)
        tl.store(seg_part_ptr + base + D + offs_d, row_d, mask=d_ok)
        if GATED:
            tl.store(seg_part_ptr + base + 2 * D + offs_d, row_g, mask=d_ok)
        if pd == 0:
            tl.store(seg_sum_ptr + 2 * at, bias_u)
            tl.store(seg_sum_ptr + 2 * at + 1, bias_g)
        write = write * 0
        if last_to_arrive(tickets_ptr + rank * n_slices + pd, SEGS, True):
            write = write + 1
            row_u = tl.zeros([BD], tl.float32)
            row_d = tl.zeros([BD], tl.float32)
            row_g = tl.zeros([BD], tl.float32)
            bias_u = tl.zeros([], tl.float32)
            bias_g = tl.zeros([], tl.float32)
            for t in range(SEGS):
                at = (rank * SEGS + t).to(tl.int64)
                base = at * 3 * D
                row_u += tl.load(seg_part_ptr + base + offs_d, mask=d_ok, other=0.0, cache_modifier=".cg")
                row_d += tl.load(seg_part_ptr + base + D + offs_d, mask=d_ok, other=0.0, cache_modifier=".cg")
                if GATED:
                    row_g += tl.load(seg_part_ptr + base + 2 * D + offs_d, mask=d_ok, other=0.0, cache_modifier=".cg")
                if pd == 0:
                    bias_u += tl.load(seg_sum_ptr + 2 * at, cache_modifier=".cg")
                    bias_g += tl.load(seg_sum_ptr + 2 * at + 1, cache_modifier=".cg")
    if write != 0:
        out = j64 * D + offs_d
        tl.store(dwu_ptr + out, row_u.to(dwu_ptr.dtype.element_ty), mask=d_ok)
        tl.store(dwdt_ptr + out, row_d.to(dwdt_ptr.dtype.element_ty), mask=d_ok)
        if GATED:
            tl.store(dwg_ptr + out, row_g.to(dwg_ptr.dtype.element_ty), mask=d_ok)
        if pd == 0:
            if HAS_BU:
                tl.store(dbu_ptr + j64, bias_u.to(dbu_ptr.dtype.element_ty))
            if HAS_BG:
                tl.store(dbg_ptr + j64, bias_g.to(dbg_ptr.dtype.element_ty))


def weight_grads(x: torch.Tensor, dout: torch.Tensor, val: torch.Tensor, up: torch.Tensor, dh: torch.Tensor,
                 pairs: tuple, scratch: DenseScratch, listed: RowList, wg: torch.Tensor, wu: torch.Tensor,
                 wdt: torch.Tensor, bg: torch.Tensor, bu: torch.Tensor, scale: torch.Tensor, dwg, dwu: torch.Tensor,
                 dwdt: torch.Tensor, dbg, dbu, *, flags: dict, ovf: float, reuse_tickets: bool,
                 dummy: torch.Tensor) -> None:
    """``dwg``, ``dwu``, ``dwdt`` (``[H, D]`` contiguous) and ``dbg``, ``dbu`` (``[H]``, or None when
    the FFN has no such bias; ``dwg`` None for a plain FFN), every element written once. One launch.

    ``pairs``: ``neuron_major``'s ``(ptr, slots, order)``; ``scratch``: the dense rows'
    (``dense_rows_bwd.dense_rows_backward``); ``listed``: the dense rows; ``val``, ``up`` and ``dh``:
    the TwELL values, up values and ``dh`` (``tokens_bwd``), contiguous ``[M, n_tiles, slots]``; the
    other operands as for ``dense_rows_bwd.dense_rows_backward``.
    """
    nptr, lists, order = pairs
    rows, n_dense = listed
    d = x.shape[1]
    h = wu.shape[0]
    n_tiles, slots = dh.shape[1], dh.shape[2]
    gated = flags["GATED"]
    # Neurons by decreasing pair count (order), each neuron's D slices together, the hottest
    # neurons' pairs in segments (see _wgrad_kernel): fp32 partials and a ticket per (neuron, D
    # slice) of the narrowest slice any config takes.
    top, segs, split_min = (min(h, 3), 3, 2) if INTERPRET else (min(h, HOT_NEURONS), HOT_SEGMENTS, HOT_SPLIT_MIN)
    seg_part = torch.empty(top * segs * 3 * d, dtype=torch.float32, device=x.device)
    seg_sum = torch.empty(top * segs * 2, dtype=torch.float32, device=x.device)
    tickets = zeroed_scratch(top * cdiv(d, _WGRAD_MIN_BD), x.device, reuse=reuse_tickets)
    launch(_wgrad_kernel, lambda meta: ((h + top * (segs - 1)) * cdiv(d, meta["BD"]),),
        x, dout, val, up, dh, nptr, lists, order, rows, n_dense, scratch.coef, scratch.part, scratch.psum,
        wg, wu, wdt, bg, bu, scale,
        dwg if gated else dwu, dwu, dwdt, dbg if dbg is not None else dummy, dbu if dbu is not None else dummy,
        seg_part, seg_sum, tickets,
        d, h, n_tiles * slots, scratch.r_cap, scratch.r_cap * h, top, split_min,
        x.stride(0), dout.stride(0), wg.stride(0), wu.stride(0), wdt.stride(0),
        **flags, PARTIAL=scratch.partial, SEGS=segs, BK=scratch_tiles(x.dtype)[1], PAIRS=paired(x, dout), OVF=ovf,
    )


KERNELS = {"wgrad": _wgrad_kernel}
