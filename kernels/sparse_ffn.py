"""Fused TwELL consumer: the up and down projections on the packed (token, neuron) pairs only.

Math (``reference.ffn_forward_ref``). For every stored pair ``(t, j)`` of a sparse row:

* gated: ``up = x_t · Wu_j + bu_j`` and ``h = relu(g_tj) · up``, with ``g`` the packed gate value;
* plain: ``h = relu(u_tj)``, with ``u`` the packed up pre-activation;

and ``out_t = Σ_j h · Wd[:, j] + bd``, in fp32, cast once to the output dtype. ``relu`` keeps NaN
(``where(v <= 0, 0, v)``), and for 16-bit inputs up, gate and h overflow to ±Inf where dense
PyTorch's rounding to the input dtype would (``reference.overflow_like``).

Rows that the pair loop cannot finish exactly are *whole-dense*: a row with an overflowed tile
(``count > slots``), or flagged in ``dense_rows`` (the finiteness guard of
``reference.dense_rows_ref``, or any row the caller wants dense), gets a dense FFN over all H, with
gate and up recomputed from ``x`` (``dense_rows_fwd``), as in ``reference.ffn_forward_ref``. On the
H200 (bf16, D=2048, H=5632, M=16384, 0.5% density) 8 rows with 4 overflowed tiles each cost the op
nothing measurable this way: 1.25 ms, against 1.26 ms with no such row.

``_sparse_ffn_kernel``: a program owns ``TOKENS`` consecutive tokens (neighbouring tokens share
neurons in real models, so their weight rows can hit in L1) and handles them one after the other,
with the x row and the output row in registers. The ``pair_walk`` cursor walks the token's stored
pairs in (tile, slot) order; for each pair, one gather of the ``Wdᵀ`` row and one of the ``Wu`` row
(and its up bias), issued together, one dot product, one update of the output row. The loop loads
pair ``k + 1``'s ``idx``/``val`` while pair ``k``'s weight rows are gathered, so the dependent round
trip (pair -> weight row) is paid once per token, not once per pair. It flags the whole-dense rows
(or takes the caller's ``row_list``), which ``dense_rows_fwd.whole_dense_rows`` then computes.

Bytes, 16-bit weights (``e = 2``), ``a`` stored pairs per token:

* read per token: x row ``D·e``, the packed row (``n_tiles·4`` + ``a·8``), and ``a`` rows of ``Wu``
  and of ``Wdᵀ``: ``2·a·D·e`` (8 KiB per pair at D=2048), mostly from L2. The x row, the pairs and
  the output row are read or written once, so they go through L2 as ``evict_first``, which leaves
  more of it to the weight rows (the 46 MB of weights share the H200's 60 MiB L2; ``ncu``: a 61% L2
  hit rate, 42% of DRAM bandwidth; 0.566 ms with the hints against 0.578 at 0.5% density);
* written per token: ``D·e_out`` (+ ``n_tiles·slots·4`` with ``return_up``).

Measured (H200, bf16, M=16384, D=2048, H=5632, uniform random neurons): 0.58 ms at 28 active
neurons per token (0.5%), against 0.42 ms for the naive one-token-per-program gather of the same
8 KiB per pair (docs/benchmarks.md, 'Floors and targets'). With uniformly random neurons no layout
reduces the bytes; tokens per program only help when neighbouring tokens share neurons.

``Wd`` is ``[D, H]`` (``nn.Linear``); its columns are rows of ``Wdᵀ``, so the launcher makes
``weights.transposed(wd)`` ([H, D], a tiled transpose) on every call: ``2·H·D·e`` bytes of copy
traffic (46 MB at D=2048, H=5632). No copy is made when ``wd`` already is the transposed view of a
contiguous ``[H, D]`` tensor, so a caller that keeps ``Wdᵀ`` can pass ``wdt.t()``.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .checks import FLOAT_DTYPES, check_ffn_operands, check_packed, check_row_list, check_tensor
from .dense_rows_fwd import whole_dense_rows
from .format import DEFAULT_LAYOUT, TwellLayout, TwellPacked, is_paired
from .launch import cdiv, launch, next_power_of_2
from .pair_walk import (bit_walk, first_pair, join_row, load_pair, load_row, next_pair, overflow_threshold, paired,
                        row_lanes, tile_set, widen, zero_row)
from .reference import finite, may_overflow
from .row_lists import RowList, dense_list
from .tickets import CallRecord, check_record, record_without_kernel
from .triton_helpers import INTERPRET, column_mask, rowmajor
from .weights import transposed


# The register cap of one 4-warp config (see _sparse_configs, prune_sparse).
CAPPED_REGS = 56


def _sparse_configs():
    if INTERPRET:
        return [triton.Config({"TOKENS": 4}, num_warps=4, num_stages=1)]  # few interpreted ops
    # (warps, tokens per program). On the H200 (bf16, D=2048, H=5632, M=16384, uniform neurons):
    # 2 warps are fastest with up values at 0.5% (0.62 ms), 4 warps without them (0.58 ms) and
    # with an up bias, 1 and 2 warps at 2%; more tokens per program are slower. 4 warps capped at
    # 56 registers (ptxas: no spills at D=2048 with pair reads; 9 programs an SM instead of 8):
    # 0.517 ms at 0.5% against 0.542 ms at their 64, bitwise the same output.
    shapes = [(2, 1, None), (4, 1, None), (4, 1, CAPPED_REGS), (1, 1, None)]
    return [triton.Config({"TOKENS": t}, num_warps=w, num_stages=1, maxnreg=r) for w, t, r in shapes]


def prune_sparse(configs, nargs, **kwargs):
    """Keep configs whose ``BLOCK_D`` weight row fits in ≤ 64 fp32 registers per thread, and the
    register-capped one only for pair reads of rows up to 2048 wide (where it does not spill); for
    a D that no config fits, one config of 16 warps."""
    block_d = kwargs["BLOCK_D"]
    capped_ok = kwargs.get("PAIRS", False) and block_d <= 2048
    keep = [c for c in configs if block_d <= 64 * 32 * c.num_warps and (c.maxnreg is None or capped_ok)]
    if keep:
        return keep
    return [triton.Config({"TOKENS": 1}, num_warps=16, num_stages=1)]


# STORE_UP is in the key: training (which stores up values) and inference tune separately. With
# one shared entry training runs the config inference picked first: 1.15 ms per call in an H200
# profile at 0.5% density, against 0.79 ms with its own pick.
# STORE_L1 is not: its one sum per pair leaves the loop's best config as it is.
@triton.autotune(configs=_sparse_configs(), key=["D", "H", "GATED", "STORE_UP", "PAIRS"],
                 prune_configs_by={"early_config_prune": prune_sparse})
@triton.heuristics({"EVEN_D": lambda a: a["D"] % a["BLOCK_D"] == 0})
@triton.jit
def _sparse_ffn_kernel(
    # pointers
    x_ptr, wu_ptr, bu_ptr, wdt_ptr, bd_ptr,
    idx_ptr, val_ptr, count_ptr, dense_ptr, out_ptr, up_ptr, whole_ptr, l1_ptr, bound_ptr, rowcnt_ptr,
    # dimensions
    M, D, H, N_TILES,
    # row strides (elements; every last dimension is contiguous)
    stride_xm, stride_wu, stride_wdt, stride_om,
    # meta-parameters
    GATED: tl.constexpr, HAS_BU: tl.constexpr, HAS_BD: tl.constexpr,
    STORE_UP: tl.constexpr, STORE_WHOLE: tl.constexpr, STORE_L1: tl.constexpr, SLOTS: tl.constexpr,
    NT_P2: tl.constexpr, BLOCK_D: tl.constexpr, OVF: tl.constexpr, TOKENS: tl.constexpr,
    BITS: tl.constexpr, PAIRS: tl.constexpr, EVEN_D: tl.constexpr,
    GUARD: tl.constexpr = False, MARK: tl.constexpr = False, PAIRED: tl.constexpr = False,
):
    """``out[t] = Σ_pairs h · Wdᵀ[j] + bd`` for every token ``t`` that is not a whole-dense row.

    x ``[M, D]``; wu ``[H, D]``; wdt ``[H, D]`` (= Wdᵀ); biases ``[H]``/``[D]``; TwELL
    ``idx``/``val`` ``[M, N_TILES, SLOTS]`` and ``count [M, N_TILES]``; dense bool ``[M]``;
    out ``[M, D]``. A row is whole-dense when ``dense[t]`` or one of its tiles overflows
    (``count > SLOTS``); with ``STORE_WHOLE``, ``whole [M]`` (uint8) receives that flag; the
    dense-row kernels write those rows.
    With STORE_UP, ``up [M, N_TILES, SLOTS]`` fp32 receives the up value of
    each stored pair of a row with no overflowed tile and no dense flag. With STORE_L1,
    ``l1 [M]`` fp32 receives each such row's ``Σ |h|`` over its stored pairs, and 0 for every
    whole-dense row.

    With GUARD the finiteness guard of ``row_lists.flag_rows`` is computed here, from the x row
    the pair loop loads anyway, instead of read from ``dense``: a row with no overflowed tile is
    whole-dense unless ``‖x[t]‖·bound[0] + bound[1] < bound[2]`` (fp32 norm; NaN flags). Each
    row's ``Σ count`` (as read, before any mark) goes to ``rowcnt [M]`` int32, for the call's
    record (``row_lists.dense_list``). With MARK, a row the guard flags gets ``count[t, 0] =
    SLOTS + 1``, as ``flag_rows(mark=True)`` does, so that the backward computes it densely.
    """
    pid = tl.program_id(0)
    lanes, l_ok = row_lanes(0, D, BLOCK_D, PAIRS, EVEN_D)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = column_mask(offs_d, D, EVEN_D)
    tiles = tl.arange(0, NT_P2)
    t_ok = tiles < N_TILES

    for i in range(TOKENS):
        t = pid * TOKENS + i
        if t < M:
            t64 = t.to(tl.int64)
            cnt = tl.load(count_ptr + t64 * N_TILES + tiles, mask=t_ok, other=0)
            n_over = tl.sum((cnt > SLOTS).to(tl.int32), axis=0)
            if GUARD:
                tl.store(rowcnt_ptr + t64, tl.sum(cnt, axis=0))
                sparse_row = n_over == 0
            else:
                sparse_row = (tl.load(dense_ptr + t64) == 0) & (n_over == 0)
            slot0 = t64 * N_TILES * SLOTS  # first slot of this token's TwELL row
            l1_row = tl.full([], 0.0, tl.float32)
            guarded = n_over < 0  # False

            if sparse_row:
                x_ev, x_od = widen(load_row(x_ptr, t64 * stride_xm, lanes, l_ok, PAIRS, "evict_first"), PAIRS)
                if GUARD:
                    sq = tl.sum(join_row(x_ev * x_ev, x_od * x_od, PAIRS), axis=0)
                    guarded = (tl.sqrt_rn(sq) * tl.load(bound_ptr) + tl.load(bound_ptr + 1) < tl.load(bound_ptr + 2)) == 0
                    if MARK:
                        tl.store(count_ptr + t64 * N_TILES, tl.full([], SLOTS + 1, tl.int32), mask=guarded)
                if guarded == 0:
                    acc_ev, acc_od = zero_row(lanes, PAIRS)
                    # The stored pairs in (tile, slot) order (next_pair); the next pair's idx/val are
                    # loaded while this pair's weight rows are gathered.
                    cnt_base = t64 * N_TILES
                    rem, ct, cs, cc = first_pair(count_ptr, cnt_base, tile_set(cnt, tiles, SLOTS, BITS), N_TILES, SLOTS,
                                                 BITS)
                    ok, slot, jp, gp = load_pair(idx_ptr, val_ptr, slot0, ct, cs, N_TILES, SLOTS, "evict_first", OVF,
                                                 PAIRED)
                    while ok:
                        wd = load_row(wdt_ptr, jp * stride_wdt, lanes, l_ok, PAIRS, "")
                        if GATED:
                            wu = load_row(wu_ptr, jp * stride_wu, lanes, l_ok, PAIRS, "")
                            if HAS_BU:
                                bu_j = tl.load(bu_ptr + jp).to(tl.float32)
                        rem, ct, cs, cc = next_pair(count_ptr, cnt_base, rem, ct, cs, cc, N_TILES, SLOTS, BITS)
                        next_ok, next_slot, next_jp, next_gp = load_pair(idx_ptr, val_ptr, slot0, ct, cs, N_TILES, SLOTS,
                                                                         "evict_first", OVF, PAIRED)
                        act = tl.where(gp <= 0.0, 0.0, gp)  # relu that keeps NaN, as torch.relu does
                        if GATED:
                            wu_ev, wu_od = widen(wu, PAIRS)
                            up = tl.sum(join_row(wu_ev * x_ev, wu_od * x_od, PAIRS), axis=0)  # one FFMA chain a thread
                            if HAS_BU:
                                up += bu_j
                            if OVF > 0:  # dense rounds up and h to the input dtype: its overflow points
                                up = tl.where(tl.abs(up) >= OVF, tl.where(up > 0, float("inf"), float("-inf")), up)
                            if STORE_UP:
                                tl.store(up_ptr + slot, up)
                            hv = act * up
                            if OVF > 0:
                                hv = tl.where(tl.abs(hv) >= OVF, tl.where(hv > 0, float("inf"), float("-inf")), hv)
                        else:
                            hv = act
                        if STORE_L1:
                            l1_row += tl.abs(hv)
                        wd_ev, wd_od = widen(wd, PAIRS)
                        acc_ev += hv * wd_ev
                        acc_od += hv * wd_od
                        ok, slot, jp, gp = next_ok, next_slot, next_jp, next_gp

                    acc = join_row(acc_ev, acc_od, PAIRS)
                    if HAS_BD:
                        acc += tl.load(bd_ptr + offs_d, mask=d_ok, other=0.0).to(tl.float32)
                    tl.store(out_ptr + t64 * stride_om + offs_d, acc.to(out_ptr.dtype.element_ty), mask=d_ok,
                             eviction_policy="evict_first")
            if STORE_WHOLE:
                tl.store(whole_ptr + t64, ((sparse_row == 0) | guarded).to(tl.uint8))
            if STORE_L1:
                tl.store(l1_ptr + t64, l1_row)


def guard_rows(x, wg, wu, wd, bg, bu, bd) -> torch.Tensor:
    """bool [M]: the finiteness guard of ``reference.dense_rows_ref`` without its overflow rows.

    Rows with a non-finite x, rows whose gated up product may overflow, and every row when a
    weight or bias is non-finite. Device ops only, no host sync. Rows with an overflowed tile are
    exact anyway (``sparse_ffn`` finds them from the counts and computes them densely).
    """
    rows = ~torch.isfinite(x).all(-1)
    if wg is not None and x.shape[0] > 0:
        rows |= may_overflow(x, wu, bu, x.dtype)
    return rows | ~finite(wg, wu, wd, bg, bu, bd)


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
    dense_scratch_rows: Optional[int] = None,
    row_list: Optional[RowList] = None,
    reuse_tickets: bool = False,
    l1_rows: Optional[torch.Tensor] = None,
    guard_bound: Optional[torch.Tensor] = None,
    record: Optional[CallRecord] = None,
    mark: bool = False,
    check: bool = True,
):
    """The FFN output from its packed gate (gated) or packed up pre-activation (plain).

    Matches ``reference.ffn_forward_ref(x, wg, wu, wd, bg, bu, bd).out`` (fp32 arithmetic, one
    rounding at the output) for the ``packed`` that ``gate_pack`` (or ``reference.gate_pack_ref``)
    makes from ``(x, wg, bg)`` (gated) or ``(x, wu, bu)`` (plain). No host synchronisation.

    Args:
        x: ``[M, D]`` float16/bfloat16/float32.
        packed: TwELL buffer of ``M`` rows and ``H`` columns (``format.TwellPacked``) in ``layout``.
            Paired slots (``format.is_paired``, ``gate_pack``'s default) are read in place with
            one 8-byte load a pair; other layouts are made contiguous first.
        wu: ``[H, D]`` up weight (``nn.Linear`` layout), dtype of x.
        wd: ``[D, H]`` down weight (``nn.Linear`` layout), dtype of x. Transposed inside (see the
            module docstring for the cost).
        bu, bd, bg: optional biases ``[H]``, ``[D]``, ``[H]`` (float16/bfloat16/float32).
        dense_rows: bool ``[M]`` on x's device: rows computed by the dense formula over all H,
            e.g. ``reference.dense_rows_ref``. ``None``: ``guard_rows(...)``, computed here (it
            reads every weight once). Overflowed tiles are exact whether or not they are flagged.
        wg: ``[H, D]`` gate weight for a gated FFN; ``None`` for a plain one.
        bg: optional gate bias (gated only).
        out_dtype: dtype of the output (float16/bfloat16/float32); default x's dtype.
        layout: the TwELL layout ``packed`` was made with.
        return_up: also return ``up_val``, fp32 ``[M, n_tiles, slots]``: the up value of each
            stored pair of the rows that have no overflowed tile and no dense flag, unspecified in
            every other slot (as ``packed.val``: readers go by the counts and the dense rows);
            an empty ``[0]`` tensor for a plain FFN.
        dense_scratch_rows: whole-dense rows computed through the fp32 ``h`` scratch (default: a
            32 MiB budget); rows past it go to the blocked dense kernel (exact, slower when they
            are few). Tests use small values.
        row_list: the whole-dense rows already listed on the device, ``dense_rows`` or-ed with
            the rows that have an overflowed tile (``row_lists.flag_rows(..., flag_overflow=True,
            with_list=True)`` makes both): the kernel then does not flag them again, and the list
            takes no launch of its own. A row left out of it gets no output.
        reuse_tickets: the dense rows' split sums take their tickets from a kept buffer
            (``tickets.zeroed_scratch``) instead of a fresh fill.
        l1_rows: float32 ``[M]`` on x's device that receives, for each row the pair loop
            computes, ``Σ |h|`` over its stored pairs (its share of the L1 term), and 0 for the
            rows computed densely; summed in the loop, so the L1 value costs no pass over the
            TwELL buffers.
        guard_bound: fp32 ``[3]`` bound of the finiteness guard (``weights.weight_prep``'s
            forward bound): the kernel applies the guard of ``row_lists.flag_rows`` itself,
            from the x rows it loads anyway, instead of taking ``dense_rows`` (which must then be
            None, as ``row_list``): one launch and one read of x fewer than ``flag_rows`` first.
        record: with ``guard_bound``, the call's ``CallRecord`` (active entries as packed, and
            the rows computed densely), stored as ``flag_rows`` stores it.
        mark: with ``guard_bound``, each row the guard flags that has no overflowed tile gets
            ``packed.count[t, 0] = slots + 1`` in place (``flag_rows(mark=True)``), so that a
            backward computes it densely. ``packed.count`` must be contiguous.
        check: validate the arguments; False where the caller has (the TwELL ops check theirs
            once a call).

    Returns:
        ``out [M, D]``, or ``(out, up_val)`` with ``return_up``.

    Example::

        packed = gate_pack(x, wg, bg)
        out = sparse_ffn(x, packed, wu, wd, bu, bd, wg=wg, bg=bg)
    """
    # 1. Check shapes, dtypes and devices (``check=False``: the caller has).
    if check:
        _check_args(x, packed, wu, wd, bu, bd, dense_rows, wg, bg, out_dtype, layout, dense_scratch_rows, row_list, l1_rows,
                    guard_bound, record, mark)
    m, d, h = x.shape[0], x.shape[1], wu.shape[0]
    dev = x.device
    gated = wg is not None
    n_tiles, slots = layout.n_tiles(h), layout.slots
    out_dtype = x.dtype if out_dtype is None else out_dtype

    # 2. Allocate the outputs (and Wdᵀ, the only temporary).
    store_up = return_up and gated
    # Only the stored pairs of sparse rows are written and read: no fill (a 46 MB memset and a
    # launch per training step at the 2B shape).
    up_val = torch.empty((m, n_tiles, slots) if store_up else (0,), dtype=torch.float32, device=dev)
    if m == 0 or h == 0:  # nothing to gather: out = bd
        if l1_rows is not None:
            l1_rows.zero_()
        if record is not None:
            record_without_kernel(record, m)
        out = torch.zeros(m, d, dtype=torch.float32, device=dev)
        out = (out if bd is None else out + bd.float()).to(out_dtype)
        return (out, up_val) if return_up else out
    out = torch.empty(m, d, dtype=out_dtype, device=dev)
    guard = guard_bound is not None
    if dense_rows is None and not guard:
        dense_rows = guard_rows(x, wg, wu, wd, bg, bu, bd)
    x, wu = rowmajor(x), rowmajor(wu)
    wg = rowmajor(wg) if gated else wu  # plain: never read
    wdt = transposed(wd)  # [H, D]: column j of Wd as a contiguous row (no copy if wd = wdt.t())
    slot_pairs = is_paired(packed)  # read as 8-byte slots in place; other layouts as two contiguous buffers
    idx, val = (packed.idx, packed.val) if slot_pairs else (packed.idx.contiguous(), packed.val.contiguous())
    count = packed.count.contiguous()
    dummy = val  # stands in for absent biases; never read
    dense_rows = dense_rows.contiguous() if not guard else dummy
    bg_, bu_, bd_ = (dummy if b is None else b for b in (bg, bu, bd))
    weights = (x, wg, bg_, wu, bu_, wdt, bd_)
    strides = (x.stride(0), wg.stride(0), wu.stride(0), wdt.stride(0), out.stride(0))
    flags = dict(GATED=gated, HAS_BG=bg is not None, HAS_BU=bu is not None, HAS_BD=bd is not None)
    nt_p2 = max(2, next_power_of_2(n_tiles))
    ovf = overflow_threshold(x.dtype)

    # 3. Launch: sparse rows, then the whole-dense rows it flags (the kernels write disjoint rows).
    block_d = max(16, next_power_of_2(d))
    whole = torch.empty(m, dtype=torch.bool, device=dev) if row_list is None else dense_rows
    row_counts = torch.empty(m, dtype=torch.int32, device=dev) if guard else None
    launch(_sparse_ffn_kernel, lambda meta: (cdiv(m, meta["TOKENS"]),),
        x, wu, bu_, wdt, bd_, idx, val, count, dense_rows, out, up_val if store_up else dummy,
        whole.view(torch.uint8), dummy if l1_rows is None else l1_rows, guard_bound if guard else dummy,
        row_counts if guard else dummy,
        m, d, h, n_tiles, x.stride(0), wu.stride(0), wdt.stride(0), out.stride(0),
        GATED=gated, HAS_BU=bu is not None, HAS_BD=bd is not None, STORE_UP=store_up, STORE_WHOLE=row_list is None,
        STORE_L1=l1_rows is not None, SLOTS=slots, NT_P2=nt_p2, BLOCK_D=block_d, OVF=ovf, BITS=bit_walk(nt_p2),
        PAIRS=paired(x, wu, wdt), GUARD=guard, MARK=guard and mark, PAIRED=slot_pairs,
    )
    if guard and record is not None:
        listed = dense_list(whole, record=record, row_counts=row_counts, check=check)
    elif row_list is None:
        listed = dense_list(whole)
    else:
        listed = row_list
    if d > 0:
        whole_dense_rows(listed, *weights, out, strides, flags, ovf, dense_scratch_rows, reuse_tickets)
    return (out, up_val) if return_up else out


def _check_args(x, packed, wu, wd, bu, bd, dense_rows, wg, bg, out_dtype, layout, dense_scratch_rows, row_list, l1_rows,
                guard_bound, record, mark) -> None:
    """``sparse_ffn``'s argument checks: errors that name the argument at fault."""
    m, d, h = check_ffn_operands(x, wg, wu, wd, bg, bu, bd)
    dev = x.device
    check_packed(packed, m, h, layout, dev)
    if dense_rows is not None:
        check_tensor("dense_rows", dense_rows, (m,), (torch.bool,), dev)
    if row_list is not None:
        if dense_rows is None:
            raise ValueError("row_list needs the dense_rows it lists")
        check_row_list(row_list, m, dev)
    if l1_rows is not None:
        check_tensor("l1_rows", l1_rows, (m,), (torch.float32,), dev)
        if not l1_rows.is_contiguous():
            raise ValueError("l1_rows must be contiguous")
    if guard_bound is None:
        if record is not None or mark:
            raise ValueError("record and mark need guard_bound (the guard computed in the kernel)")
    else:
        if dense_rows is not None or row_list is not None:
            raise ValueError("guard_bound computes the dense rows: pass no dense_rows or row_list with it")
        check_tensor("guard_bound", guard_bound, (3,), (torch.float32,), dev)
        if record is not None:
            check_record(record, dev)
        if mark and not packed.count.is_contiguous():
            raise ValueError("packed.count must be contiguous to be marked in place")
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if out_dtype not in FLOAT_DTYPES:
        raise TypeError(f"out_dtype must be one of {[str(t) for t in FLOAT_DTYPES]}, got {out_dtype}")
    if dense_scratch_rows is not None and (not isinstance(dense_scratch_rows, int) or dense_scratch_rows < 0):
        raise ValueError(f"dense_scratch_rows must be an int >= 0, got {dense_scratch_rows!r}")
    if not INTERPRET and dev.type != "cuda":
        raise ValueError(f"x must be a CUDA tensor (or set TRITON_INTERPRET=1), got device {dev}")


KERNELS = {"sparse_ffn": _sparse_ffn_kernel}
