"""kernels/weights.py: ``Wdᵀ`` rows by a tiled transpose, the guard's bounds (one pass over
the weights), and both in one pass (``weight_prep``).

Oracles: ``t.t().contiguous()`` (bitwise) for ``transposed``; ``reference.guard_bounds_ref`` for
``guard_bounds``: the same finiteness offset and limit exactly, the norms to fp32 summation order.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # before the kernel modules are imported (docs/architecture.md, 'Testing')
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from hypothesis import example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from twell_compile.kernels import reference as R  # noqa: E402
from twell_compile.kernels import weights as W  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _weights(d, h, dtype, seed, gated=True, biases=True):
    gen = torch.Generator().manual_seed(seed)
    wg, wu = (torch.randn(h, d, generator=gen).to(dtype).to(DEV) for _ in range(2))
    wd = torch.randn(d, h, generator=gen).to(dtype).to(DEV)
    bg, bu = (torch.randn(h, generator=gen).to(dtype).to(DEV) for _ in range(2))
    bd = torch.randn(d, generator=gen).to(dtype).to(DEV)
    if not biases:
        bg = bu = bd = None
    return (wg if gated else None), wu, wd, (bg if gated else None), bu, bd


def _assert_bounds_match(got, want):
    for g, w in zip(got, want):
        assert g.dtype == torch.float32 and g.shape == (3,)
        torch.testing.assert_close(g[0], w[0], rtol=2e-6, atol=0)  # the norm: fp32 sums in another order
        assert torch.equal(g[1:], w[1:])  # offset (max|bu| or +Inf) and limit: exact


@settings(max_examples=10, deadline=None)
@given(d=st.integers(1, 80), h=st.integers(1, 80), dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16),
       as_view=st.booleans())
@example(d=64, h=64, dtype=torch.bfloat16, seed=0, as_view=False)  # whole tiles
def test_transposed_is_the_contiguous_copy(d, h, dtype, seed, as_view):
    """Any shape, tile tails included; ``wd`` given as a transposed view of ``[H, D]`` is returned
    without a copy."""
    gen = torch.Generator().manual_seed(seed)
    if as_view:
        rows = torch.randn(h, d, generator=gen).to(dtype).to(DEV)
        got = W.transposed(rows.t())
        assert got.data_ptr() == rows.data_ptr() and torch.equal(got, rows)
        return
    wd = torch.randn(d, h, generator=gen).to(dtype).to(DEV)
    got = W.transposed(wd)
    assert got.is_contiguous() and got.dtype == dtype and torch.equal(got, wd.t().contiguous())


def test_transposed_of_a_strided_weight():
    """A weight whose rows are not contiguous (a column slice) is copied correctly too."""
    wide = torch.randn(20, 70).half().to(DEV)
    wd = wide[:, 5:50]
    assert torch.equal(W.transposed(wd), wd.t().contiguous())


@settings(max_examples=8, deadline=None)
@given(d=st.integers(1, 48), h=st.integers(1, 48), dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16),
       gated=st.booleans(), biases=st.booleans())
def test_guard_bounds_match_the_reference(d, h, dtype, seed, gated, biases):
    w = _weights(d, h, dtype, seed, gated, biases)
    _assert_bounds_match(W.guard_bounds(*w), R.guard_bounds_ref(*w))


@settings(max_examples=8, deadline=None)
@given(d=st.integers(1, 80), h=st.integers(1, 80), dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16),
       gated=st.booleans(), as_view=st.booleans())
@example(d=64, h=64, dtype=torch.bfloat16, seed=0, gated=True, as_view=False)
def test_weight_prep_is_the_bounds_and_the_transpose_in_one_pass(d, h, dtype, seed, gated, as_view):
    """``weight_prep``'s bounds are ``guard_bounds``' bitwise, and its ``Wdᵀ`` rows are
    ``transposed``'s (``wd`` itself when it already is a view of ``[H, D]`` rows)."""
    wg, wu, wd, bg, bu, bd = _weights(d, h, dtype, seed, gated)
    if as_view:
        wd = wd.t().contiguous().t()
    fwd, bwd, rows = W.weight_prep(wg, wu, wd, bg, bu, bd, down_rows=True)
    want = W.guard_bounds(wg, wu, wd, bg, bu, bd)
    assert torch.equal(fwd, want[0]) and torch.equal(bwd, want[1])
    assert rows.shape == wd.shape and rows.t().is_contiguous() and torch.equal(rows, wd)
    if as_view:
        assert rows is wd
    assert W.weight_prep(wg, wu, wd, bg, bu, bd)[2] is None


@pytest.mark.parametrize("name", ["wg", "wu", "wd", "bg", "bu", "bd"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_weight_or_bias_sends_every_row_dense(name, value):
    """Offset +Inf whichever tensor holds the NaN or Inf (then every row is flagged); the
    reference's is +Inf or, for a NaN in ``bu``, NaN, which flags every row as well."""
    names = ("wg", "wu", "wd", "bg", "bu", "bd")
    w = dict(zip(names, _weights(24, 40, torch.float16, 1)))
    w[name].view(-1)[7] = value
    fwd, bwd = W.guard_bounds(*w.values())
    assert fwd[1] == float("inf") and fwd[2] == torch.finfo(torch.float16).max
    want = R.guard_bounds_ref(*w.values())
    assert not torch.isfinite(want[0][1]) and torch.equal(bwd[1:], want[1][1:])


def test_squares_that_overflow_fp32_give_an_infinite_norm():
    """A finite bf16 weight above ~1.8e19 squares to Inf in fp32, as in the reference: its bound is
    Inf, so rows with any norm are flagged (a superset only costs speed)."""
    wg, wu, wd, bg, bu, bd = _weights(16, 20, torch.bfloat16, 2)
    wu[3, 3] = 1e20
    fwd, _ = W.guard_bounds(wg, wu, wd, bg, bu, bd)
    assert fwd[0] == float("inf") and torch.isfinite(fwd[1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_benchmark_shape():
    """D=2048, H=5632 bf16: the transposed copy bitwise, the bounds as the reference's."""
    w = _weights(2048, 5632, torch.bfloat16, 3)
    assert torch.equal(W.transposed(w[2]), w[2].t().contiguous())
    _assert_bounds_match(W.guard_bounds(*w), R.guard_bounds_ref(*w))
    fwd, bwd, rows = W.weight_prep(*w, down_rows=True)
    assert torch.equal(rows.t(), w[2].t().contiguous())
    _assert_bounds_match((fwd, bwd), R.guard_bounds_ref(*w))
