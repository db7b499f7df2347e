"""kernels/dense_rows.py: the device-built list of dense rows and the split scratch product.

Oracles: ``torch.nonzero`` for the list; ``coef @ W (+ bias)`` in float64 for the product, for
every list position below ``n_dense``, with rows outside the list left untouched. (The forward and
backward kernel tests cover both pieces again inside ``sparse_ffn`` and ``sparse_ffn_backward``.)
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # before the kernel modules are imported (DESIGN.md section 9)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from twell_compile.kernels import dense_rows as DR  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@settings(max_examples=12, deadline=None)
@given(m=st.integers(1, 1100), rate=st.sampled_from([0.0, 0.01, 0.3, 1.0]), seed=st.integers(0, 2**16))
def test_dense_list_is_the_flagged_rows_in_order(m, rate, seed):
    """Any M, with no, few, many or all rows flagged."""
    gen = torch.Generator().manual_seed(seed)
    flags = (torch.rand(m, generator=gen) < rate).to(DEV)
    rows, n_dense = DR.dense_list(flags)
    expected = torch.nonzero(flags).flatten().to(torch.int32)
    assert n_dense.dtype == torch.int32 and n_dense.shape == (1,)
    assert n_dense.item() == expected.numel()
    assert torch.equal(rows[: expected.numel()], expected)


@pytest.mark.parametrize("two, split, dtype", [(True, False, torch.float32), (False, False, torch.float32),
                                               (True, True, torch.float16), (False, True, torch.bfloat16)])
def test_scratch_product_matches_float64(two, split, dtype):
    """``dst[rows[i]] = Σ_p coef[p, i] @ W_p (+ bias)`` over two H splits; other rows untouched."""
    gen = torch.Generator().manual_seed(3)
    m, d, h, r_cap = 40, 24, 200, 32  # bh = 16: split_count(200, 16) = 2 splits
    flags = torch.zeros(m, dtype=torch.bool)
    flags[[0, 5, 17, 18, 39]] = True
    rows, n_dense = DR.dense_list(flags.to(DEV))
    coef = torch.randn(2, r_cap, h, generator=gen)
    coef[:, 2, 7] = float("inf")  # hi + lo keeps Inf (lo is 0 there), as one IEEE product would
    weights = [torch.randn(h, d, generator=gen).to(dtype) for _ in range(2 if two else 1)]
    bias = torch.randn(d, generator=gen)
    dst = torch.full((m, d), 7.0, dtype=dtype)
    ours = dst.to(DEV)
    DR.scratch_product(coef.to(DEV), rows, n_dense, [w.to(DEV) for w in weights], ours, bias.to(DEV),
                       split=split, bh=16, bd=16, warps=4)
    ours = ours.cpu()
    listed = torch.nonzero(flags).flatten()
    ref = sum(coef[p, : len(listed)].double() @ w.double() for p, w in enumerate(weights)) + bias.double()
    untouched = ~flags
    assert torch.equal(ours[untouched], dst[untouched])
    got = ours[listed].double()
    assert torch.equal(torch.isinf(got), torch.isinf(ref)) and torch.equal(torch.isnan(got), torch.isnan(ref))
    finite = torch.isfinite(ref)
    # One rounding to the output dtype; split products keep ~16 bits of each coefficient.
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    scale = ref[finite].abs().max()
    assert ((got - ref)[finite].abs() <= tol * scale).all(), ((got - ref)[finite].abs().max() / scale).item()
