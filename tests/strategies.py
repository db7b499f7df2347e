"""Hypothesis strategies for TwELL tests: FFN configurations, layouts and pre-activation matrices.

Sizes are small (the oracle is dense float64) but deliberately fit no tile: H runs from 1 to a few
hundred with the tile edges (127, 128, 129, 255, 256, 257) drawn often.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
from hypothesis import strategies as st

from twell_compile.kernels.format import DEFAULT_LAYOUT, TwellLayout

from tests.utils import FFN, make_ffn

LOW_PRECISION = (torch.float32, torch.float16, torch.bfloat16)
ALL_DTYPES = (torch.float64,) + LOW_PRECISION

# Sizes at and around the tile edges of the default layout, plus tiny ones.
EDGE_H = (1, 2, 15, 16, 17, 127, 128, 129, 255, 256, 257)


def sizes(low: int, high: int, edges: tuple = ()) -> st.SearchStrategy[int]:
    """An int in [low, high], drawing the listed edge values (when in range) about half the time."""
    inside = tuple(e for e in edges if low <= e <= high)
    anywhere = st.integers(low, high)
    return st.one_of(st.sampled_from(inside), anywhere) if inside else anywhere


def densities() -> st.SearchStrategy[float]:
    """Density of active units in [0, 1]: the exact ends, the sparse regime, and anything."""
    return st.one_of(
        st.sampled_from([0.0, 1.0]),
        st.floats(0.001, 0.05),  # the regime TwELL is built for
        st.floats(0.0, 1.0),
    )


def layouts() -> st.SearchStrategy[TwellLayout]:
    """Mostly the default layout; sometimes a small one, so overflow and multi-tile paths run often."""
    small = st.builds(
        lambda log_tile, frac: TwellLayout(tile_n=2**log_tile, slots=max(1, round(frac * 2**log_tile))),
        st.integers(0, 6),
        st.floats(0.0, 1.0),
    )
    return st.one_of(st.just(DEFAULT_LAYOUT), small)


@dataclass(frozen=True)
class FFNConfig:
    """Everything ``make_ffn`` needs, drawn by Hypothesis (printed on failure, so it is the repro)."""

    m: int
    d: int
    h: int
    density: float
    gated: bool
    bias: bool
    dtype: torch.dtype
    skew: float = 0.0
    hot_rows: tuple = ()
    seed: int = 0
    layout: TwellLayout = field(default=DEFAULT_LAYOUT)

    def build(self) -> FFN:
        kwargs = asdict(self)
        kwargs.pop("layout")
        return make_ffn(**kwargs)


@st.composite
def ffn_configs(
    draw,
    *,
    dtypes: tuple = ALL_DTYPES,
    max_m: int = 40,
    max_d: int = 48,
    max_h: int = 300,
    min_m: int = 0,
    hot: bool = True,
    custom_layouts: bool = True,
) -> FFNConfig:
    """An FFN configuration: M (including 0), D, H (not multiples of 128 on purpose), density,
    gated/plain, biases, dtype, skewed neurons, rows forced all-active (overflow-heavy), seed."""
    m = draw(sizes(min_m, max_m, (0, 1, 2, 3, 17, 32)))
    d = draw(sizes(1, max_d, (1, 2, 3, 8, 16, 31)))
    h = draw(sizes(1, max_h, EDGE_H))
    hot_rows: tuple = ()
    if hot and m > 0 and d >= 2 and draw(st.booleans()):
        hot_rows = tuple(sorted(draw(st.sets(st.integers(0, m - 1), min_size=1, max_size=min(m, 4)))))
    return FFNConfig(
        m=m,
        d=d,
        h=h,
        density=draw(densities()),
        gated=draw(st.booleans()),
        bias=draw(st.booleans()),
        dtype=draw(st.sampled_from(dtypes)),
        skew=draw(st.sampled_from([0.0, 0.0, 1.0, 3.0])),
        hot_rows=hot_rows,
        seed=draw(st.integers(0, 2**31 - 1)),
        layout=draw(layouts()) if custom_layouts else DEFAULT_LAYOUT,
    )


# Special values a pre-activation may hold; -0.0 and the smallest subnormal probe the "> 0" edge.
SPECIALS = (float("nan"), float("inf"), float("-inf"), -0.0, 0.0, 5e-324)


@st.composite
def pre_activations(draw, *, max_m: int = 24, max_h: int = 300, dtypes: tuple = ALL_DTYPES):
    """``(pre [M, H], layout)``: a random pre-activation with a drawn density, sprinkled special
    values, and rows forced to sit exactly at, just under and just over a tile's capacity."""
    layout = draw(layouts())
    m = draw(sizes(0, max_m, (0, 1, 2)))
    h = draw(sizes(1, max_h, EDGE_H))
    dtype = draw(st.sampled_from(dtypes))
    density = draw(densities())
    special_rate = draw(st.sampled_from([0.0, 0.0, 0.02, 0.3]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))

    mag = torch.rand(m, h, generator=gen, dtype=torch.float64) + 0.01
    active = torch.rand(m, h, generator=gen, dtype=torch.float64) < density
    pre = torch.where(active, mag, -mag)
    # Rows with exactly `slots + delta` actives in one tile, the rest of that tile inactive.
    n_tiles = layout.n_tiles(h)
    for row in range(m):
        if draw(st.integers(0, 3)) == 0:
            tile = draw(st.integers(0, n_tiles - 1))
            lo, hi = tile * layout.tile_n, min(h, (tile + 1) * layout.tile_n)
            want = min(hi - lo, max(0, layout.slots + draw(st.sampled_from([-1, 0, 1]))))
            cols = torch.randperm(hi - lo, generator=gen)[:want] + lo
            pre[row, lo:hi] = -mag[row, lo:hi]
            pre[row, cols] = mag[row, cols]
    if special_rate > 0 and m > 0:
        pick = torch.rand(m, h, generator=gen) < special_rate
        which = torch.randint(len(SPECIALS), (m, h), generator=gen)
        values = torch.tensor(SPECIALS, dtype=torch.float64)[which]
        pre = torch.where(pick, values, pre)
    return pre.to(dtype), layout
