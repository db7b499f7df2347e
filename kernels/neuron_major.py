"""Neuron-major ("transposed") lists of the stored pairs, built on the device.

The weight-gradient kernel (``wgrad``) walks each neuron's pairs, so the backward regroups the
token-major TwELL buffer by neuron: a stable counting sort, two passes of ``_rank_kernel`` whose
programs own ``RANK_TB`` (64) tokens × one TwELL tile each.

1. Count: each stored pair of a sparse row adds 1 to its (neuron, token block)'s count and sets
   its token's bit in that (neuron, block)'s 64-bit word, by integer atomics (exact in any order).
2. One ``torch.cumsum`` over the ``[H, M / TB]`` counts gives every (neuron, token block) its start.
3. Place: each pair goes to its start plus its rank, the popcount of its word's bits below its
   token's, so the list order is fixed: a neuron's pairs are in token order.

The list holds slot numbers ``(t · n_tiles + tile) · slots + s``; its capacity ``M · n_tiles · slots``
is every slot, so it cannot overflow. ``_order_kernel`` then lists the neurons by decreasing pair
count, the weight-gradient kernel's launch order.

Bytes, ``P`` stored pairs: ``2·M·n_tiles·4 + 3·P·4`` plus ``H·M/TB·16`` for the counts, the token
words and the counts' prefix sum. On the H200 (M=16384, H=5632, 0.5% density) both passes take
0.06 ms and ``neuron_major`` 0.10–0.16 ms.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .format import DEFAULT_LAYOUT, TwellLayout, TwellPacked
from .launch import cdiv, launch, next_power_of_2
from .triton_helpers import jit_helper


# Tokens per program of the counting sort (at most 64: one bit each in an int64): the counts, their
# prefix sum and the token bits are [H, M / TB].
RANK_TB = 64
# Neurons per program of _order_kernel's sort (a power of 2). One program sorting all 5632 neurons
# (4096 each in two) takes 105 us on the H200: a bitonic sort is serial in its stages.
ORDER_BLOCK = 1024


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
    above ``ORDER_BLOCK`` neurons). A memset, the two counting-sort passes, a scan and
    ``_order_kernel``; no host synchronisation.
    """
    idx, count = packed.idx, packed.count
    m, n_tiles = count.shape
    slots, tile_n = layout.slots, layout.tile_n
    dev = idx.device
    h_pad = n_tiles * tile_n
    nb = cdiv(m, RANK_TB)
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
    meta = dict(SLOTS=slots, SLOTS_P2=next_power_of_2(slots), TILE_N=tile_n, TB=RANK_TB, num_warps=4)
    grid = (nb, n_tiles)
    launch(_rank_kernel, grid, idx, count, dense_u8, counts, tokens, counts, lists, m, n_tiles, nb, PLACE=False,
           **meta)
    # Neuron-major then block ([j0 b0, j0 b1, ..., j1 b0, ...]), in the lists' index dtype: its
    # totals are at most cap (an int64 scan of int32 counts first copies them).
    incl = torch.cumsum(counts.view(-1), 0, dtype=slot_dtype)
    launch(_rank_kernel, grid, idx, count, dense_u8, counts, tokens, incl, lists, m, n_tiles, nb, PLACE=True, **meta)
    # One launch instead of torch's argsort of the counts (on the H200's host ~0.2 ms of a training
    # step's host time in ten launches and memsets, docs/benchmarks.md).
    ptr = torch.empty(hidden + 1, dtype=torch.int64, device=dev)
    order = torch.empty(hidden, dtype=torch.int32, device=dev)
    n_chunks = cdiv(hidden, ORDER_BLOCK)
    block = max(2, next_power_of_2(cdiv(hidden, n_chunks)))
    launch(_order_kernel, (n_chunks,), incl, ptr, order, hidden, nb, n_chunks, BLOCK=block,
           num_warps=max(1, min(4, block // 256)))
    return ptr, lists, order


KERNELS = {"rank": _rank_kernel, "order": _order_kernel}
