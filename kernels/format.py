"""The TwELL format: tile-wise ELLPACK for the hidden activations of a ReLU FFN.

A ReLU FFN's hidden pre-activation ``g = x Wᵀ + b`` has shape ``[M, H]`` (M tokens, H hidden units).
TwELL splits the H columns into tiles of ``tile_n`` columns. For each (row, tile) it keeps:

* ``count[m, t]`` (int32): the true number of active entries in that tile row, never capped;
* ``idx[m, t, s]`` (int32): the global column of slot ``s`` (``t * tile_n + local``), so H has no
  limit short of 2³¹;
* ``val[m, t, s]`` (float32, or float64 for float64 inputs): the pre-activation value in that slot,
  as accumulated (for 16-bit inputs, not rounded to their dtype: its readers apply that dtype's
  overflow to +Inf).

``idx`` and ``val`` are two tensors, or, *paired* (``empty_packed(paired=True)``, what
``gate_pack`` writes by default), strided views of one buffer in which each slot is an 8-byte
``(idx, val)`` pair, so that a consumer reads a slot with one load (``is_paired``).

An entry is *active* when ``not (g <= 0)``: strictly positive values, and NaN, because
``relu(NaN)`` is NaN in PyTorch and must propagate exactly as the dense path does.

Slots ``0 .. min(count, slots) - 1`` hold the first active entries in increasing column order.
Slots past that hold unspecified values and are never read. A tile row with ``count > slots`` has
*overflowed*: it is marked by its count, and every consumer computes that whole row densely (the
"dense backup"), so nothing is ever dropped. See ``docs/format.md``.

Capacity is a function of shapes only (``[M, n_tiles, slots]``), so fake tensors and CUDA graphs
see fixed sizes whatever the sparsity.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

# 128 columns per tile: the BLOCK_N of the gate GEMM that packs in its epilogue (one tile per
# program column). 16 slots: at 2% density a 128-column tile holds 2.6 actives on average, and
# P(Poisson(2.6) > 16) < 1e-8, so overflow stays rare below ~5%; above that the op goes dense.
TILE_N = 128
SLOTS_PER_TILE = 16


@dataclass(frozen=True)
class TwellLayout:
    """Geometry of a TwELL buffer.

    Args:
        tile_n: columns of H per tile. Must be a power of two (Triton block sizes).
        slots: entry slots per tile row. A tile row with more actives than this overflows.
    """

    tile_n: int = TILE_N
    slots: int = SLOTS_PER_TILE

    def __post_init__(self) -> None:
        if self.tile_n <= 0 or self.tile_n & (self.tile_n - 1):
            raise ValueError(f"tile_n must be a positive power of two, got {self.tile_n}")
        if not 0 < self.slots <= self.tile_n:
            raise ValueError(f"slots must be in 1..tile_n={self.tile_n}, got {self.slots}")

    def n_tiles(self, hidden: int) -> int:
        """Number of column tiles covering ``hidden`` columns (the last one may be partial)."""
        return -(-hidden // self.tile_n)


DEFAULT_LAYOUT = TwellLayout()


class TwellPacked(NamedTuple):
    """One TwELL buffer for ``M`` rows of an ``[M, H]`` pre-activation."""

    idx: torch.Tensor  # int32 [M, n_tiles, slots], global column of each slot
    val: torch.Tensor  # float32/float64 [M, n_tiles, slots], pre-activation value of each slot
    count: torch.Tensor  # int32 [M, n_tiles], true active count of each tile row (uncapped)

    @property
    def slots(self) -> int:
        return self.idx.shape[-1]

    def overflow_rows(self) -> torch.Tensor:
        """bool [M]: rows with at least one tile holding more actives than its slots."""
        return (self.count > self.slots).any(dim=1)

    def stored_mask(self) -> torch.Tensor:
        """bool [M, n_tiles, slots]: which slots hold an entry (``s < min(count, slots)``)."""
        slot = torch.arange(self.slots, device=self.count.device)
        return slot < self.count.clamp(max=self.slots).unsqueeze(-1)


def is_active(pre: torch.Tensor) -> torch.Tensor:
    """The activity test: ``not (pre <= 0)``. ``pre > 0`` alone would drop NaN."""
    return ~(pre <= 0)


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype values are kept in inside TwELL: float64 for float64 inputs, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def empty_packed(rows: int, hidden: int, dtype: torch.dtype, device, layout: TwellLayout = DEFAULT_LAYOUT, *,
                 paired: bool = False) -> TwellPacked:
    """Allocate a TwELL buffer of fixed capacity for ``rows`` rows (contents unspecified).

    ``paired``: ``idx`` and ``val`` are views of one ``[rows, n_tiles, slots, 2]`` int32 buffer,
    column then value bits in each 8-byte slot (``is_paired``); float32 values only."""
    n_tiles = layout.n_tiles(hidden)
    if paired:
        if accumulation_dtype(dtype) != torch.float32:
            raise ValueError(f"paired TwELL buffers hold float32 values; {dtype} inputs keep {accumulation_dtype(dtype)}")
        pairs = torch.empty(rows, n_tiles, layout.slots, 2, dtype=torch.int32, device=device)
        return TwellPacked(idx=pairs[..., 0], val=pairs[..., 1].view(torch.float32),
                           count=torch.empty(rows, n_tiles, dtype=torch.int32, device=device))
    return TwellPacked(
        idx=torch.empty(rows, n_tiles, layout.slots, dtype=torch.int32, device=device),
        val=torch.empty(rows, n_tiles, layout.slots, dtype=accumulation_dtype(dtype), device=device),
        count=torch.empty(rows, n_tiles, dtype=torch.int32, device=device),
    )


def is_paired(packed: TwellPacked) -> bool:
    """Whether ``packed``'s ``idx`` and ``val`` are the two halves of 8-byte slots in one buffer, as
    ``empty_packed(paired=True)`` lays them out: float32 values at 4 bytes past their int32
    columns, slot strides of 8 bytes, 8-byte aligned."""
    idx, val = packed.idx, packed.val
    if val.dtype != torch.float32 or idx.dtype != torch.int32 or idx.dim() != 3 or val.shape != idx.shape:
        return False
    rows, n_tiles, slots = idx.shape
    paired_strides = (2 * n_tiles * slots, 2 * slots, 2)
    return (all(st == want for st, want, n in zip(idx.stride(), paired_strides, idx.shape) if n > 1)
            and val.stride() == idx.stride()
            and idx.untyped_storage().data_ptr() == val.untyped_storage().data_ptr()
            and val.data_ptr() == idx.data_ptr() + 4 and idx.data_ptr() % 8 == 0)
