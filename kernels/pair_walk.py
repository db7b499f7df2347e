"""The TwELL row walk and the row loads of the pair loops, shared by the forward and the backward.

A pair loop (``sparse_ffn``, ``tokens_bwd``) visits the stored pairs of one TwELL row in (tile,
slot) order with a cursor ``(rem, tile, slot, the tile's count)`` (``first_pair``, ``next_pair``):
no reduction and no CTA barrier per pair. Rows of at most ``MAX_BIT_TILES`` tiles jump to the next
tile that stores a pair through a 64-bit set of such tiles (``tile_set``, one reduction of the row's
counts per row; ``bit_walk``) and read its count by one scalar load, an L1 hit; longer rows read
the count of every tile in turn. ``load_pair`` reads a pair's neuron and stored value: one 8-byte
load for paired slots (``format.is_paired``), else two 4-byte loads.

Stored values are the gate GEMM's fp32 accumulators, not rounded to the input dtype: every reader
maps them to +Inf where dense PyTorch's rounding would overflow (``overflow_up``, with the
``OVF`` constexpr of ``overflow_threshold``).

Rows (of x, the weights, dout) are loaded on ``row_lanes`` by ``load_row`` as stored and widened to
fp32 where they are used (``widen``); bf16 rows of even length and stride are read as int32 pairs
of elements (``paired``), whose products stay in even and odd halves until ``join_row``
interleaves them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import libdevice

from .reference import OVERFLOW_THRESHOLD
from .triton_helpers import INTERPRET, column_mask, jit_helper, reduce_sum


# Rows of at most this many TwELL tiles (H <= 8192 with 128-column tiles) walk their tiles by a
# bit set; longer rows read every tile's count (``next_pair``). H200, bf16, D=2048, H=5632,
# M=16384, 0.5% density: ``sparse_ffn`` 0.618 ms by the bit set, 0.634 ms reading every count.
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


def overflow_threshold(dtype: torch.dtype) -> float:
    """The ``OVF`` constexpr of the kernels' overflow tests (``overflow_up``, and the up and h tests
    of the pair loops) for inputs of ``dtype``: ``reference.OVERFLOW_THRESHOLD``, or 0 for fp32
    inputs, whose fp32 arithmetic overflows at that point by itself."""
    return 0.0 if dtype == torch.float32 else float(OVERFLOW_THRESHOLD[dtype])


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
def load_pair(idx_ptr, val_ptr, slot0, tau, s, N_TILES, SLOTS: tl.constexpr, EVICT: tl.constexpr,
              OVF: tl.constexpr, PAIRED: tl.constexpr = False):
    """``(ok, slot, j, value)`` of the cursor's pair (tile ``tau``, slot ``s`` of the TwELL row
    starting at slot ``slot0``): its neuron (int64) and stored value, with the input dtype's
    overflow (``overflow_up``); not ``ok`` past the last. ``EVICT``: the loads' L2 eviction policy:
    ``"evict_first"`` where nothing reads them again, or ``""`` (the default policy). ``PAIRED``
    (``format.is_paired``): the slot is one 8-byte load at ``idx_ptr``, column in its low half.
    On the H200 that makes ``sparse_ffn`` 0.017-0.022 ms faster at 0.5% density and 0.022-0.043
    at 1% than two 4-byte loads from two buffers."""
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
    element on sm90 (``PRMT``, then ``IMAD.U32`` for a pair's high half). H200, D=2048, H=5632,
    M=16384, 0.5% density: ``sparse_ffn`` 0.575 ms against 0.634 with element reads, the backward
    1.86 against 1.92 ms, bitwise the same output. Otherwise the whole row, and a scalar 0 that
    ``join_row`` drops (so every use of it compiles away)."""
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
