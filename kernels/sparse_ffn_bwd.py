"""TwELL training backward: every product restricted to the stored (token, neuron) pairs.

Math (``reference.ffn_backward_ref``). For every stored pair ``(t, j)`` of a row that is not dense,
with ``g`` the packed pre-activation (gate for a gated FFN, up for a plain one) and ``u`` the up
value the forward kept (``up_val``):

* ``h = relu(g) · u`` (gated) or ``relu(g)`` (plain);
* ``dh = dout_t · Wd[:, j] + (l1_scale / M) · sign(h)`` (a sampled dense-dense product plus the L1
  gradient of DESIGN.md section 4; ``sign(NaN) = 0`` as in ``torch.sign``);
* gated: ``dgate = 0 if g <= 0 else dh · u`` (NaN passes) and ``dup = dh · relu(g)``;
  plain: ``dup = 0 if g <= 0 else dh``;
* ``dx_t += dgate · Wg_j + dup · Wu_j``, ``dWg_j += dgate · x_t``, ``dWu_j += dup · x_t``,
  ``dWd[:, j] += h · dout_t``, ``dbg_j += dgate``, ``dbu_j += dup``; ``dbd = Σ_t dout_t``.

Rows flagged in ``dense_rows`` (overflowed tiles, the finiteness guard) use the same formulas over
all H, with the gate and up values recomputed from ``x``. Arithmetic is fp32; each output is rounded
once, to its input's dtype. Nothing synchronises the host, every buffer has a capacity fixed by the
shapes, and every output element has exactly one writer, so results are deterministic and the
whole backward can be captured in a CUDA graph.

Kernels, in launch order:

1. ``_rank_kernel`` (twice): the neuron-major ("transposed") list of the stored pairs, built on the
   device as a stable counting sort by neuron. A program owns ``TB`` (64) tokens × one TwELL
   tile. Pass 1 adds each pair to its (neuron, block)'s count and sets its token's bit in that
   (neuron, block)'s 64-bit word, by integer atomics (exact in any order). Between the passes one
   ``torch.cumsum`` over the ``[H, M / TB]`` counts gives every (neuron, token block) its start;
   pass 2 places each pair there plus its rank, the popcount of its word's bits below its token's,
   so the list order is fixed. Until session 20 pass 2 ranked through a ``[TB, tile_n]`` bitmap and
   its prefix sums down the tokens, work of order ``M · H`` whatever the density (147 registers):
   on the H200 at 0.5% density both passes took 0.30 ms, now 0.06 (``neuron_major`` 0.34 →
   0.10–0.16 ms, the same lists). The list holds slot numbers ``(t · n_tiles + tile) · slots +
   s``; its capacity ``M · n_tiles · slots`` is every slot, so it cannot overflow; pairs of a neuron
   are in token order.
2. ``_tokens_dh_kernel`` then ``_tokens_dx_kernel``: token-major. A program owns ``TOKENS``
   sparse rows, one after the other, and walks each row's stored pairs one at a time with
   ``sparse_ffn.next_pair``'s cursor (a bit set of the tiles that store pairs), loading the next
   pair while this pair's rows arrive. The first kernel keeps the ``dout`` row in registers,
   gathers one ``Wdᵀ`` row per pair and writes ``dh`` per slot; the second gathers the ``Wg`` and
   ``Wu`` rows' columns of one block of at most 1024 (``_DX_BLOCK_MAX``), with the ``dx``
   accumulator of that block in registers, and its programs take the column blocks in turn. Until
   session 24 one kernel did both, gathering all three matrices (69 MB at the benchmark shape,
   more than the L2 keeps: 94% of L2 throughput, 43% hits under ncu in session 10). Split, each
   kernel gathers 23 MB at a time, and the ``dh`` kernel runs at one warp a token: on the H200
   (M=16384, D=2048, H=5632, same process) 0.830 → 0.250 + 0.432 ms at 0.5% density, 1.560 →
   0.454 + 0.831 at 1% and 0.534 → 0.169 + 0.270 at 0.3%, a forced training step's kernels 2.78 →
   2.58 ms at 0.5%; with skewed neurons, whose hot rows stay in L2 anyway, 0.662 → 0.684 (0.5%) and
   1.269 → 1.284 (1%). Session 6's fused kernel with the prefetched pairs took the backward from
   2.70 to 2.48 ms at 0.5% and from 4.76 to 4.35 ms at 1%; the cursor, which replaced a
   ``[CH, n_tiles]`` search over prefix sums, from 2.38–2.40 to 2.33 ms.
3. ``_dense_coef_dx_kernel``, two independent jobs in one launch (one launch's host time fewer,
   session 20): ``dgate``, ``dup`` and ``h`` of the first ``r_cap`` dense rows over all H, as
   ``[16, BH]`` tiles from ``tl.dot`` over D, into an fp32 scratch ``[3, r_cap, H]`` (``r_cap``
   from a 32 MiB budget, 496 rows at H = 5632, or 2% of the rows if more:
   ``dense_rows.scratch_capacity``); and ``dx`` of the list positions past ``r_cap``,
   coefficients recomputed over all H (exact, slow).
4. ``dx`` of the first ``r_cap`` list positions: ``dense_rows.scratch_product`` (H split over
   programs, bf16 coefficients as ``hi + lo`` pairs on tensor cores). Before the
   split, one dense row cost 4.7 ms at the benchmark shape on the H200; with it, 0.05 ms
   (backward 3.04 ms with one dense row, 3.05 with 14, 2.95 with none).
   With ``dense_wgrad_gemm``, ``_dense_wgrad_kernel`` then sums the scratch rows' share of the
   weight gradients as GEMMs (``[BJ, 16] @ [16, BD]`` tiles, bf16 coefficients as ``hi + lo``) into
   an fp32 ``[planes, H, D]`` buffer that ``_wgrad_kernel`` starts from: on the H200 (M=16384,
   0.5% density) a training step with 256 dense rows took 4.66 ms instead of 6.94 (46 rows: 4.24
   against 4.52; none: the same), for 112 MB more at the step's peak.
5. ``_wgrad_kernel``: neuron-major. A program owns neuron ``j`` × a ``BD`` slice of D, loops over
   ``j``'s pairs in token order (``dgate``/``dup``/``h`` recomputed from ``val``, ``up_val`` and the
   stored ``dh``) gathering ``x`` and ``dout`` rows, then over the dense rows (scratch column, or
   recomputed past ``r_cap``; with the GEMM buffer, that buffer and the rows past ``r_cap``), and
   writes ``dWg_j``, ``dWu_j``, ``dWdᵀ_j`` and the bias grads. Launched heaviest neuron first (a
   device-side argsort of the pair counts), each neuron's D slices together, and the
   ``_HOT_NEURONS`` hottest split in ``_HOT_SEGMENTS`` runs of pairs whose fp32 partials the last
   to finish sums in order (a ticket per neuron and slice; deterministic), so that a skewed layer's
   hottest neurons do not end the kernel. On the H200 (session 25, M=16384, skewed neurons) the
   split took the kernel from 2.880 to 1.497 ms at 1% density, and launching a neuron's slices
   together (before: one slice of every neuron, then the next) to 1.286; uniform neurons the same.
   Until session 16 the dense-row loop's 16-row chunks held every program at 211–254 registers;
   at 113–123 the autotuner picks 512–1024-wide slices with 1–2 warps (the backward at 0.5%
   density on the H200: 2.36 → 2.00 ms).

Computing ``dh`` in ``_wgrad_kernel`` instead, from the ``dout`` rows it gathers anyway and one
``Wd`` column per neuron (programs over all of D), spared the then fused tokens kernel its ``Wdᵀ``
row per pair (12 → 8 KiB), but was not faster on the H200 (session 18: the backward 1.97 against 1.95 ms
at 0.5% density, 3.14 against 3.17 at 1%, and 3.20 against 2.54 with skewed neurons, whose
hottest neurons' whole-row programs, at 128 registers, ended the kernel): not kept.

The tokens kernels and ``_wgrad_kernel`` read bf16 rows as int32 pairs (``sparse_ffn.load_row``
and ``widen``: one shift or mask an element instead of a 1.5-instruction conversion; the fused
tokens kernel then dropped from 72 to 64 registers at 4 warps): the backward at 0.5% density on the H200
went from 1.92 to 1.86 ms, at 1% from 3.22 to 3.10, with skewed neurons from 2.61 to 2.40
(session 18, same process).

Bytes, 16-bit tensors (``e = 2``), ``P`` stored pairs (``a`` per token):

* tokens kernels: per pair 3 weight rows, ``3·D·e`` (12 KiB at D = 2048), 23 MB of them at a time
  at the benchmark shape, plus ~28 B of TwELL and ``dh``; per token ``2·D·e`` (``dout`` in,
  ``dx`` out) and ``n_tiles·4``.
* ``_wgrad_kernel``: per pair 2 rows, ``2·D·e`` (8 KiB), from L2 slabs; writes ``3·H·D·e``.
* lists: ``2·M·n_tiles·4 + 3·P·4`` plus ``H·M/TB·16`` for the counts, the token words and the
  counts' prefix sum.
* ``Wdᵀ``: the launcher copies ``weights.transposed(wd)`` (``2·H·D·e``) unless ``wd`` already is a
  transposed view of a contiguous ``[H, D]`` tensor.

At M = 16384, D = 2048, H = 5632, 0.5 % density (a = 28, P = 0.46 M) that is
5.7 GB + 3.8 GB of gathered rows (≈ 1.05 ms at the ~9 TB/s L2 rate measured for the forward
gather, DESIGN.md section 10), against 2.27 TFLOP (≈ 3.4 ms) for the six dense backward GEMMs.

Scratch: ``dh`` and the pair list (``M·n_tiles·slots·4`` B each: 46 MB at the shape above), the
dense-row coefficients (≤ 32 MiB), ``Wdᵀ``.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .checks import check_ffn_operands, check_packed, check_row_list, check_tensor
from .dense_rows import (BLOCKED_ROW_PROGRAMS, BR, INTERPRET, RowList, column_mask, dense_list, dot, dot_split,
                         jit_helper, last_to_arrive, rowmajor, scratch_capacity, scratch_product, zeroed_scratch)
from .dense_rows import reduce_sum as _sum
from .format import DEFAULT_LAYOUT, TwellLayout, TwellPacked
from .launch import cdiv, launch, next_power_of_2
from .reference import Grads, _may_overflow, backward_dense_rows_ref
from .sparse_ffn import (bit_walk, first_pair, join_row, load_pair, load_row, next_pair, overflow_threshold, overflow_up,
                         paired, row_lanes, tile_set, widen, zero_row)
from .weights import transposed

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# Tokens per program of the counting sort (at most 64: one bit each in an int64): the counts, their
# prefix sum and the token bits are [H, M / TB].
_RANK_TB = 64
# Neurons per program of _order_kernel's sort (a power of 2). One program sorting all 5632 neurons
# (4096 each in two) took 105 us on the H200 (session 19): a bitonic sort is serial in its stages.
_ORDER_BLOCK = 1024


# ---------------------------------------------------------------------------------------------
# Shared element-wise pieces (the reference's formulas, in fp32)
# ---------------------------------------------------------------------------------------------


@jit_helper
def _hidden(pre, up, GATED: tl.constexpr):
    """``(relu(pre), h)``; relu keeps NaN, as ``torch.relu`` does."""
    act = tl.where(pre <= 0.0, 0.0, pre)
    if GATED:
        hv = act * up
    else:
        hv = act
    return act, hv


@jit_helper
def _sign(v):
    """``torch.sign``: -1, 0 or 1, and 0 for NaN."""
    return tl.where(v > 0.0, 1.0, tl.where(v < 0.0, -1.0, 0.0))


@jit_helper
def _pair_grads(pre, up, act, dh, GATED: tl.constexpr):
    """``(dgate, dup)`` from ``dh``; plain FFNs return ``dup`` twice."""
    if GATED:
        d_gate = tl.where(pre <= 0.0, 0.0, dh * up)
        d_up = dh * act
    else:
        d_up = tl.where(pre <= 0.0, 0.0, dh)
        d_gate = d_up
    return d_gate, d_up


# ---------------------------------------------------------------------------------------------
# 1. Neuron-major pair lists: a stable counting sort by neuron, on the device
# ---------------------------------------------------------------------------------------------


@jit_helper
def _popcount64(v):
    """Set bits of uint64 ``v`` as int32 (a SWAR count: the interpreter has no ``popc``, and on the
    GPU it compiles to a handful of integer instructions)."""
    v = v - ((v >> 1) & 0x5555555555555555)
    v = (v & 0x3333333333333333) + ((v >> 2) & 0x3333333333333333)
    v = (v + (v >> 4)) & 0x0F0F0F0F0F0F0F0F
    return ((v * 0x0101010101010101) >> 56).to(tl.int32)


@triton.jit
def _rank_kernel(
    # pointers
    idx_ptr, count_ptr, dense_ptr, counts_ptr, tokens_ptr, incl_ptr, list_ptr,
    # dimensions
    M, N_TILES, NB,
    # meta-parameters
    PLACE: tl.constexpr, SLOTS: tl.constexpr, SLOTS_P2: tl.constexpr, TILE_N: tl.constexpr, TB: tl.constexpr,
):
    """Count (``PLACE`` false) or place (``PLACE`` true) the stored pairs of ``TB`` (≤ 64) tokens × tile.

    idx ``[M, N_TILES, SLOTS]``, count ``[M, N_TILES]``, dense uint8 ``[M]``. A stored pair is slot
    ``s < min(count, SLOTS)`` of a row with ``dense == 0``. Counting adds, for each pair of neuron
    ``n`` and token ``b·TB + i``, 1 to ``counts[n, b]`` (int32 ``[N_TILES·TILE_N, NB]``) and bit
    ``i`` to ``tokens[n, b]`` (int64, same shape), both zeroed by the caller (integer atomics, and
    a token holds a neuron at most once: exact in any order). Placing reads ``tokens`` and ``incl``,
    the counts' inclusive prefix sum in neuron-major order, so that neuron ``n``'s pairs of block
    ``b`` begin at ``incl - popcount(tokens)`` in the list, and stores each pair's slot number
    there plus its rank: the bits of ``tokens`` below its own (the block's earlier tokens).
    """
    b = tl.program_id(0)
    tau = tl.program_id(1)
    rows = b * TB + tl.arange(0, TB)
    r_ok = rows < M
    rows64 = rows.to(tl.int64)
    cnt = tl.load(count_ptr + rows64 * N_TILES + tau, mask=r_ok, other=0)
    dense = tl.load(dense_ptr + rows64, mask=r_ok, other=1)
    stored = tl.where(r_ok & (dense == 0), tl.minimum(cnt, SLOTS), 0)
    s = tl.arange(0, SLOTS_P2)
    valid = s[None, :] < stored[:, None]  # [TB, SLOTS_P2]
    slot = (rows64[:, None] * N_TILES + tau) * SLOTS + s[None, :]
    col = tl.load(idx_ptr + slot, mask=valid, other=0)
    loc = tl.minimum(tl.maximum(col - tau * TILE_N, 0), TILE_N - 1)  # in the tile (clamped for safety)
    at = (tau * TILE_N + loc).to(tl.int64) * NB + b
    bit = tl.full((TB, 1), 1, tl.uint64) << tl.arange(0, TB).to(tl.uint64)[:, None]  # the token's bit
    if not PLACE:
        tl.atomic_add(counts_ptr + at, tl.full((TB, SLOTS_P2), 1, tl.int32), mask=valid, sem="relaxed")
        tl.atomic_or(tokens_ptr + at, tl.broadcast_to(bit.to(tl.int64, bitcast=True), (TB, SLOTS_P2)), mask=valid,
                     sem="relaxed")
    else:
        tokens = tl.load(tokens_ptr + at, mask=valid, other=0).to(tl.uint64, bitcast=True)
        start = tl.load(incl_ptr + at, mask=valid, other=0) - _popcount64(tokens)
        tl.store(list_ptr + start + _popcount64(tokens & (bit - 1)), slot.to(list_ptr.dtype.element_ty), mask=valid)


@triton.jit
def _order_kernel(incl_ptr, ptr_ptr, order_ptr, H, NB, N_CHUNKS, BLOCK: tl.constexpr):
    """``ptr`` (int64 ``[H + 1]``, neuron ``j``'s pairs are ``list[ptr[j]:ptr[j + 1]]``) and
    ``order`` (int32 ``[H]``, heaviest neurons first) from ``incl`` (``_rank_kernel``).

    Program ``c`` takes neurons ``c, c + N_CHUNKS, ...``, sorts them by decreasing pair count
    (``tl.sort`` of ``count << 32 | j``) and writes its rank ``r`` neuron to ``order[r·N_CHUNKS +
    c]``: exactly descending with one chunk, else nearly (the chunks are strided samples of all
    neurons), which is all the weight-gradient kernel's schedule needs.
    """
    c = tl.program_id(0)
    r = tl.arange(0, BLOCK)
    j = c + r * N_CHUNKS
    ok = j < H
    j64 = j.to(tl.int64)
    end = tl.load(incl_ptr + (j64 + 1) * NB - 1, mask=ok, other=0).to(tl.int64)
    begin = tl.load(incl_ptr + j64 * NB - 1, mask=ok & (j > 0), other=0).to(tl.int64)
    tl.store(ptr_ptr + j64 + 1, end, mask=ok)
    tl.store(ptr_ptr + r, tl.full([BLOCK], 0, tl.int64), mask=(r == 0) & (c == 0))
    pairs = tl.minimum(end - begin, 0x7FFFFFFF)  # keys stay non-negative, above the -1 of absent neurons
    key = tl.sort(tl.where(ok, (pairs << 32) | j64, -1), descending=True)
    size = (H - c + N_CHUNKS - 1) // N_CHUNKS
    tl.store(order_ptr + r * N_CHUNKS + c, (key & 0xFFFFFFFF).to(tl.int32), mask=r < size)


def neuron_major(packed: TwellPacked, dense_rows: torch.Tensor, hidden: int, *, layout: TwellLayout = DEFAULT_LAYOUT):
    """The stored pairs of the sparse rows, grouped by neuron: ``(ptr, slots, order)``.

    Neuron ``j``'s pairs are ``slots[ptr[j]:ptr[j + 1]]``, as slot numbers
    ``(t · n_tiles + tile) · layout.slots + s`` (so ``t = slot // (n_tiles · slots)``), in
    increasing token order: the same order as a stable argsort of the slots by neuron. ``ptr`` is
    int64 ``[hidden + 1]``; ``slots`` has the capacity of every slot, ``M · n_tiles · slots``
    (int32, or int64 when that reaches 2³¹), and holds ``ptr[hidden]`` valid entries. ``order``
    (int32 ``[hidden]``) lists the neurons by decreasing pair count (``_order_kernel``; nearly so
    above ``_ORDER_BLOCK`` neurons). A memset, the two counting-sort passes, a scan and
    ``_order_kernel``; no host synchronisation.
    """
    idx, count = packed.idx, packed.count
    m, n_tiles = count.shape
    slots, tile_n = layout.slots, layout.tile_n
    dev = idx.device
    h_pad = n_tiles * tile_n
    nb = cdiv(m, _RANK_TB)
    cap = m * n_tiles * slots
    slot_dtype = torch.int32 if cap < 2**31 else torch.int64
    lists = torch.empty(max(cap, 1), dtype=slot_dtype, device=dev)
    if m == 0 or n_tiles == 0:
        return (torch.zeros(hidden + 1, dtype=torch.int64, device=dev), lists,
                torch.arange(hidden, dtype=torch.int32, device=dev))
    idx, count = idx.contiguous(), count.contiguous()
    dense_u8 = dense_rows.contiguous().view(torch.uint8)
    # The counting pass adds into both, the int64 token bits and the int32 counts: one memset.
    zeroed = torch.zeros(3 * h_pad * nb, dtype=torch.int32, device=dev)
    tokens, counts = zeroed[:2 * h_pad * nb].view(torch.int64).view(h_pad, nb), zeroed[2 * h_pad * nb:].view(h_pad, nb)
    meta = dict(SLOTS=slots, SLOTS_P2=next_power_of_2(slots), TILE_N=tile_n, TB=_RANK_TB, num_warps=4)
    grid = (nb, n_tiles)
    launch(_rank_kernel, grid, idx, count, dense_u8, counts, tokens, counts, lists, m, n_tiles, nb, PLACE=False,
           **meta)
    # Neuron-major then block ([j0 b0, j0 b1, ..., j1 b0, ...]), in the lists' index dtype: its
    # totals are at most cap (an int64 scan of int32 counts first copies them).
    incl = torch.cumsum(counts.view(-1), 0, dtype=slot_dtype)
    launch(_rank_kernel, grid, idx, count, dense_u8, counts, tokens, incl, lists, m, n_tiles, nb, PLACE=True, **meta)
    # One launch instead of torch's argsort of the counts (on the H200's host ~0.2 ms of a training
    # step's host time in ten launches and memsets, docs/benchmarks.md, session 19).
    ptr = torch.empty(hidden + 1, dtype=torch.int64, device=dev)
    order = torch.empty(hidden, dtype=torch.int32, device=dev)
    n_chunks = cdiv(hidden, _ORDER_BLOCK)
    block = max(2, next_power_of_2(cdiv(hidden, n_chunks)))
    launch(_order_kernel, (n_chunks,), incl, ptr, order, hidden, nb, n_chunks, BLOCK=block,
           num_warps=max(1, min(4, block // 256)))
    return ptr, lists, order


# ---------------------------------------------------------------------------------------------
# 2. Sparse rows, token-major: dh per pair and dx
# ---------------------------------------------------------------------------------------------


# dx's column block: at most this many columns of D per program (the programs of one block run
# before those of the next). On the H200 at D=2048, 0.3-1% density (session 24), dx took 0-7% less
# time in blocks of 1024 than over all of D with uniform neurons (the same with skewed ones), and
# 4-19% less than in blocks of 512.
_DX_BLOCK_MAX = 1024


def _token_configs():
    if INTERPRET:
        return [triton.Config({"TOKENS": 2}, num_warps=4, num_stages=1)]
    # (warps, tokens per program). On the H200 (bf16, D=2048, H=5632, M=16384, 0.3-1% density) the
    # autotuner picks 1 warp for dh and 2 for dx's 1024-column blocks (session 24).
    shapes = [(1, 1), (2, 1), (4, 1), (2, 2)]
    return [triton.Config({"TOKENS": t}, num_warps=w, num_stages=1) for w, t in shapes]


def _prune_rows(rows: int):
    """An ``early_config_prune`` keeping configs whose ``rows`` fp32 rows of ``BLOCK_D`` (the row
    in registers and the one or two gathered per pair) fit ≤ 128 registers per thread."""
    def prune(configs, nargs, **kwargs):
        keep = [c for c in configs if rows * kwargs["BLOCK_D"] <= 128 * 32 * c.num_warps]
        return keep or [triton.Config({"TOKENS": 1}, num_warps=16, num_stages=1)]
    return prune


@jit_helper
def _row_cursor(count_ptr, t64, N_TILES, SLOTS: tl.constexpr, NT_P2: tl.constexpr, BITS: tl.constexpr):
    """``next_pair``'s cursor on the first stored pair of sparse row ``t64``, and its counts' base.
    A sparse row has no overflowed tile, so its stored pairs are all its pairs."""
    cnt_base = t64 * N_TILES
    tiles = tl.arange(0, NT_P2)
    rem = tl.full([], 0, tl.uint64)
    if BITS:
        rem = tile_set(tl.load(count_ptr + cnt_base + tiles, mask=tiles < N_TILES, other=0), tiles, SLOTS, BITS)
    rem, ct, cs, cc = first_pair(count_ptr, cnt_base, rem, N_TILES, SLOTS, BITS)
    return cnt_base, rem, ct, cs, cc


@triton.autotune(configs=_token_configs(), key=["D", "H", "GATED"], prune_configs_by={"early_config_prune": _prune_rows(2)})
@triton.heuristics({"EVEN_D": lambda a: a["D"] % a["BLOCK_D"] == 0})
@triton.jit
def _tokens_dh_kernel(
    # pointers
    dout_ptr, wdt_ptr, idx_ptr, val_ptr, up_ptr, count_ptr, dense_ptr, scale_ptr, dh_ptr,
    # dimensions and row strides (elements; every last dimension is contiguous)
    M, D, H, N_TILES, stride_gm, stride_wdt,
    # meta-parameters
    GATED: tl.constexpr, SLOTS: tl.constexpr, BLOCK_D: tl.constexpr, TOKENS: tl.constexpr,
    NT_P2: tl.constexpr, BITS: tl.constexpr, PAIRS: tl.constexpr, EVEN_D: tl.constexpr, OVF: tl.constexpr,
):
    """``dh`` (fp32, TwELL shape, with the L1 term) at every stored slot of each sparse row ``t``
    (``dense[t] == 0``): ``dout[t] · Wdᵀ[j]`` over all of D.

    dout ``[M, D]``; wdt (= Wdᵀ) ``[H, D]``; TwELL idx/val/up ``[M, N_TILES, SLOTS]`` (up unused
    when plain), count ``[M, N_TILES]``; dense uint8 ``[M]``; scale fp32 ``[]`` = ``l1_scale / M``.
    """
    pid = tl.program_id(0)
    lanes, l_ok = row_lanes(0, D, BLOCK_D, PAIRS, EVEN_D)
    scale = tl.load(scale_ptr)
    for i in range(TOKENS):
        t = pid * TOKENS + i
        if t < M:
            t64 = t.to(tl.int64)
            if tl.load(dense_ptr + t64) == 0:
                g_ev, g_od = widen(load_row(dout_ptr, t64 * stride_gm, lanes, l_ok, PAIRS, ""), PAIRS)
                slot0 = t64 * N_TILES * SLOTS
                cnt_base, rem, ct, cs, cc = _row_cursor(count_ptr, t64, N_TILES, SLOTS, NT_P2, BITS)
                # Default L2 policy for the pairs: _tokens_dx_kernel and _wgrad_kernel read them
                # again. The next pair is loaded while this pair's row arrives.
                ok, slot, jp, pre = load_pair(idx_ptr, val_ptr, slot0, ct, cs, N_TILES, SLOTS, "", OVF)
                while ok:
                    wd = load_row(wdt_ptr, jp * stride_wdt, lanes, l_ok, PAIRS, "")
                    up = pre
                    if GATED:
                        up = tl.load(up_ptr + slot)
                    rem, ct, cs, cc = next_pair(count_ptr, cnt_base, rem, ct, cs, cc, N_TILES, SLOTS, BITS)
                    next_ok, next_slot, next_jp, next_pre = load_pair(idx_ptr, val_ptr, slot0, ct, cs, N_TILES, SLOTS,
                                                                      "", OVF)
                    act, hv = _hidden(pre, up, GATED)
                    wd_ev, wd_od = widen(wd, PAIRS)
                    dh = _sum(join_row(wd_ev * g_ev, wd_od * g_od, PAIRS), axis=0) + scale * _sign(hv)
                    tl.store(dh_ptr + slot, dh)
                    ok, slot, jp, pre = next_ok, next_slot, next_jp, next_pre


@triton.autotune(configs=_token_configs(), key=["D", "H", "GATED"], prune_configs_by={"early_config_prune": _prune_rows(3)})
@triton.heuristics({"EVEN_D": lambda a: a["D"] % a["BLOCK_D"] == 0})
@triton.jit
def _tokens_dx_kernel(
    # pointers
    wg_ptr, wu_ptr, idx_ptr, val_ptr, up_ptr, count_ptr, dense_ptr, dh_ptr, dx_ptr,
    # dimensions and row strides (elements)
    M, D, H, N_TILES, stride_wg, stride_wu, stride_dxm,
    # meta-parameters
    GATED: tl.constexpr, SLOTS: tl.constexpr, BLOCK_D: tl.constexpr, TOKENS: tl.constexpr,
    NT_P2: tl.constexpr, BITS: tl.constexpr, PAIRS: tl.constexpr, EVEN_D: tl.constexpr, OVF: tl.constexpr,
):
    """``dx[t] = Σ_j dgate · Wg[j] + dup · Wu[j]`` over the stored pairs of each sparse row, from
    ``_tokens_dh_kernel``'s ``dh``; one ``BLOCK_D`` column block per program, the programs of block
    ``b`` (``pid // cdiv(M, TOKENS)``) before those of block ``b + 1``. Plain: ``wg`` is unused.
    """
    pid = tl.program_id(0)
    n_prog = tl.cdiv(M, TOKENS)
    block = pid // n_prog
    lanes, l_ok = row_lanes(block, D, BLOCK_D, PAIRS, EVEN_D)
    offs_d = block * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = column_mask(offs_d, D, EVEN_D)
    for i in range(TOKENS):
        t = (pid % n_prog) * TOKENS + i
        if t < M:
            t64 = t.to(tl.int64)
            if tl.load(dense_ptr + t64) == 0:
                acc_ev, acc_od = zero_row(lanes, PAIRS)
                slot0 = t64 * N_TILES * SLOTS
                cnt_base, rem, ct, cs, cc = _row_cursor(count_ptr, t64, N_TILES, SLOTS, NT_P2, BITS)
                ok, slot, jp, pre = load_pair(idx_ptr, val_ptr, slot0, ct, cs, N_TILES, SLOTS, "", OVF)
                while ok:
                    wu = load_row(wu_ptr, jp * stride_wu, lanes, l_ok, PAIRS, "")
                    dh = tl.load(dh_ptr + slot)
                    up = pre
                    if GATED:
                        up = tl.load(up_ptr + slot)
                        wg = load_row(wg_ptr, jp * stride_wg, lanes, l_ok, PAIRS, "")
                    rem, ct, cs, cc = next_pair(count_ptr, cnt_base, rem, ct, cs, cc, N_TILES, SLOTS, BITS)
                    next_ok, next_slot, next_jp, next_pre = load_pair(idx_ptr, val_ptr, slot0, ct, cs, N_TILES, SLOTS,
                                                                      "", OVF)
                    act, hv = _hidden(pre, up, GATED)
                    d_gate, d_up = _pair_grads(pre, up, act, dh, GATED)
                    wu_ev, wu_od = widen(wu, PAIRS)
                    acc_ev += d_up * wu_ev
                    acc_od += d_up * wu_od
                    if GATED:
                        wg_ev, wg_od = widen(wg, PAIRS)
                        acc_ev += d_gate * wg_ev
                        acc_od += d_gate * wg_od
                    ok, slot, jp, pre = next_ok, next_slot, next_jp, next_pre
                acc = join_row(acc_ev, acc_od, PAIRS)
                tl.store(dx_ptr + t64 * stride_dxm + offs_d, acc.to(dx_ptr.dtype.element_ty), mask=d_ok)


# ---------------------------------------------------------------------------------------------
# 3-4. Dense rows: coefficients over all H, then dx
# ---------------------------------------------------------------------------------------------


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
    act, hv = _hidden(pre, up, GATED)
    d_gate, d_up = _pair_grads(pre, up, act, dhd + scale * _sign(hv), GATED)
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
                sum_g += _sum(c_g, axis=1)
            else:
                c_u = tl.load(coef_ptr + at, mask=cm, other=0.0)
                c_h = tl.load(coef_ptr + PLANE + at, mask=cm, other=0.0)
            acc_u = dot_split(c_u, xr, acc_u, SPLIT, NATIVE)
            acc_d = dot_split(c_h, gr, acc_d, SPLIT, NATIVE)
            sum_u += _sum(c_u, axis=1)
        out = offs_j.to(tl.int64)[:, None] * D + offs_d[None, :]
        _store_planes(part_ptr + out, H.to(tl.int64) * D, acc_g, acc_u, acc_d, j_ok[:, None] & d_ok[None, :], GATED)
        if tl.program_id(1) == 0:
            tl.store(psum_ptr + offs_j, sum_u, mask=j_ok)
            if GATED:
                tl.store(psum_ptr + H + offs_j, sum_g, mask=j_ok)


# ---------------------------------------------------------------------------------------------
# 5. Weight gradients, neuron-major
# ---------------------------------------------------------------------------------------------


# _dense_wgrad_kernel's (BJ neurons, BD columns, warps) on the GPU. Not tuned: at 256 dense rows it
# reads ~0.7 GB, mostly L2 hits, and writes the partial once.
_DENSE_WGRAD_TILES = (64, 64, 4)
# From this many dense rows in a call, dense_wgrad_gemm pays (a training step on the H200 paid ~11
# us per dense row without it, session 15; the partial's write and read cost ~0.1 ms).
DENSE_WGRAD_GEMM_ROWS = 8


def _wgrad_configs():
    if INTERPRET:
        return [triton.Config({"BD": 32, "CK": 8}, num_warps=4, num_stages=1)]
    # (D slice, pairs per chunk, warps, stages). A 13-config sweep on the H200 (bf16, D=2048,
    # H=5632, M=16384, uniform neurons) put whole-row programs first: (2048, 4, 8, 1) took 1.34 ms
    # at 0.5% density and 2.57 ms at 1%, then (64, 8, 1, 1) 1.88 / 3.38 ms; the 256-wide slices
    # this list started from took 2.8 ms. Those programs held 213-254 registers (the dense-row
    # loop's 16-row chunks, see the kernel). At 113-125 registers (session 16) the autotuner picks
    # (1024, 2, 2, 1) or (512, 2, 1, 1), run to run, at 0.3-1% (before: (2048, 2, 4, 1)).
    shapes = [(1024, 2, 2, 1), (2048, 2, 4, 1), (1024, 4, 4, 1), (2048, 4, 8, 1), (1024, 4, 2, 1), (512, 2, 1, 1),
              (64, 8, 1, 1)]
    return [triton.Config({"BD": bd, "CK": ck}, num_warps=w, num_stages=st) for bd, ck, w, st in shapes]


# The narrowest D slice of _wgrad_configs (the tickets of the hottest neurons' segments).
_WGRAD_MIN_BD = min(c.kwargs["BD"] for c in _wgrad_configs())
# The hottest neurons' pairs are split over programs. One program walks a neuron's pairs one chunk
# at a time, so with skewed neurons (log-normal, the hottest at ~27x the mean pairs) the hottest
# neurons' programs ended the kernel. The _HOT_NEURONS hottest, when they have _HOT_SPLIT_MIN pairs
# or more (uniform neurons at 1% density have ~164), get _HOT_SEGMENTS programs each. On the H200
# (session 25, M=16384, configs tuned on uniform neurons first, as the bench does), with skewed
# neurons: 1.449 -> 0.767 ms at 0.5% density, 2.880 -> 1.497 at 1%, 5.96 -> 2.94 at 2%; uniform
# neurons the same (0.605 / 0.614 ms at 0.5%).
_HOT_NEURONS = 64
_HOT_SEGMENTS = 16
_HOT_SPLIT_MIN = 256


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
        up += _sum(xa * wu[None, :], axis=1)
        dhd += _sum(ga * wdt[None, :], axis=1)
        if GATED:
            wg = tl.load(wg_ptr + j * stride_wg + kk, mask=k_ok, other=0.0).to(tl.float32)
            gate += _sum(xa * wg[None, :], axis=1)
    return gate, up, dhd


@jit_helper
def _row_update(acc, acc2, coef, rows, PAIRS: tl.constexpr):
    """``acc += Σ_k coef[k] · rows[k]`` on ``load_row``'s halves (``rows``: ``[CK, lanes]`` as loaded)."""
    ev, od = widen(rows, PAIRS)
    acc += _sum(coef[:, None] * ev, axis=0)
    if PAIRS:
        acc2 += _sum(coef[:, None] * od, axis=0)
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
        act, hv = _hidden(pre, up, GATED)
        d_gate, d_up = _pair_grads(pre, up, act, dh, GATED)
        d_up = tl.where(k_ok, d_up, 0.0)
        hv = tl.where(k_ok, hv, 0.0)
        acc_u, acc_u2, acc_d, acc_d2 = _rows_update(acc_u, acc_u2, acc_d, acc_d2, d_up, hv, xr, gr, PAIRS)
        sum_u += d_up
        if GATED:
            d_gate = tl.where(k_ok, d_gate, 0.0)
            acc_g, acc_g2 = _row_update(acc_g, acc_g2, d_gate, xr, PAIRS)
            sum_g += d_gate
        k_ok, slot = next_ok, next_slot

    # Dense rows, in list (= row) order, CK at a time like the pairs: chunks of 16 whole rows (until
    # session 16) made every program hold 254 registers on sm90 even with no dense row (123 now),
    # which halved the kernel's occupancy: the backward took 2.36 ms at 0.5% density, now 2.00.
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
            act, hv = _hidden(pre, up, GATED)
            d_gate, d_up = _pair_grads(pre, up, act, dhd + scale * _sign(hv), GATED)
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
    bias_u = _sum(sum_u, axis=0) + _sum(dsum_u, axis=0)
    bias_g = _sum(sum_g, axis=0) + _sum(dsum_g, axis=0)
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


# ---------------------------------------------------------------------------------------------
# Host side
# ---------------------------------------------------------------------------------------------


def backward_dense_rows(
    dout, x, wg, wu, wd, bg, bu, bd, packed: TwellPacked, forward_rows: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """bool ``[M]``: the rows the backward computes densely (``reference.backward_dense_rows_ref``).

    Device ops only, no host synchronisation. ``forward_rows`` may pass the forward's guard rows
    (``reference.dense_rows_ref``, or ``sparse_ffn.guard_rows`` which leaves out the overflow rows):
    then the weights are not re-checked, and only the overflow rows and the ``dout`` terms are added.
    """
    if forward_rows is None:
        return backward_dense_rows_ref(dout, x, wg, wu, wd, bg, bu, bd, packed)
    rows = forward_rows | packed.overflow_rows() | ~torch.isfinite(dout).all(-1)
    if wg is not None and x.shape[0] > 0:
        rows |= _may_overflow(dout, wd.T, None, dout.dtype)
    return rows


def sparse_ffn_backward(
    dout: torch.Tensor,
    x: torch.Tensor,
    wg: Optional[torch.Tensor],
    wu: torch.Tensor,
    wd: torch.Tensor,
    bg: Optional[torch.Tensor],
    bu: Optional[torch.Tensor],
    bd: Optional[torch.Tensor],
    packed: TwellPacked,
    up_val: torch.Tensor,
    dense_rows: torch.Tensor,
    l1_scale: torch.Tensor,
    *,
    layout: TwellLayout = DEFAULT_LAYOUT,
    dense_scratch_rows: Optional[int] = None,
    dense_wgrad_gemm: bool = False,
    row_list: Optional[RowList] = None,
    reuse_tickets: bool = False,
) -> Grads:
    """Gradients of ``(out · dout).sum() + l1_scale · (1/M) Σ|h|`` for a TwELL FFN.

    Equals ``reference.ffn_backward_ref`` with the same ``dense_rows`` up to fp32 summation order,
    without synchronising the host.

    Args:
        dout: ``[M, D]`` gradient of the output, dtype of x.
        x: ``[M, D]`` float16/bfloat16/float32 input of the forward.
        wg: ``[H, D]`` gate weight (dtype of x), or ``None`` for a plain FFN.
        wu: ``[H, D]`` up weight; wd: ``[D, H]`` down weight (``nn.Linear`` layouts, dtype of x).
        bg, bu, bd: optional biases ``[H]``, ``[H]``, ``[D]`` (any float dtype); a gradient is
            returned for each one given, ``None`` otherwise.
        packed: the forward's TwELL buffer (gate pre-activation for gated, up for plain), fp32
            values, in ``layout``; it must be a valid buffer (``format.py``).
        up_val: fp32 ``[M, n_tiles, slots]`` up values at the stored slots of the sparse rows
            (read nowhere else, so other slots may hold anything; gated); ignored (may be empty)
            for a plain FFN.
        dense_rows: bool ``[M]``: rows computed by the dense formulas, with the semantics of
            ``reference.backward_dense_rows_ref`` (``backward_dense_rows`` computes it). It must
            include every overflowed row: their stored slots are incomplete.
        l1_scale: 0-d float tensor on x's device, ``l1_coeff / n_layers`` (read on the device).
        layout: the TwELL layout of ``packed``.
        dense_scratch_rows: dense rows whose coefficients are kept in scratch (default: a 32 MiB
            budget); rows past it are recomputed (exact, slower). Tests use small values.
        dense_wgrad_gemm: sum the scratch rows' weight gradients as GEMMs into an fp32
            ``[planes, H, D]`` buffer (138 MB at D=2048, H=5632, gated) that the neuron-major
            kernel reads, instead of gathering each dense row's ``x`` and ``dout`` once per
            neuron. Faster from a few dense rows on (``DENSE_WGRAD_GEMM_ROWS``), for that memory.
            The caller guesses, e.g. from the previous call's dense rows: either way the result is
            the same up to fp32 summation order (and the ``hi + lo`` split of bf16 coefficients).
        row_list: ``dense_rows`` already listed on the device (``dense_rows.flag_rows(...,
            with_list=True)``); otherwise listed here, one launch.
        reuse_tickets: the dense rows' split sums take their tickets from a kept buffer
            (``dense_rows.zeroed_scratch``) instead of a fresh fill.

    Returns:
        ``reference.Grads`` in the input dtypes, each contiguous. ``dwd`` is made from the ``[H, D]``
        rows of ``dWdᵀ`` the kernel writes by one tiled transpose (``weights.transposed``).

    Example::

        res = reference.ffn_forward_ref(x, wg, wu, wd, bg, bu, bd)
        rows = backward_dense_rows(dout, x, wg, wu, wd, bg, bu, bd, res.packed)
        grads = sparse_ffn_backward(dout, x, wg, wu, wd, bg, bu, bd, res.packed, res.up_val, rows, scale)
    """
    # 1. Check shapes, dtypes and devices.
    m, d, h = check_ffn_operands(x, wg, wu, wd, bg, bu, bd, dout=dout)
    dev = x.device
    gated = wg is not None
    check_packed(packed, m, h, layout, dev)
    n_tiles, slots = layout.n_tiles(h), layout.slots
    if gated:
        check_tensor("up_val", up_val, (m, n_tiles, slots), (torch.float32,), dev)
    check_tensor("dense_rows", dense_rows, (m,), (torch.bool,), dev)
    if row_list is not None:
        check_row_list(row_list, m, dev)
    if not isinstance(l1_scale, torch.Tensor) or l1_scale.numel() != 1 or not l1_scale.is_floating_point():
        raise ValueError(f"l1_scale must be a 0-d float tensor, got {getattr(l1_scale, 'shape', type(l1_scale).__name__)}")
    if l1_scale.device != dev:
        raise ValueError(f"l1_scale is on {l1_scale.device} but x is on {dev}")
    if dense_scratch_rows is not None and dense_scratch_rows < 0:
        raise ValueError(f"dense_scratch_rows must be >= 0, got {dense_scratch_rows}")
    if not INTERPRET and dev.type != "cuda":
        raise ValueError(f"x must be a CUDA tensor (or set TRITON_INTERPRET=1), got device {dev}")

    # 2. Allocate the outputs and the scratch.
    dx = torch.empty(m, d, dtype=x.dtype, device=dev)
    dwg = torch.empty(h, d, dtype=wg.dtype, device=dev) if gated else None
    dwu = torch.empty(h, d, dtype=wu.dtype, device=dev)
    dwdt = torch.empty(h, d, dtype=wd.dtype, device=dev)
    dbg = torch.empty(h, dtype=bg.dtype, device=dev) if bg is not None else None
    dbu = torch.empty(h, dtype=bu.dtype, device=dev) if bu is not None else None
    dbd = dout.sum(0, dtype=torch.float32).to(bd.dtype) if bd is not None else None
    if m == 0 or d == 0 or h == 0:
        for t in (dx, dwg, dwu, dwdt, dbg, dbu):
            if t is not None:
                t.zero_()
        return Grads(dx, dwg, dwu, transposed(dwdt), dbg, dbu, dbd)

    scale = (l1_scale.to(torch.float32) / m).reshape(())  # the reference's l1_scale / max(1, M)
    x, dout, wu = rowmajor(x), rowmajor(dout), rowmajor(wu)
    wg_ = rowmajor(wg) if gated else wu
    wdt = transposed(wd)  # [H, D]: column j of Wd as a contiguous row (no copy if wd = wdt.t())
    idx, val, count = packed.idx.contiguous(), packed.val.contiguous(), packed.count.contiguous()
    up = up_val.contiguous() if gated else val
    dense_rows = dense_rows.contiguous()
    dense_u8 = dense_rows.view(torch.uint8)
    dummy = val  # stands in for absent biases; never read
    bg_, bu_ = (bg if bg is not None else dummy), (bu if bu is not None else dummy)
    dh = torch.empty(m, n_tiles, slots, dtype=torch.float32, device=dev)

    nptr, lists, order = neuron_major(TwellPacked(idx, val, count), dense_rows, h, layout=layout)
    rows, n_dense = dense_list(dense_rows) if row_list is None else row_list
    planes = 3 if gated else 2
    m_pad = cdiv(m, BR) * BR
    # The coefficients [planes, r_cap, H] only (496 rows at H=5632, or 2% of M if more); the split
    # products' partial sums come on top (45 MB at D=2048).
    r_cap = scratch_capacity(m, 4 * planes * h, dense_scratch_rows)
    coef = torch.empty(planes, r_cap, h, dtype=torch.float32, device=dev) if r_cap else dummy

    flags = dict(GATED=gated, HAS_BG=bg is not None, HAS_BU=bu is not None)
    native = x.dtype != torch.float32 and not INTERPRET
    w_strides = (wg_.stride(0), wu.stride(0), wdt.stride(0))
    if INTERPRET:
        bh, bk, bd_blk, warps = 32, 32, 32, 4
    else:
        # Dense rows are rare (overflow, guard): small row tiles waste little on an isolated row.
        # fp32 tiles take twice the shared memory: 128-wide D blocks needed 240 KiB on the H200
        # (limit 227 KiB), so fp32 uses 64.
        bh, bk, bd_blk, warps = 64, 64, (64 if x.dtype == torch.float32 else 128), 4

    # 3. Launch: sparse rows (dx, dh), dense rows (scratch, dx), then the weight gradients.
    block_d = max(16, next_power_of_2(d))
    nt_p2 = max(2, next_power_of_2(n_tiles))
    ovf = overflow_threshold(x.dtype)  # the stored pre-activations' overflow (sparse_ffn.overflow_up)
    walk = dict(GATED=gated, SLOTS=slots, NT_P2=nt_p2, BITS=bit_walk(nt_p2), OVF=ovf)
    launch(_tokens_dh_kernel, lambda meta: (cdiv(m, meta["TOKENS"]),),
        dout, wdt, idx, val, up, count, dense_u8, scale, dh, m, d, h, n_tiles, dout.stride(0), wdt.stride(0),
        BLOCK_D=block_d, PAIRS=paired(dout, wdt), **walk,
    )
    block_dx = min(block_d, _DX_BLOCK_MAX)
    launch(_tokens_dx_kernel, lambda meta: (cdiv(d, block_dx) * cdiv(m, meta["TOKENS"]),),
        wg_, wu, idx, val, up, count, dense_u8, dh, dx, m, d, h, n_tiles, wg_.stride(0), wu.stride(0), dx.stride(0),
        BLOCK_D=block_dx, PAIRS=paired(wg_, wu), **walk,
    )
    # The scratch of the first r_cap list positions and dx of the positions past it: one launch.
    coef_programs = (r_cap // BR) * cdiv(h, bh)
    dx_row_programs = min((m_pad - r_cap) // BR, BLOCKED_ROW_PROGRAMS)
    if coef_programs or dx_row_programs:
        launch(_dense_coef_dx_kernel, (coef_programs + dx_row_programs * cdiv(d, bd_blk),),
            x, dout, wg_, wu, wdt, bg_, bu_, scale, rows, n_dense, coef, dx,
            d, h, r_cap, r_cap * h, coef_programs, max(1, dx_row_programs),
            x.stride(0), dout.stride(0), *w_strides, dx.stride(0),
            **flags, NATIVE=native, BR=BR, BH=bh, BK=bk, BD=bd_blk, num_warps=warps,
        )
    if r_cap:
        # hi + lo in bf16 only: fp16's range cannot hold every finite fp32 coefficient.
        scratch_product(coef, rows, n_dense, (wg_, wu) if gated else (wu,), dx,
                        split=x.dtype == torch.bfloat16, bh=bh, bd=bd_blk, warps=warps, reuse_tickets=reuse_tickets)
    partial = dense_wgrad_gemm and r_cap > 0
    part = psum = dummy
    if partial:
        part = torch.empty(planes, h, d, dtype=torch.float32, device=dev)
        psum = torch.empty(2, h, dtype=torch.float32, device=dev)
        bj, bd_w, warps_w = (32, 32, 4) if INTERPRET else _DENSE_WGRAD_TILES
        launch(_dense_wgrad_kernel, (cdiv(h, bj), cdiv(d, bd_w)),
            x, dout, rows, n_dense, coef, part, psum, d, h, r_cap, r_cap * h, x.stride(0), dout.stride(0),
            GATED=gated, SPLIT=x.dtype == torch.bfloat16, NATIVE=native, BR=BR, BJ=bj, BD=bd_w, num_warps=warps_w,
        )
    # Neurons by decreasing pair count (order), each neuron's D slices together, the hottest
    # neurons' pairs in segments (see _wgrad_kernel): fp32 partials and a ticket per (neuron, D
    # slice) of the narrowest slice any config takes.
    top, segs, split_min = (min(h, 3), 3, 2) if INTERPRET else (min(h, _HOT_NEURONS), _HOT_SEGMENTS, _HOT_SPLIT_MIN)
    seg_part = torch.empty(top * segs * 3 * d, dtype=torch.float32, device=dev)
    seg_sum = torch.empty(top * segs * 2, dtype=torch.float32, device=dev)
    tickets = zeroed_scratch(top * cdiv(d, _WGRAD_MIN_BD), dev, reuse=reuse_tickets)
    launch(_wgrad_kernel, lambda meta: ((h + top * (segs - 1)) * cdiv(d, meta["BD"]),),
        x, dout, val, up, dh, nptr, lists, order, rows, n_dense, coef, part, psum,
        wg_, wu, wdt, bg_, bu_, scale,
        dwg if gated else dwu, dwu, dwdt, dbg if dbg is not None else dummy, dbu if dbu is not None else dummy,
        seg_part, seg_sum, tickets,
        d, h, n_tiles * slots, r_cap, r_cap * h, top, split_min,
        x.stride(0), dout.stride(0), *w_strides,
        **flags, PARTIAL=partial, SEGS=segs, BK=bk, PAIRS=paired(x, dout), OVF=ovf,
    )
    return Grads(dx, dwg, dwu, transposed(dwdt), dbg, dbu, dbd)
