"""Gate GEMM with a TwELL-packing epilogue: ``packed = TwELL(x Wᵀ + b)``.

Math. For ``x [M, D]`` and ``W [H, D]`` (``nn.Linear`` layout), ``pre = x Wᵀ + b`` is ``[M, H]``.
Each ``BLOCK_M × 128`` tile of ``pre`` is computed in an fp32 accumulator. The 128 columns are
exactly one TwELL tile (``format.TILE_N``), so the epilogue packs that tile's rows without talking
to any other tile:

* ``active = not (pre <= 0)`` (NaN is active: ``relu(NaN)`` is NaN), columns ``>= H`` inactive;
* ``rank = cumsum(active) - 1`` along the tile row, ``count = sum(active)``;
* the entries with ``rank < slots`` are scattered to slot ``rank`` (first actives, increasing
  column order); ``count`` is stored uncapped, so ``count > slots`` marks an overflow.

The dense ``pre`` never reaches global memory. Stored values are ``pre`` as accumulated in fp32:
for 16-bit inputs a value past the dtype's range stays finite here, and the consumers map it to
+Inf, as dense PyTorch's rounding of the gate does, when they read it (``pair_walk.load_pair``):
one test per stored pair there instead of two instructions per accumulator element here (on the
H200, 0.014 ms a call less at the benchmark shape). This is ``reference.gate_pack_ref`` up to fp32
summation order (the reference sums fp32 inputs in float64).

Two epilogues compute the same ranks (autotune picks; tests run both):

* ``BIT_RANKS``: each row's activity bits in 32-bit words (row sums of ``active << lane``), and
  ``rank`` = population counts of the bits below the entry in its word and of the words before
  (``_bit_ranks``); the kept entries are stored element by element in the accumulator's layout
  (inline PTX on the GPU, ``tl.store`` in the interpreter). Nothing leaves the registers but the
  stored entries, and whole 256-row tiles fit without spills.
* ``EPI_SPLIT`` row slices with ``tl.cumsum``: Triton moves each slice into a blocked layout
  (through shared memory) for the scan and again for the stores; the pointer path keeps it.

Bytes, for 16-bit inputs (``e`` = element size, ``a`` = stored actives per row):

* read: ``x`` and ``W``, ``M·D·e + H·D·e`` at best; each x row-block is re-read once per column
  tile and each W tile once per row-block, mostly from L2 thanks to the grouped tile order;
* written: ``M·n_tiles·4`` (count) + ``M·a·8`` (idx + val), against ``M·H·e`` for a dense gate:
  at D=2048, H=5632, 28 actives per token that is 312 B instead of 11264 B per token.

Loads go through TMA tensor descriptors on sm90+ where a TMA config fits the shared memory
(``gate_pack_configs``), or plain pointers elsewhere and in the interpreter by default. With
TMA, the autotuner's usual pick is one persistent program per SM looping over the tiles, so a
tile's epilogue overlaps the next tile's loads, but not the MMAs: on the H200 at D=2048, H=5632,
M=16384 the main loop alone takes 0.48-0.50 ms (cuBLAS's GEMM 0.51-0.53) and the epilogue adds
~0.07 ms (docs/benchmarks.md); with pointers, each program packs one tile. fp32 inputs use IEEE
fp32 products (``input_precision="ieee"``), as dense PyTorch does with TF32 off; fp16/bf16 use
tensor cores with fp32 accumulation.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import libdevice
from triton.tools.tensor_descriptor import TensorDescriptor

from .checks import FLOAT_DTYPES, check_matrix, check_tensor
from .format import DEFAULT_LAYOUT, TwellLayout, TwellPacked, empty_packed
from .gate_pack_configs import (autotune_configs, device_properties, persistent_programs, prune_configs,
                                sm90_or_newer, tma_fits, tma_ok)
from .launch import cdiv, launch
from .triton_helpers import INTERPRET


GROUP_M = 8  # row-blocks per group of the tile order: a group's W tiles stay in L2


@triton.autotune(configs=autotune_configs(), key=["D", "H", "USE_TMA", "IEEE"],
                 prune_configs_by={"early_config_prune": prune_configs})
@triton.heuristics({"EVEN_K": lambda a: a["D"] % a["BLOCK_K"] == 0, "EVEN_N": lambda a: a["H"] % a["BLOCK_N"] == 0,
                    "EVEN_M": lambda a: a["M"] % a["BLOCK_M"] == 0})
@triton.jit
def _gate_pack_kernel(
    # pointers (x and w are TensorDescriptors when USE_TMA)
    x, w, b_ptr, idx_ptr, val_ptr, count_ptr,
    # dimensions
    M, D, H, N_TILES,
    # strides (elements)
    stride_xm, stride_xk, stride_wn, stride_wk,
    # meta-parameters
    HAS_BIAS: tl.constexpr, USE_TMA: tl.constexpr, IEEE: tl.constexpr, INTERPRET: tl.constexpr,
    SLOTS: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, EPI_SPLIT: tl.constexpr, PERSISTENT: tl.constexpr, EVEN_K: tl.constexpr,
    EVEN_N: tl.constexpr, EVEN_M: tl.constexpr, BIT_RANKS: tl.constexpr, PAIRED: tl.constexpr = False,
):
    """Pack ``pre = x @ wᵀ + b`` into TwELL, ``BLOCK_M × BLOCK_N`` tiles.

    x: ``[M, D]``; w: ``[H, D]``; b: ``[H]`` (if HAS_BIAS). Writes ``count [M, N_TILES]`` int32
    (uncapped), and for the first ``min(count, SLOTS)`` actives of each tile row, in increasing
    column order, ``idx [M, N_TILES, SLOTS]`` int32 (global column) and ``val`` fp32 (``pre``).
    Other slots are left untouched. ``BLOCK_N`` must equal the layout's ``tile_n``. With PAIRED,
    slot ``k`` is the 8-byte pair at ``idx_ptr + 2k`` (``format.empty_packed(paired=True)``):
    its column, then its value (``val_ptr`` = ``idx_ptr + 1``).
    """
    # Each program packs tiles pid, pid + programs, ...: one tile unless PERSISTENT (a program per
    # SM), where flattening the loops lets one tile's epilogue overlap the next tile's loads.
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_tiles = num_pid_m * N_TILES
    for tile in tl.range(tl.program_id(0), num_tiles, tl.num_programs(0), flatten=PERSISTENT):
        _gate_pack_tile(
            tile, num_pid_m, x, w, b_ptr, idx_ptr, val_ptr, count_ptr, M, D, H, N_TILES,
            stride_xm, stride_xk, stride_wn, stride_wk,
            HAS_BIAS, USE_TMA, IEEE, INTERPRET, SLOTS, BLOCK_N, GROUP_M, BLOCK_M, BLOCK_K, EPI_SPLIT, EVEN_K,
            EVEN_N, EVEN_M, BIT_RANKS, PAIRED,
        )


@triton.jit
def _gate_pack_tile(
    tile, num_pid_m, x, w, b_ptr, idx_ptr, val_ptr, count_ptr, M, D, H, N_TILES,
    stride_xm, stride_xk, stride_wn, stride_wk,
    HAS_BIAS: tl.constexpr, USE_TMA: tl.constexpr, IEEE: tl.constexpr, INTERPRET: tl.constexpr,
    SLOTS: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, EPI_SPLIT: tl.constexpr, EVEN_K: tl.constexpr,
    EVEN_N: tl.constexpr, EVEN_M: tl.constexpr, BIT_RANKS: tl.constexpr, PAIRED: tl.constexpr,
):
    """One ``BLOCK_M × BLOCK_N`` output tile of ``_gate_pack_kernel``: its GEMM, then its packing."""
    # Grouped order: GROUP_M row-blocks sweep all column tiles together, for L2 reuse of W.
    pids_in_group = GROUP_M * N_TILES
    first_m = (tile // pids_in_group) * GROUP_M
    group_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (tile % pids_in_group) % group_m
    pid_n = (tile % pids_in_group) // group_m

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)

    if USE_TMA:
        # Out-of-bounds rows, columns and K are zero-filled by the TMA unit.
        for k0 in range(0, D, BLOCK_K):
            a = x.load([pid_m * BLOCK_M, k0])
            bt = w.load([pid_n * BLOCK_N, k0])
            if INTERPRET:
                a = a.to(tl.float32)
                bt = bt.to(tl.float32)
            if IEEE:
                acc = tl.dot(a, bt.T, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, bt.T, acc)
    else:
        # Clamp rows/columns instead of masking them: their results are never stored.
        rows_ld = tl.minimum(rows, M - 1).to(tl.int64)
        cols_ld = tl.minimum(cols, H - 1).to(tl.int64)
        a_ptrs = x + rows_ld[:, None] * stride_xm + offs_k[None, :] * stride_xk
        b_ptrs = w + cols_ld[None, :] * stride_wn + offs_k[:, None] * stride_wk  # [BLOCK_K, BLOCK_N]
        for k0 in range(0, D, BLOCK_K):
            if EVEN_K:
                a = tl.load(a_ptrs)
                bt = tl.load(b_ptrs)
            else:
                a = tl.load(a_ptrs, mask=offs_k[None, :] < D - k0, other=0.0)
                bt = tl.load(b_ptrs, mask=offs_k[:, None] < D - k0, other=0.0)
            if INTERPRET:
                a = a.to(tl.float32)
                bt = bt.to(tl.float32)
            if IEEE:
                acc = tl.dot(a, bt, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, bt, acc)
            a_ptrs += BLOCK_K * stride_xk
            b_ptrs += BLOCK_K * stride_wk

    if EVEN_N:  # H is a multiple of the tile: no column to mask (saves an AND per accumulator element)
        col_ok = tl.full((BLOCK_N,), 1, tl.int1)
    else:
        col_ok = cols < H
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]

    # The scan epilogue runs on EPI_SPLIT row slices of the tile: packing a 128x128 tile at once holds
    # a rank and an address per element on top of the accumulator, which spills (ptxas -v, sm90,
    # bf16). Bit-count ranks (BIT_RANKS) pack a whole 256-row tile without spills.
    if BIT_RANKS or EPI_SPLIT == 1:
        _pack_rows(acc, pid_m * BLOCK_M, cols, col_ok, pid_n, idx_ptr, val_ptr, count_ptr, M, N_TILES, SLOTS,
                   PAIRED, BIT_RANKS, INTERPRET, EVEN_M)
    elif EPI_SPLIT == 2:
        _pack_halves(acc, pid_m * BLOCK_M, cols, col_ok, pid_n, idx_ptr, val_ptr, count_ptr, M, N_TILES, SLOTS,
                     PAIRED)
    elif EPI_SPLIT == 4:
        _pack_quarters(acc, pid_m * BLOCK_M, cols, col_ok, pid_n, idx_ptr, val_ptr, count_ptr, M, N_TILES, SLOTS,
                       PAIRED)
    else:
        tl.static_assert(EPI_SPLIT == 8, "EPI_SPLIT must be 1, 2, 4 or 8")
        top, bottom = _split_rows(acc)
        _pack_quarters(top, pid_m * BLOCK_M, cols, col_ok, pid_n, idx_ptr, val_ptr, count_ptr, M, N_TILES, SLOTS,
                       PAIRED)
        _pack_quarters(bottom, pid_m * BLOCK_M + BLOCK_M // 2, cols, col_ok, pid_n, idx_ptr, val_ptr, count_ptr,
                       M, N_TILES, SLOTS, PAIRED)


@triton.jit
def _split_rows(t):
    """``t [R, N]`` -> its first and last ``R/2`` rows."""
    return tl.split(tl.permute(tl.reshape(t, (2, t.shape[0] // 2, t.shape[1])), (1, 2, 0)))


@triton.jit
def _pack_halves(pre, row0, cols, col_ok, pid_n, idx_ptr, val_ptr, count_ptr, M, N_TILES, SLOTS: tl.constexpr,
                 PAIRED: tl.constexpr):
    top, bottom = _split_rows(pre)
    _pack_rows(top, row0, cols, col_ok, pid_n, idx_ptr, val_ptr, count_ptr, M, N_TILES, SLOTS, PAIRED)
    _pack_rows(bottom, row0 + pre.shape[0] // 2, cols, col_ok, pid_n, idx_ptr, val_ptr, count_ptr, M, N_TILES, SLOTS,
               PAIRED)


@triton.jit
def _pack_quarters(pre, row0, cols, col_ok, pid_n, idx_ptr, val_ptr, count_ptr, M, N_TILES, SLOTS: tl.constexpr,
                   PAIRED: tl.constexpr):
    top, bottom = _split_rows(pre)
    _pack_halves(top, row0, cols, col_ok, pid_n, idx_ptr, val_ptr, count_ptr, M, N_TILES, SLOTS, PAIRED)
    _pack_halves(bottom, row0 + pre.shape[0] // 2, cols, col_ok, pid_n, idx_ptr, val_ptr, count_ptr, M, N_TILES, SLOTS,
                 PAIRED)


@triton.jit
def _pack_rows(pre, row0, cols, col_ok, pid_n, idx_ptr, val_ptr, count_ptr, M, N_TILES, SLOTS: tl.constexpr,
               PAIRED: tl.constexpr, BIT_RANKS: tl.constexpr = False, INTERPRET: tl.constexpr = False,
               EVEN_M: tl.constexpr = False):
    """Pack the rows ``row0 + i`` of ``pre [R, BLOCK_N]`` (fp32, one TwELL tile) into TwELL.

    The rank of an active entry is the number of actives before it in its row: a ``tl.cumsum``,
    which first moves the tile into a blocked layout through shared memory, or with ``BIT_RANKS``
    population counts of the row's activity bits (``_bit_ranks``), which keep every value in the
    accumulator's layout; ``BIT_RANKS`` on the GPU also stores through ``_store_pairs``, in that
    same layout. With ``PAIRED`` slot ``k`` is the pair at ``idx_ptr + 2k`` (its value at
    ``val_ptr + 2k``): one address an entry for both stores.
    """
    rows = row0 + tl.arange(0, pre.shape[0])
    row_ok = rows < M
    active = ((pre <= 0.0) == 0) & col_ok[None, :]  # not (pre <= 0): NaN counts as active
    if BIT_RANKS:
        rank, count = _bit_ranks(active, INTERPRET)
    else:
        ones = active.to(tl.int32)
        rank = tl.cumsum(ones, axis=1) - 1  # slot of each active entry: first actives first
        count = tl.sum(ones, axis=1)
    keep = active & (rank < SLOTS)
    if not EVEN_M:  # rows past M exist only when M is not a multiple of the tile (an AND an element)
        keep = keep & row_ok[:, None]
    rows64 = rows.to(tl.int64)
    row_slot = rows64 * (N_TILES * SLOTS) + pid_n * SLOTS
    col = cols[None, :] + tl.zeros(pre.shape, dtype=tl.int32)
    if BIT_RANKS and not INTERPRET and PAIRED:
        pair_row = (idx_ptr + 2 * row_slot).to(tl.int64, bitcast=True)
        _store_slot_pairs(tl.broadcast_to(pair_row[:, None], pre.shape), rank, col, pre, keep)
    elif BIT_RANKS and not INTERPRET:
        idx_row = (idx_ptr + row_slot).to(tl.int64, bitcast=True)
        val_row = (val_ptr + row_slot).to(tl.int64, bitcast=True)
        _store_pairs(tl.broadcast_to(idx_row[:, None], pre.shape), tl.broadcast_to(val_row[:, None], pre.shape),
                     rank, col, pre, keep)
    else:
        slot = (row_slot[:, None] + rank) * (2 if PAIRED else 1)
        tl.store(idx_ptr + slot, col, mask=keep)
        tl.store(val_ptr + slot, pre, mask=keep)
    tl.store(count_ptr + rows64 * N_TILES + pid_n, count, mask=row_ok)


@triton.jit
def _bit_ranks(active, INTERPRET: tl.constexpr):
    """``(rank, count)`` of ``active [R, N]`` (N a power of two) from its words of activity bits
    (32 columns each, or N if fewer): rank = popcount of the bits below the entry in its word +
    the popcounts of the words before. Only element-wise operations and row sums, all in
    ``active``'s own layout."""
    R: tl.constexpr = active.shape[0]
    N: tl.constexpr = active.shape[1]
    WORD: tl.constexpr = N if N < 32 else 32
    c = tl.arange(0, N)
    lane = (c % WORD).to(tl.uint32)
    bits = active.to(tl.uint32) << lane[None, :]
    word_b = tl.zeros((R, N), tl.uint32)  # each entry's word, broadcast over its 32 columns
    before_b = tl.zeros((R, N), tl.int32)  # actives in the words before the entry's
    count = tl.zeros((R,), tl.int32)
    for wi in tl.static_range(N // WORD):
        in_word = (c // WORD == wi)[None, :]
        word = tl.sum(tl.where(in_word, bits, 0), axis=1)  # distinct bits: their sum is their or
        word_b = tl.where(in_word, word[:, None], word_b)
        before_b = tl.where(in_word, count[:, None], before_b)
        count += _popcount(word, INTERPRET)
    below = (tl.full((N,), 1, tl.uint32) << lane) - 1
    return before_b + _popcount(word_b & below[None, :], INTERPRET), count


@triton.jit
def _popcount(v, INTERPRET: tl.constexpr):
    """Set bits of uint32 ``v`` as int32: ``popc`` on the GPU, a SWAR count in the interpreter."""
    if INTERPRET:
        v = v - ((v >> 1) & 0x55555555)
        v = (v & 0x33333333) + ((v >> 2) & 0x33333333)
        v = (v + (v >> 4)) & 0x0F0F0F0F
        return ((v * 0x01010101) >> 24).to(tl.int32)
    else:
        return libdevice.popc(v.to(tl.int32, bitcast=True))


@triton.jit
def _store_pairs(idx_row, val_row, rank, col, val, keep):
    """``idx_row[rank] = col`` and ``val_row[rank] = val`` where ``keep``, element by element, in
    the operands' own layout: ``tl.store`` moves a scattered store into a blocked layout first
    (Triton's coalescing pass), a shared-memory round trip of the whole tile and its pointers."""
    tl.inline_asm_elementwise(
        """{
        .reg .pred p;
        .reg .s64 a;
        setp.ne.s32 p, $6, 0;
        mul.wide.s32 a, $3, 4;
        add.s64 a, a, $1;
        @p st.global.b32 [a], $4;
        mul.wide.s32 a, $3, 4;
        add.s64 a, a, $2;
        @p st.global.b32 [a], $5;
        mov.b32 $0, 0;
        }""",
        "=r,l,l,r,r,r,r",
        [idx_row, val_row, rank, col, val.to(tl.int32, bitcast=True), keep.to(tl.int32)],
        dtype=tl.int32, is_pure=False, pack=1,
    )


@triton.jit
def _store_slot_pairs(pair_row, rank, col, val, keep):
    """``_store_pairs`` into paired slots: the 8-byte pair ``pair_row[rank]`` = ``(col, val)``, by
    two 4-byte stores from one address. One 8-byte store would need the two values in adjacent
    registers, which costs a move each (sm90 SASS: 2744 instructions with two separate buffers,
    2728 with 8-byte stores, 2592 with these; on the H200 0.003-0.009 ms a call faster than
    separate buffers)."""
    tl.inline_asm_elementwise(
        """{
        .reg .pred p;
        .reg .s64 a;
        setp.ne.s32 p, $5, 0;
        mul.wide.s32 a, $2, 8;
        add.s64 a, a, $1;
        @p st.global.b32 [a], $3;
        @p st.global.b32 [a+4], $4;
        mov.b32 $0, 0;
        }""",
        "=r,l,r,r,r,r",
        [pair_row, rank, col, val.to(tl.int32, bitcast=True), keep.to(tl.int32)],
        dtype=tl.int32, is_pure=False, pack=1,
    )


def gate_pack(
    x: torch.Tensor,
    w: torch.Tensor,
    b: Optional[torch.Tensor] = None,
    *,
    layout: TwellLayout = DEFAULT_LAYOUT,
    use_tma: Optional[bool] = None,
    paired: bool = True,
    check: bool = True,
) -> TwellPacked:
    """``TwELL(x wᵀ + b)`` computed by one GEMM whose epilogue packs; the dense result is never stored.

    Args:
        x: ``[M, D]`` float16/bfloat16/float32 activations.
        w: ``[H, D]`` weight in ``nn.Linear`` layout, same dtype and device as ``x``.
        b: optional ``[H]`` bias (any float dtype; added in fp32).
        layout: TwELL geometry; ``tile_n`` must be in 16..256 (it is the GEMM's BLOCK_N).
        use_tma: load through TMA descriptors. ``None``: on sm90+ GPUs when the strides allow it.
        paired: store each slot's column and value side by side, in one buffer
            (``format.empty_packed(paired=True)``), which ``sparse_ffn`` reads with one 8-byte
            load a pair; False: in two contiguous buffers.
        check: validate the arguments; False where the caller has (the TwELL ops check theirs
            once a call).

    Returns:
        A ``TwellPacked`` (``format.py``) with ``[M, n_tiles, slots]`` int32 ``idx`` and fp32
        ``val`` (with ``paired``, strided views of one buffer), and ``[M, n_tiles]`` int32
        ``count``. Unused slots hold unspecified values.

    Example::

        packed = gate_pack(x, mlp.gate_proj.weight, mlp.gate_proj.bias)
    """
    # 1. Check shapes, dtypes and devices (``check=False``: the caller has).
    if check:
        _check_args(x, w, b, layout)
    m, d = x.shape
    h = w.shape[0]

    # 2. Allocate the TwELL buffers (fixed capacity from shapes).
    packed = empty_packed(m, h, x.dtype, x.device, layout, paired=paired)
    n_tiles = layout.n_tiles(h)
    if m == 0 or n_tiles == 0:
        return packed

    # 3. Launch.
    if use_tma is None:
        # fp32 (IEEE products, no tensor cores) compiles to heavy spills through TMA on sm90.
        use_tma = (
            not INTERPRET
            and x.dtype != torch.float32
            and sm90_or_newer(x.device)
            and tma_ok(x)
            and tma_ok(w)
            and tma_fits(x.device, x.element_size(), layout.tile_n)
        )
    elif use_tma and not (tma_ok(x) and tma_ok(w)):
        raise ValueError("use_tma=True needs x and w with unit last stride and 16-byte aligned rows")
    elif use_tma and not tma_fits(x.device, x.element_size(), layout.tile_n):
        raise ValueError(f"use_tma=True: no TMA config of gate_pack fits this GPU's "
                         f"{device_properties(x.device).shared_memory_per_block_optin} bytes of shared memory per "
                         "block; pass use_tma=False (or None, which chooses)")
    if use_tma:
        # Block shapes are placeholders; the autotune pre-hook sets them per config.
        xa = TensorDescriptor.from_tensor(x, [16, 16])
        wa = TensorDescriptor.from_tensor(w, [16, 16])
    else:
        xa, wa = x, w
    def grid(meta):
        tiles = cdiv(m, meta["BLOCK_M"]) * n_tiles
        return (min(tiles, persistent_programs(x.device)) if meta["PERSISTENT"] else tiles,)

    launch(_gate_pack_kernel, grid,
        xa, wa, b if b is not None else packed.val, packed.idx, packed.val, packed.count,
        m, d, h, n_tiles,
        x.stride(0), x.stride(1), w.stride(0), w.stride(1),
        HAS_BIAS=b is not None, USE_TMA=bool(use_tma), IEEE=x.dtype == torch.float32, INTERPRET=INTERPRET,
        SLOTS=layout.slots, BLOCK_N=layout.tile_n, GROUP_M=GROUP_M, PAIRED=bool(paired),
    )
    return packed


def _check_args(x, w, b, layout: TwellLayout) -> None:
    """``gate_pack``'s argument checks: errors that name the argument at fault."""
    check_matrix("x", x, "[M, D]")
    check_matrix("w", w, "[H, D]")
    m, d = x.shape
    h = w.shape[0]
    check_tensor("x", x, (m, d), FLOAT_DTYPES, x.device)
    check_tensor("w", w, (h, d), (x.dtype,), x.device)
    if b is not None:
        check_tensor("b", b, (h,), FLOAT_DTYPES, x.device)
    if not INTERPRET and x.device.type != "cuda":
        raise ValueError(f"x must be a CUDA tensor (or set TRITON_INTERPRET=1), got device {x.device}")
    if not 16 <= layout.tile_n <= 256:
        raise ValueError(f"layout.tile_n must be in 16..256 for gate_pack, got {layout.tile_n}")


KERNELS = {"gate_pack": _gate_pack_kernel}
