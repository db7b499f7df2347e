"""The TwELL format (kernels/format.py) and its reference pack/unpack (kernels/reference.py).

The properties checked against an independent, loop-based decoding of the dense pre-activation:

* ``count`` is the true number of active entries (``not (pre <= 0)``: > 0, +Inf, NaN) per tile
  row, never capped;
* the stored slots hold the first ``min(count, slots)`` actives in increasing column order, with
  their global column and their exact value;
* overflow rows are exactly the rows with some tile holding more actives than slots;
* for rows without overflow ``unpack(pack(pre)) == relu(pre)`` exactly (NaN where pre is NaN).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given

from tests.strategies import ALL_DTYPES, pre_activations
from tests.utils import assert_same_nonfinite
from twell_compile.kernels.format import (
    DEFAULT_LAYOUT,
    SLOTS_PER_TILE,
    TILE_N,
    TwellLayout,
    TwellPacked,
    accumulation_dtype,
    empty_packed,
    is_active,
    is_paired,
)
from twell_compile.kernels.reference import pack_ref, unpack_ref

NAN, INF = float("nan"), float("inf")


def assert_identical(actual: torch.Tensor, expected: torch.Tensor, name: str) -> None:
    """Exact equality, NaN equal to NaN (−0.0 equal to 0.0, as ``==`` has it)."""
    assert actual.shape == expected.shape, f"[{name}] shape {tuple(actual.shape)} vs {tuple(expected.shape)}"
    assert actual.dtype == expected.dtype, f"[{name}] dtype {actual.dtype} vs {expected.dtype}"
    assert_same_nonfinite(actual, expected, name)
    same = (actual == expected) | (actual.isnan() & expected.isnan())
    if not bool(same.all()):
        bad = (~same).nonzero()[:8].tolist()
        shown = ", ".join(f"{tuple(i)}: {actual[tuple(i)].item()!r} vs {expected[tuple(i)].item()!r}" for i in bad)
        raise AssertionError(f"[{name}] {int((~same).sum())} element(s) differ: {shown}")


def check_packed(pre: torch.Tensor, layout: TwellLayout) -> TwellPacked:
    """Pack ``pre`` and check every format property against a per-tile Python decoding."""
    m, h = pre.shape
    packed = pack_ref(pre, layout)
    n_tiles = layout.n_tiles(h)
    tn, slots = layout.tile_n, layout.slots

    # Shapes and dtypes: capacity depends on shapes only; values keep pre's dtype.
    assert packed.idx.shape == (m, n_tiles, slots) and packed.idx.dtype == torch.int32
    assert packed.val.shape == (m, n_tiles, slots) and packed.val.dtype == pre.dtype
    assert packed.count.shape == (m, n_tiles) and packed.count.dtype == torch.int32
    assert packed.slots == slots

    # The activity test, written independently of is_active: > 0 or NaN.
    active = (pre > 0) | pre.isnan()
    expected_count = torch.zeros(m, n_tiles, dtype=torch.int32)
    for t in range(n_tiles):
        expected_count[:, t] = active[:, t * tn : (t + 1) * tn].sum(1)
    assert torch.equal(packed.count, expected_count), "count must be the true, uncapped active count per tile row"
    assert torch.equal(packed.overflow_rows(), (expected_count > slots).any(1) if n_tiles else torch.zeros(m, dtype=torch.bool))

    stored = packed.stored_mask()
    for row in range(m):
        for t in range(n_tiles):
            cols = [c for c in range(t * tn, min(h, (t + 1) * tn)) if active[row, c]]
            first = cols[:slots]
            n = len(first)
            assert stored[row, t].tolist() == [s < n for s in range(slots)]
            assert packed.idx[row, t, :n].tolist() == first, f"row {row} tile {t}: slots must hold the first actives in column order"
            assert_identical(packed.val[row, t, :n], pre[row, first], f"val[{row}, {t}]")

    dense = unpack_ref(packed, h)
    assert dense.shape == (m, h) and dense.dtype == pre.dtype
    ok_rows = ~packed.overflow_rows()
    assert_identical(dense[ok_rows], torch.relu(pre)[ok_rows], "unpack(pack(pre)) vs relu(pre), rows without overflow")
    # Overflow rows hold exactly the stored prefix of each tile, zeros elsewhere.
    for row in packed.overflow_rows().nonzero().flatten().tolist():
        keep = torch.zeros(h, dtype=torch.bool)
        for t in range(n_tiles):
            cols = [c for c in range(t * tn, min(h, (t + 1) * tn)) if active[row, c]][:slots]
            keep[cols] = True
        expected_row = torch.where(keep, torch.relu(pre[row]), torch.zeros_like(pre[row]))
        assert_identical(dense[row], expected_row, f"unpack of overflow row {row}")
    return packed


# ---------------------------------------------------------------------------------------------
# TwellLayout
# ---------------------------------------------------------------------------------------------


def test_default_layout():
    assert DEFAULT_LAYOUT == TwellLayout() == TwellLayout(tile_n=TILE_N, slots=SLOTS_PER_TILE)
    assert (TILE_N, SLOTS_PER_TILE) == (128, 16)


@pytest.mark.parametrize("tile_n", [0, -1, -128, 3, 6, 100, 129, 384])
def test_layout_rejects_bad_tile_n(tile_n):
    with pytest.raises(ValueError, match="tile_n"):
        TwellLayout(tile_n=tile_n, slots=1)


@pytest.mark.parametrize(("tile_n", "slots"), [(128, 0), (128, -1), (128, 129), (1, 2), (16, 17)])
def test_layout_rejects_bad_slots(tile_n, slots):
    with pytest.raises(ValueError, match="slots"):
        TwellLayout(tile_n=tile_n, slots=slots)


@pytest.mark.parametrize(("tile_n", "slots"), [(1, 1), (2, 1), (2, 2), (64, 16), (128, 1), (128, 128), (1024, 16)])
def test_layout_accepts_valid(tile_n, slots):
    layout = TwellLayout(tile_n=tile_n, slots=slots)
    assert (layout.tile_n, layout.slots) == (tile_n, slots)


def test_layout_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        DEFAULT_LAYOUT.slots = 3  # type: ignore[misc]


@pytest.mark.parametrize(("hidden", "tiles"), [(0, 0), (1, 1), (127, 1), (128, 1), (129, 2), (256, 2), (257, 3), (5632, 44)])
def test_n_tiles(hidden, tiles):
    assert DEFAULT_LAYOUT.n_tiles(hidden) == tiles


# ---------------------------------------------------------------------------------------------
# Small helpers of format.py
# ---------------------------------------------------------------------------------------------


def test_is_active_special_values():
    pre = torch.tensor([NAN, INF, -INF, -0.0, 0.0, 1e-45, -1e-45, 2.0, -2.0])
    assert is_active(pre).tolist() == [True, True, False, False, False, True, False, True, False]


@pytest.mark.parametrize(
    ("dtype", "acc"),
    [(torch.float64, torch.float64), (torch.float32, torch.float32), (torch.float16, torch.float32), (torch.bfloat16, torch.float32)],
)
def test_accumulation_dtype_and_empty_packed(dtype, acc):
    assert accumulation_dtype(dtype) == acc
    layout = TwellLayout(tile_n=32, slots=4)
    packed = empty_packed(5, 70, dtype, "cpu", layout)
    assert packed.idx.shape == packed.val.shape == (5, 3, 4)
    assert packed.count.shape == (5, 3)
    assert (packed.idx.dtype, packed.val.dtype, packed.count.dtype) == (torch.int32, acc, torch.int32)
    assert packed.slots == 4


def test_paired_buffer_is_one_allocation_of_8_byte_slots():
    layout = TwellLayout(tile_n=32, slots=4)
    packed = empty_packed(5, 70, torch.bfloat16, "cpu", layout, paired=True)
    assert packed.idx.shape == packed.val.shape == (5, 3, 4)
    assert (packed.idx.dtype, packed.val.dtype) == (torch.int32, torch.float32)
    assert is_paired(packed)
    packed.idx.copy_(torch.arange(60, dtype=torch.int32).view(5, 3, 4))
    packed.val.copy_(-torch.arange(60, dtype=torch.float32).view(5, 3, 4))
    # Slot k of the buffer is the int32 pair (idx, bits of val): what a kernel reads as one int64.
    pairs = torch.empty(0, dtype=torch.int32).set_(packed.idx.untyped_storage(), 0, (60, 2), (2, 1))
    assert torch.equal(pairs[:, 0], torch.arange(60, dtype=torch.int32))
    assert torch.equal(pairs[:, 1].view(torch.float32), -torch.arange(60, dtype=torch.float32))
    # Row slices keep the layout; copies, separate buffers and float64 values do not have it.
    assert is_paired(packed._replace(idx=packed.idx[2:], val=packed.val[2:]))
    assert not is_paired(packed._replace(idx=packed.idx.contiguous(), val=packed.val.contiguous()))
    assert not is_paired(empty_packed(5, 70, torch.float32, "cpu", layout))
    assert not is_paired(packed._replace(val=packed.val[:, :, [1, 0, 2, 3]]))
    with pytest.raises(ValueError, match="float32 values"):
        empty_packed(5, 70, torch.float64, "cpu", layout, paired=True)


def test_stored_mask_and_overflow_rows_by_hand():
    count = torch.tensor([[0, 2], [3, 1], [4, 0]], dtype=torch.int32)  # slots = 3
    packed = TwellPacked(idx=torch.zeros(3, 2, 3, dtype=torch.int32), val=torch.zeros(3, 2, 3), count=count)
    assert packed.overflow_rows().tolist() == [False, False, True]
    assert packed.stored_mask().tolist() == [
        [[False, False, False], [True, True, False]],
        [[True, True, True], [True, False, False]],
        [[True, True, True], [False, False, False]],
    ]


# ---------------------------------------------------------------------------------------------
# pack / unpack: properties
# ---------------------------------------------------------------------------------------------


@given(pre_activations())
def test_pack_unpack_properties(case):
    pre, layout = case
    check_packed(pre, layout)


# ---------------------------------------------------------------------------------------------
# pack / unpack: the named edge cases
# ---------------------------------------------------------------------------------------------


def _row_with_actives(h: int, cols) -> torch.Tensor:
    row = -torch.rand(h) - 0.1
    row[list(cols)] = torch.rand(len(list(cols))) + 0.1
    return row


@pytest.mark.parametrize("extra", [-1, 0, 1, 2])
def test_tile_exactly_at_capacity_is_not_overflow(extra):
    n = SLOTS_PER_TILE + extra  # 15, 16 (at capacity: fine), 17 (one over: overflow), 18
    pre = torch.stack([
        _row_with_actives(300, range(128, 128 + n)),  # contiguous in tile 1
        _row_with_actives(300, range(0, 2 * n, 2)),  # strided in tile 0
        _row_with_actives(300, range(299 - n + 1, 300)),  # at the end of the partial tile 2
        _row_with_actives(300, []),
    ])
    packed = check_packed(pre, DEFAULT_LAYOUT)
    over = n > SLOTS_PER_TILE
    assert packed.overflow_rows().tolist() == [over, over, over, False]
    assert packed.count[0].tolist() == [0, n, 0]
    assert packed.count[2].tolist() == [0, 0, n]


@pytest.mark.parametrize("h", [1, 5, 100, 127, 128, 129, 143, 144, 145, 300])
def test_all_zero_and_all_active_rows(h):
    pre = torch.stack([torch.zeros(h), -torch.rand(h) - 1, torch.rand(h) + 0.5, torch.full((h,), -0.0)])
    packed = check_packed(pre, DEFAULT_LAYOUT)
    expected_full = [min(128, h - 128 * t) for t in range(DEFAULT_LAYOUT.n_tiles(h))]
    assert packed.count[0].tolist() == packed.count[1].tolist() == packed.count[3].tolist() == [0] * len(expected_full)
    assert packed.count[2].tolist() == expected_full
    # An all-active row overflows iff some tile has more than 16 columns (h = 144 fits: 128 + 16).
    assert packed.overflow_rows().tolist() == [False, False, any(c > 16 for c in expected_full), False]
    assert not torch.signbit(unpack_ref(packed, h)[3]).any()  # -0.0 is inactive: decoded as +0.0


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_special_values(dtype):
    pre = torch.tensor([
        [NAN, INF, -INF, -0.0, 0.0, 1.0, -1.0],
        [-INF, -INF, -0.0, 0.0, -1.0, -2.0, -3.0],
        [NAN, NAN, NAN, NAN, NAN, NAN, NAN],
        [INF, -INF, INF, -INF, NAN, 2.0, -0.0],
    ], dtype=dtype)
    packed = check_packed(pre, TwellLayout(tile_n=4, slots=2))
    assert packed.count.tolist() == [[2, 1], [0, 0], [4, 3], [2, 2]]
    assert packed.overflow_rows().tolist() == [False, False, True, False]
    dense = unpack_ref(packed, 7)
    assert dense[0].isnan().tolist() == [True] + [False] * 6
    assert dense[0, 1].item() == INF and dense[0, 5].item() == 1.0
    assert dense[3].isnan().tolist() == [False, False, False, False, True, False, False]
    assert dense[3].tolist()[:4] == [INF, 0.0, INF, 0.0]


def test_empty_rows_and_small_hidden():
    for m, h in [(0, 1), (0, 5), (0, 300), (1, 1), (3, 5)]:
        pre = torch.randn(m, h)
        packed = check_packed(pre, DEFAULT_LAYOUT)
        assert packed.overflow_rows().shape == (m,)
    # H < 128 with everything active: one partial tile, overflow above 16 columns.
    assert check_packed(torch.ones(2, 16), DEFAULT_LAYOUT).overflow_rows().tolist() == [False, False]
    assert check_packed(torch.ones(2, 17), DEFAULT_LAYOUT).overflow_rows().tolist() == [True, True]


def test_idx_is_global_column():
    h = 1000
    pre = -torch.ones(1, h)
    pre[0, [0, 127, 128, 511, 999]] = 1.0
    packed = check_packed(pre, DEFAULT_LAYOUT)
    stored = packed.stored_mask()
    assert packed.idx[stored].tolist() == [0, 127, 128, 511, 999]
    assert packed.count[0].tolist() == [2, 1, 0, 1, 0, 0, 0, 1]
