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
gate and up recomputed from ``x``, by the kernels below, as in ``reference.ffn_forward_ref``.
Until session 15 a row with 1–4 overflowed tiles recomputed just those tiles inside its own
program, one column at a time: on the H200 (bf16, D=2048, H=5632, M=16384, 0.5% density) 8 rows
with 4 such tiles took the op from 1.26 to 1.70 ms (the program's serial 512 columns outlast the
whole kernel), against 1.25 ms through the whole-dense route; 46 rows with 2 tiles 1.48 against
1.29 ms. With no overflowed row both measured the same.

Kernels:

* ``_sparse_ffn_kernel``: a program owns ``TOKENS`` consecutive tokens (neighbouring tokens share
  neurons in real models, so their weight rows can hit in L1) and handles them one after the
  other, with the x row and the output row in registers. A cursor (``next_pair``: tile, slot,
  the tile's stored count) walks the token's stored pairs in (tile, slot) order, with no
  reduction and no CTA barrier: it jumps to the next tile that stores a pair through a 64-bit set
  of such tiles (``tile_set``, one reduction of the row's counts per token; rows of at most 64
  tiles) and reads that tile's count by a scalar load, which hits in L1; for each pair, one
  gather of the ``Wdᵀ`` row and one of the ``Wu`` row (and its up bias), issued together, one dot
  product, one update of the output row. Session 9 replaced a ``[CH, N_TILES]`` compare-and-count
  over prefix sums (two CTA-wide reductions per chunk): the same speed without biases, 9% faster
  with an up bias (its load now travels with the weight rows), and simpler. Session 17's bit set
  replaced a scalar load of every tile's count, empty ones too (about half the tiles at 0.5%
  density): on the H200 (bf16, D=2048, H=5632, M=16384), 0.634 → 0.618 ms at 0.5% and 0.653 →
  0.610 with up values stored (0.465 → 0.427 at 0.3%), bitwise the same output. Two pairs per
  loop iteration, with one reduction for both up dot products (half the CTA barriers), compiled
  to as many instructions per pair and ran 8–20% slower: not kept.
* the whole-dense rows, from their list (made by the guard's ``dense_rows.flag_rows`` when the
  caller passes ``row_list``, else by ``dense_rows.dense_list`` of the flags the sparse kernel
  writes; no host sync). The first ``r_cap`` list positions (288 at D=2048, H=5632: a 32 MiB
  scratch budget, or 2% of the rows if more; ``dense_rows.scratch_capacity``):
  ``_dense_hidden_kernel`` writes their ``h`` as fp32 ``[16, BH]`` tiles from ``tl.dot`` over D,
  then ``dense_rows.scratch_product`` multiplies by ``Wdᵀ`` with H split over programs. Past
  ``r_cap``: ``_dense_rows_kernel``, one program per (``BM`` list positions, ``BD`` output
  columns), gate and up recomputed for each of the ``D / BD`` column blocks. On the H200 at the
  shape above, one whole-dense row used to cost 1.5 ms (the blocked kernel alone: 4 programs
  looping over all of H); through the scratch, 0.05 ms for 1–14 rows and 0.17 ms for 288.

Bytes, 16-bit weights (``e = 2``), ``a`` stored pairs per token:

* read per token: x row ``D·e``, the packed row (``n_tiles·4`` + ``a·8``), and ``a`` rows of ``Wu``
  and of ``Wdᵀ``: ``2·a·D·e`` (8 KiB per pair at D=2048), mostly from L2. The x row, the pairs and
  the output row are read or written once, so they go through L2 as ``evict_first``, which leaves
  more of it to the weight rows. ``ncu`` on the H200 (session 10): the 46 MB of weights share its
  60 MiB L2 with that streamed data, at a 61% L2 hit rate and 42% of DRAM bandwidth in use; the
  hints took the kernel from 0.578 to 0.566 ms at 0.5% density (0.414 to 0.394 at 0.3%; the same
  at 1%), bitwise equal. The weight rows keep the default policy (``evict_last`` on them measured
  slower);
* written per token: ``D·e_out`` (+ ``n_tiles·slots·4`` with ``return_up``).

The loop loads pair ``k + 1``'s ``idx``/``val`` while pair ``k``'s weight rows are gathered, so
the dependent round trip (pair -> weight row) is paid once per token, not once per pair.

bf16 rows (x, the weight rows, and in the backward dout) are read as int32 pairs of elements and
widened to fp32 by one shift or mask each (``load_row``, ``widen``), where the compiler's
conversion took 1.5 instructions an element: the loop is bound by L2 throughput and instruction
issue together, and 6% fewer instructions made it 6–9% faster (session 18). Making the two weight
rows' loads leave together (volatile loads, which ptxas keeps in order: it otherwise issues the
second row after the dot product) was not faster.

Measured speed (H200, bf16, M=16384, D=2048, H=5632, uniform random neurons), each config alone
(session 9): 0.41 ms at 17 active neurons per token (0.3%), 0.58 ms at 28 (0.5%), 1.0 ms at 56,
1.9 ms at 114; with up values stored, 0.46, 0.62, 1.03 and 1.92. The naive one-token-per-program
kernel of DESIGN.md section 10 (same 8 KiB per pair, from L2 at ~9 TB/s) took 0.26, 0.42, 0.82
and 1.64 ms. Neither loading the next pair's weight rows a pair ahead (more registers: slower at
0.5% and above) nor the cursor walk (no reductions) closed that gap, so it is not the pair walk's
latency. With uniformly random neurons no layout reduces the bytes; tokens per program only help
when neighbouring tokens share neurons.

``Wd`` is ``[D, H]`` (``nn.Linear``); its columns are rows of ``Wdᵀ``, so the launcher makes
``weights.transposed(wd)`` ([H, D], a tiled transpose) on every call: ``2·H·D·e`` bytes of copy
traffic (46 MB at D=2048, H=5632). No copy is made when ``wd`` already is the transposed view of a
contiguous ``[H, D]`` tensor, so a caller that keeps ``Wdᵀ`` (as ``lowering.cuda_impl`` does) can
pass ``wdt.t()``.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import libdevice

from .checks import check_ffn_operands, check_packed, check_row_list, check_tensor
from .dense_rows import (BLOCKED_ROW_PROGRAMS, BR, INTERPRET, CallRecord, RowList, check_record, column_mask,
                         dense_list, dot, dot_split, jit_helper, record_without_kernel, reduce_sum, rowmajor,
                         scratch_capacity, scratch_product, split_count)
from .format import DEFAULT_LAYOUT, TwellLayout, TwellPacked, is_paired
from .launch import cdiv, launch, next_power_of_2
from .reference import OVERFLOW_THRESHOLD, _finite, _may_overflow
from .weights import transposed

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# Scratch path tiles (BH, BK, BD, warps): the backward's, measured there on the H200 (16-row tiles
# waste little on an isolated row). The interpreter needs tl.dot dims >= 16, and small ones are fast.
_SCRATCH_TILES = {2: (64, 64, 128, 4), 4: (64, 64, 64, 4)}
_SCRATCH_TILES_INTERPRET = (32, 32, 32, 4)

# Blocked dense kernel (BM, BH, BK, BD, warps, stages) for list positions past r_cap, by input
# element size. GPU: the largest tiles that compile without spills on sm90 (ptxas -v, D=2048,
# H=5632: 215 registers for bf16, 212 for fp32).
_DENSE_TILES = {2: (32, 64, 64, 512, 8, 3), 4: (32, 64, 64, 256, 8, 3)}
_DENSE_TILES_INTERPRET = (16, 32, 32, 64, 4, 1)


# ---------------------------------------------------------------------------------------------
# Sparse rows: one program per TOKENS tokens
# ---------------------------------------------------------------------------------------------


# The register cap of one 4-warp config (see _sparse_configs, _prune_sparse).
_CAPPED_REGS = 56


def _sparse_configs():
    if INTERPRET:
        return [triton.Config({"TOKENS": 4}, num_warps=4, num_stages=1)]  # few interpreted ops
    # (warps, tokens per program). On the H200 (bf16, D=2048, H=5632, M=16384, uniform neurons,
    # session 9): 2 warps were fastest with up values at 0.5% (0.62 ms), 4 warps without them
    # (0.58 ms) and with an up bias, 1 and 2 warps at 2%; more tokens per program were slower.
    # Session 18: 4 warps capped at 56 registers (ptxas: no spills at D=2048 with pair reads; 9
    # programs an SM instead of 8) ran 3-5% faster than at their 64: 0.542 -> 0.517 ms at 0.5%,
    # 0.963 -> 0.929 at 1%, bitwise the same output.
    shapes = [(2, 1, None), (4, 1, None), (4, 1, _CAPPED_REGS), (1, 1, None)]
    return [triton.Config({"TOKENS": t}, num_warps=w, num_stages=1, maxnreg=r) for w, t, r in shapes]


def _prune_sparse(configs, nargs, **kwargs):
    """Keep configs whose ``BLOCK_D`` weight row fits in ≤ 64 fp32 registers per thread, and the
    register-capped one only for pair reads of rows up to 2048 wide (where it does not spill); for
    a D that no config fits, one config of 16 warps."""
    block_d = kwargs["BLOCK_D"]
    capped_ok = kwargs.get("PAIRS", False) and block_d <= 2048
    keep = [c for c in configs if block_d <= 64 * 32 * c.num_warps and (c.maxnreg is None or capped_ok)]
    if keep:
        return keep
    return [triton.Config({"TOKENS": 1}, num_warps=16, num_stages=1)]


# Rows of at most this many TwELL tiles (H <= 8192 with 128-column tiles) walk their tiles by a
# bit set; longer rows read every tile's count (``next_pair``).
MAX_BIT_TILES = 64


# The pair loops read bf16 rows as int32 pairs (``widen``) where they can; tests turn it off.
PAIR_READS = True


def paired(*rows: torch.Tensor) -> bool:
    """Whether the pair loops read these row-major tensors' rows as int32 pairs (``load_row``):
    bf16, an even row length, even row strides and 4-byte aligned storage."""
    return PAIR_READS and all(t.dtype == torch.bfloat16 and t.shape[-1] % 2 == 0 and t.stride(0) % 2 == 0
                              and t.data_ptr() % 4 == 0 for t in rows)


def bit_walk(nt_p2: int) -> bool:
    """Whether the pair loops walk rows of ``nt_p2`` (a power of two ≥ the tile count) tiles by a
    bit set: the ``BITS`` meta-parameter of ``tile_set`` and ``next_pair``."""
    return nt_p2 <= MAX_BIT_TILES


@jit_helper
def tile_set(cnt, tiles, SLOTS: tl.constexpr, BITS: tl.constexpr):
    """The tiles ``next_pair`` visits, from a row's counts ``cnt`` (int32, lanes ``tiles``): a
    uint64 with bit ``τ`` set for each tile ``τ`` that stores 1..SLOTS pairs when ``BITS``; 0 (and
    unused) otherwise."""
    if BITS:
        bit = tl.full(tiles.shape, 1, tl.uint64) << tiles.to(tl.uint64)
        return reduce_sum(tl.where((cnt > 0) & (cnt <= SLOTS), bit, tl.full(tiles.shape, 0, tl.uint64)), 0)
    else:
        return tl.full([], 0, tl.uint64)


@jit_helper
def first_pair(count_ptr, cnt_base, rem, N_TILES, SLOTS: tl.constexpr, BITS: tl.constexpr):
    """The cursor of ``next_pair`` on a TwELL row's first stored pair (``rem``: its ``tile_set``)."""
    none = tl.full([], -1, tl.int32)
    return next_pair(count_ptr, cnt_base, rem, none, none, tl.full([], 0, tl.int32), N_TILES, SLOTS, BITS)


@jit_helper
def next_pair(count_ptr, cnt_base, rem, tau, s, c, N_TILES, SLOTS: tl.constexpr, BITS: tl.constexpr):
    """The stored pair after slot ``s`` of tile ``tau`` (whose stored count is ``c``) of a TwELL row
    whose counts start at ``count_ptr + cnt_base``: ``(rem, tile, slot, the tile's count)``, tile
    ``N_TILES`` once past the last pair. Tiles with no stored pair, and overflowed ones
    (``count > SLOTS``, computed densely), are skipped.

    ``BITS``: ``rem`` holds the tiles not visited yet (``tile_set``); the next is its lowest set
    bit, and one scalar load (an L1 hit) reads its count. Otherwise the cursor reads the counts of
    the tiles in turn, empty ones too (at 0.5% density about half of them). No reduction or CTA
    barrier either way."""
    s += 1
    if BITS:
        if s >= c:
            if rem == 0:
                tau = tau - tau + N_TILES
            else:
                tau = lowest_bit(rem)
                rem = rem & (rem - 1)
                c = tl.load(count_ptr + cnt_base + tau)
            s = s - s
    else:
        while (s >= c) & (tau < N_TILES):
            tau += 1
            c = tl.load(count_ptr + cnt_base + tau, mask=tau < N_TILES, other=0)
            c = tl.where(c > SLOTS, 0, c)
            s = 0
    return rem, tau, s, c


if INTERPRET:
    def lowest_bit(v):
        """Index (int32) of the lowest set bit of uint64 ``v != 0``: a SWAR count of the bits below it."""
        v = (v ^ (v & (v - 1))) - 1  # the bits below the lowest set bit
        v = v - ((v >> 1) & 0x5555555555555555)
        v = (v & 0x3333333333333333) + ((v >> 2) & 0x3333333333333333)
        v = (v + (v >> 4)) & 0x0F0F0F0F0F0F0F0F
        return ((v * 0x0101010101010101) >> 56).to(tl.int32)
else:
    @triton.jit
    def lowest_bit(v):
        """Index (int32) of the lowest set bit of uint64 ``v != 0`` (``ffs``)."""
        return libdevice.ffs(v.to(tl.int64, bitcast=True)) - 1


@jit_helper
def row_lanes(block, D, BLOCK_D: tl.constexpr, PAIRS: tl.constexpr, EVEN: tl.constexpr):
    """The lanes of columns ``block·BLOCK_D ...`` of a row for ``load_row``, and their mask: one
    lane per column, or per pair of columns with ``PAIRS``."""
    if PAIRS:
        offs = block * (BLOCK_D // 2) + tl.arange(0, BLOCK_D // 2)
        return offs, column_mask(offs, D // 2, EVEN)
    else:
        offs = block * BLOCK_D + tl.arange(0, BLOCK_D)
        return offs, column_mask(offs, D, EVEN)


@jit_helper
def load_row(ptr, base, offs, ok, PAIRS: tl.constexpr, EVICT: tl.constexpr):
    """The row at ``ptr + base`` (elements) on ``row_lanes``, as stored: int32 pairs of bf16 with
    ``PAIRS``, else elements. ``widen`` makes fp32 of it where it is used (so the narrow values, not
    the fp32 ones, wait in registers)."""
    if PAIRS:
        return tl.load((ptr + base).to(tl.pointer_type(tl.int32)) + offs, mask=ok, other=0, eviction_policy=EVICT)
    else:
        return tl.load(ptr + base + offs, mask=ok, other=0.0, eviction_policy=EVICT)


@jit_helper
def widen(row, PAIRS: tl.constexpr):
    """``load_row``'s row in fp32, as ``(even, odd)`` halves.

    ``PAIRS`` (bf16 rows of even length and offset, ``paired``): the pairs' even and odd elements,
    by one shift or one mask each, where a bf16 -> fp32 conversion compiles to 1.5 instructions an
    element on sm90 (``PRMT``, then ``IMAD.U32`` for a pair's high half). On the H200 (D=2048,
    H=5632, M=16384, same process, against element reads): ``sparse_ffn`` 0.634 -> 0.575 ms at
    0.5% density and 1.091 -> 0.991 at 1%, the backward 1.92 -> 1.86 ms, the inference op 1.28 ->
    1.21 ms and a training step 3.86 -> 3.60 ms at 0.5%, bitwise the same output for the same
    config. Otherwise the whole row, and a scalar 0 that ``join_row`` drops (so every use of it
    compiles away)."""
    if PAIRS:
        return (row << 16).to(tl.float32, bitcast=True), (row & -65536).to(tl.float32, bitcast=True)
    else:
        return row.to(tl.float32), 0.0


@jit_helper
def zero_row(offs, PAIRS: tl.constexpr):
    """An fp32 accumulator row of zeros in ``load_row``'s halves."""
    z = tl.full(offs.shape, 0.0, tl.float32)
    if PAIRS:
        return z, z
    else:
        return z, 0.0


@jit_helper
def join_row(even, odd, PAIRS: tl.constexpr):
    """The row (column order, ``BLOCK_D`` lanes) of ``load_row``'s halves, or of products of them:
    the pairs interleaved (in registers: each thread holds both halves of its pairs)."""
    if PAIRS:
        return tl.interleave(even, odd)
    else:
        return even


def overflow_threshold(dtype: torch.dtype) -> float:
    """The ``OVF`` constexpr of the kernels' overflow tests (``overflow_up``, and the up and h tests
    of the pair loops) for inputs of ``dtype``: ``reference.OVERFLOW_THRESHOLD``, or 0 for fp32
    inputs, whose fp32 arithmetic overflows at that point by itself."""
    return 0.0 if dtype == torch.float32 else float(OVERFLOW_THRESHOLD[dtype])


@jit_helper
def overflow_up(v, OVF: tl.constexpr):
    """A stored pre-activation as the dense path sees it: +Inf where rounding fp32 ``v`` to the
    input dtype would overflow upwards (``reference.overflow_like``). ``gate_pack`` stores ``pre``
    as accumulated; the entries it stores are active (positive or NaN), so the negative side, whose
    -Inf would be inactive like the value it replaces, needs no test."""
    if OVF > 0:
        v = tl.where(v >= OVF, float("inf"), v)
    return v


@jit_helper
def load_pair(idx_ptr, val_ptr, slot0, tau, s, N_TILES, SLOTS: tl.constexpr, EVICT: tl.constexpr,
              OVF: tl.constexpr, PAIRED: tl.constexpr = False):
    """``(ok, slot, j, value)`` of the cursor's pair (tile ``tau``, slot ``s`` of the TwELL row
    starting at slot ``slot0``): its neuron (int64) and stored value, with the input dtype's
    overflow (``overflow_up``); not ``ok`` past the last. ``EVICT``: the loads' L2 eviction policy:
    ``"evict_first"`` where nothing reads them again, or ``""`` (the default policy). ``PAIRED``
    (``format.is_paired``): the slot is one 8-byte load at ``idx_ptr``, column in its low half.
    On the H200 (session 30) that made ``sparse_ffn`` 0.017-0.022 ms faster at 0.5% density and
    0.022-0.043 at 1% than two 4-byte loads from two buffers."""
    ok = tau < N_TILES
    slot = slot0 + (tau * SLOTS + s).to(tl.int64)
    if PAIRED:
        pair = tl.load(idx_ptr.to(tl.pointer_type(tl.int64)) + slot, mask=ok, other=0, eviction_policy=EVICT)
        j = pair & 0xFFFFFFFF
        v = (pair >> 32).to(tl.int32).to(tl.float32, bitcast=True)
    else:
        j = tl.load(idx_ptr + slot, mask=ok, other=0, eviction_policy=EVICT).to(tl.int64)
        v = tl.load(val_ptr + slot, mask=ok, other=0.0, eviction_policy=EVICT)
    return ok, slot, j, overflow_up(v, OVF)


# STORE_UP is in the key: training (which stores up values) and inference tune separately. With
# one shared entry, training ran with the config inference picked first: 1.15 ms per call in an H200
# profile, against 0.79 ms with its own pick, (1, 4, 1), at 0.5% density.
# STORE_L1 is not: its one sum per pair leaves the loop's best config as it is.
@triton.autotune(configs=_sparse_configs(), key=["D", "H", "GATED", "STORE_UP", "PAIRS"],
                 prune_configs_by={"early_config_prune": _prune_sparse})
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

    With GUARD the finiteness guard of ``dense_rows.flag_rows`` is computed here, from the x row
    the pair loop loads anyway, instead of read from ``dense``: a row with no overflowed tile is
    whole-dense unless ``‖x[t]‖·bound[0] + bound[1] < bound[2]`` (fp32 norm; NaN flags). Each
    row's ``Σ count`` (as read, before any mark) goes to ``rowcnt [M]`` int32, for the call's
    record (``dense_rows.dense_list``). With MARK, a row the guard flags gets ``count[t, 0] =
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


# ---------------------------------------------------------------------------------------------
# Dense rows: blocked dense FFN over all H for the flagged rows
# ---------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------
# Host launcher
# ---------------------------------------------------------------------------------------------


def guard_rows(x, wg, wu, wd, bg, bu, bd) -> torch.Tensor:
    """bool [M]: the finiteness guard of ``reference.dense_rows_ref`` without its overflow rows.

    Rows with a non-finite x, rows whose gated up product may overflow, and every row when a
    weight or bias is non-finite. Device ops only, no host sync. Rows with an overflowed tile are
    exact anyway (``sparse_ffn`` finds them from the counts and computes them densely).
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
    dense_scratch_rows: Optional[int] = None,
    row_list: Optional[RowList] = None,
    reuse_tickets: bool = False,
    l1_rows: Optional[torch.Tensor] = None,
    guard_bound: Optional[torch.Tensor] = None,
    record: Optional[CallRecord] = None,
    mark: bool = False,
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
            the rows that have an overflowed tile (``dense_rows.flag_rows(..., flag_overflow=True,
            with_list=True)`` makes both): the kernel then does not flag them again, and the list
            takes no launch of its own. A row left out of it gets no output.
        reuse_tickets: the dense rows' split sums take their tickets from a kept buffer
            (``dense_rows.zeroed_scratch``) instead of a fresh fill.
        l1_rows: float32 ``[M]`` on x's device that receives, for each row the pair loop
            computes, ``Σ |h|`` over its stored pairs (its share of the L1 term), and 0 for the
            rows computed densely; summed in the loop, so the L1 value costs no pass over the
            TwELL buffers.
        guard_bound: fp32 ``[3]`` bound of the finiteness guard (``weights.weight_prep``'s
            forward bound): the kernel applies the guard of ``dense_rows.flag_rows`` itself,
            from the x rows it loads anyway, instead of taking ``dense_rows`` (which must then be
            None, as ``row_list``): one launch and one read of x fewer than ``flag_rows`` first.
        record: with ``guard_bound``, the call's ``CallRecord`` (active entries as packed, and
            the rows computed densely), stored as ``flag_rows`` stores it.
        mark: with ``guard_bound``, each row the guard flags that has no overflowed tile gets
            ``packed.count[t, 0] = slots + 1`` in place (``flag_rows(mark=True)``), so that a
            backward computes it densely. ``packed.count`` must be contiguous.

    Returns:
        ``out [M, D]``, or ``(out, up_val)`` with ``return_up``.

    Example::

        packed = gate_pack(x, wg, bg)
        out = sparse_ffn(x, packed, wu, wd, bu, bd, wg=wg, bg=bg)
    """
    # 1. Check shapes, dtypes and devices.
    m, d, h = check_ffn_operands(x, wg, wu, wd, bg, bu, bd)
    dev = x.device
    gated = wg is not None
    check_packed(packed, m, h, layout, dev)
    n_tiles, slots = layout.n_tiles(h), layout.slots
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
    if out_dtype not in _DTYPES:
        raise TypeError(f"out_dtype must be one of {[str(t) for t in _DTYPES]}, got {out_dtype}")
    if dense_scratch_rows is not None and (not isinstance(dense_scratch_rows, int) or dense_scratch_rows < 0):
        raise ValueError(f"dense_scratch_rows must be an int >= 0, got {dense_scratch_rows!r}")
    if not INTERPRET and dev.type != "cuda":
        raise ValueError(f"x must be a CUDA tensor (or set TRITON_INTERPRET=1), got device {dev}")

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
        listed = dense_list(whole, record=record, row_counts=row_counts)
    elif row_list is None:
        listed = dense_list(whole)
    else:
        listed = row_list
    if d > 0:
        _launch_whole_dense(listed, *weights, out, strides, flags, ovf, dense_scratch_rows, reuse_tickets)
    return (out, up_val) if return_up else out


def _launch_whole_dense(listed, x, wg, bg, wu, bu, wdt, bd, out, strides, flags, ovf, scratch_rows,
                        reuse_tickets: bool) -> None:
    """``out`` of the listed rows (``RowList``, made on the device: no host sync).

    The first ``r_cap`` list positions: ``h`` into an fp32 scratch (one ``[16, BH]`` tile per
    program), then ``dense_rows.scratch_product`` (H split over programs). Positions past
    ``r_cap``: the blocked kernel, which recomputes gate and up per output column block.
    """
    m, d = out.shape
    h = wu.shape[0]
    rows, n_dense = listed
    native = x.dtype != torch.float32 and not INTERPRET
    split = x.element_size() == 2  # h is already clipped to the input dtype's overflow points
    bh, bk, bd_blk, warps = _SCRATCH_TILES_INTERPRET if INTERPRET else _SCRATCH_TILES[x.element_size()]
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
        bm, bh, bk, bd_blk, warps, stages = _DENSE_TILES_INTERPRET if INTERPRET else _DENSE_TILES[x.element_size()]
        bd_blk = min(bd_blk, max(16, next_power_of_2(d)))
        launch(_dense_rows_kernel, (min(cdiv(m - r_cap, bm), BLOCKED_ROW_PROGRAMS), cdiv(d, bd_blk)),
            *x_args, wdt, bd, rows, n_dense, out, d, h, r_cap, *strides,
            **flags, NATIVE=native, SPLIT=split, OVF=ovf,
            BM=bm, BH=bh, BK=bk, BD=bd_blk, num_warps=warps, num_stages=stages,
        )
