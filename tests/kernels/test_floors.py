"""kernels/floors.py: the bench's gather floor against its PyTorch reference, and its CSR list.

The floor is not an FFN; what matters is that it reads every pair's two weight rows, the x row,
and writes the output row, which the reference's result pins down.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # before the kernel modules are imported (docs/architecture.md, 'Testing')
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from twell_compile.kernels.floors import active_pairs, gather_floor, gather_floor_ref  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _problem(m, d, h, density, dtype, seed, *, full_row=None, empty_row=None):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, d, generator=gen)
    wu = torch.randn(h, d, generator=gen)
    wd_t = torch.randn(h, d, generator=gen)
    active = torch.rand(m, h, generator=gen) < density
    if full_row is not None:
        active[full_row] = True
    if empty_row is not None:
        active[empty_row] = False
    return [t.to(DEV, dtype) for t in (x, wu, wd_t)] + [active.to(DEV)]


def test_active_pairs_lists_each_rows_columns_in_order():
    active = torch.tensor([[False, True, True], [False, False, False], [True, False, True]], device=DEV)
    row_ptr, cols = active_pairs(active)
    assert row_ptr.tolist() == [0, 2, 2, 4] and row_ptr.dtype == torch.int64
    assert cols.tolist() == [1, 2, 0, 2] and cols.dtype == torch.int32


@given(
    m=st.integers(1, 9),
    d=st.integers(1, 70),
    h=st.integers(1, 40),
    density=st.sampled_from([0.0, 0.05, 0.3, 1.0]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    seed=st.integers(0, 2**16),
)
def test_gather_floor_matches_its_reference(m, d, h, density, dtype, seed):
    """Any shape (D not a power of two: masked tails), empty and full rows, 16-bit and fp32."""
    x, wu, wd_t, active = _problem(m, d, h, density, dtype, seed, full_row=0, empty_row=m - 1)
    row_ptr, cols = active_pairs(active)
    out = gather_floor(x, row_ptr, cols, wu, wd_t)
    ref = gather_floor_ref(x, row_ptr, cols, wu, wd_t)
    assert out.dtype == x.dtype and out.shape == x.shape
    # fp32 sums in another order; 16-bit outputs within a rounding of the fp32 sum (the interpreter
    # truncates where the GPU rounds to nearest)
    tol = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}[dtype]
    scale = ref.float().abs().amax().clamp_min(1.0)
    assert ((out.float() - ref.float()).abs().amax() / scale).item() <= tol
    if m > 1:  # the empty row is x unchanged
        assert torch.equal(out[m - 1], x[m - 1])


def test_gather_floor_names_the_argument_at_fault():
    x, wu, wd_t, active = _problem(4, 8, 6, 0.5, torch.float32, 0)
    row_ptr, cols = active_pairs(active)
    with pytest.raises(TypeError, match="wd_t"):
        gather_floor(x, row_ptr, cols, wu, wd_t.half())
    with pytest.raises(ValueError, match="row_ptr"):
        gather_floor(x, row_ptr[:-1], cols, wu, wd_t)
    with pytest.raises(TypeError, match="cols"):
        gather_floor(x, row_ptr, cols.long(), wu, wd_t)
    with pytest.raises(ValueError, match="wu must be contiguous"):
        gather_floor(x, row_ptr, cols, wu.t().contiguous().t(), wd_t)
    with pytest.raises(TypeError, match="active must be a bool"):
        active_pairs(active.int())


@pytest.mark.gpu
def test_gather_floor_at_the_bench_shape():
    """bf16 at D=2048, H=5632, 0.5% density: the kernel the bench times."""
    x, wu, wd_t, active = _problem(4096, 2048, 5632, 0.005, torch.bfloat16, 1)
    row_ptr, cols = active_pairs(active)
    out = gather_floor(x, row_ptr, cols, wu, wd_t)
    ref = gather_floor_ref(x, row_ptr, cols, wu, wd_t)
    torch.testing.assert_close(out.float(), ref.float(), rtol=1e-2, atol=1e-2)
