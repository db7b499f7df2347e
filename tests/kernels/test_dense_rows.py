"""kernels/dense_rows.py: the dense rows' split scratch product, and the scratch's capacity.

Oracle: ``coef @ W (+ bias)`` in float64 (each output tile summed by its last split), for every
list position below ``n_dense``, with rows outside the list left untouched. (The forward and
backward kernel tests cover the product again inside ``sparse_ffn`` and ``sparse_ffn_backward``.)
"""

from __future__ import annotations

import os
import torch

if not torch.cuda.is_available():  # before the kernel modules are imported (docs/architecture.md, 'Testing')
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from tests.kernels.dense_row_cases import assert_lists, split_problem  # noqa: E402
from twell_compile.kernels.dense_rows import (BR, DENSE_ROW_FRACTION_MAX, SCRATCH_BYTES, scratch_capacity,  # noqa: E402
                                              scratch_product, split_count)
from twell_compile.kernels.row_lists import dense_list, flag_rows  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_lists_and_split_sums_by_the_last_program_at_scale():
    """The last program of a launch (a ticket) reads what every other program stored: many
    programs running at once, with every other row, a few rows or none flagged, several times
    over; and the split product's per-tile sums over 16 splits, against the two-launch form."""
    gen = torch.Generator().manual_seed(11)
    m, d = 65536, 64
    a = torch.randn(m, d, generator=gen).cuda()
    limit = float(torch.finfo(torch.float32).max)
    for rep, rate in enumerate((0.5, 0.003, 1e-5, 0.0) * 3):
        flagged = torch.rand(m, generator=gen) < rate
        a[flagged.cuda(), 0] = float("nan")
        a[~flagged.cuda(), 0] = 1.0
        flags, listed = flag_rows(a, torch.tensor([0.0, 0.0, limit], device="cuda"), with_list=True)
        assert torch.equal(flags.cpu(), flagged), rep
        assert_lists(listed, flagged)
    flags, rows, n_dense, coef, weights = split_problem(gen)
    h, d, r_cap = coef.shape[2], weights[0].shape[1], coef.shape[1]
    bias = torch.randn(d, generator=gen).cuda()
    assert split_count(h, 16) == 16
    for _ in range(3):
        dst = torch.zeros(r_cap + 40, d, device="cuda")
        scratch_product(coef, rows, n_dense, weights, dst, bias, split=False, bh=16, bd=64, warps=4)
        listed = torch.nonzero(flags).flatten()
        ref = sum(coef[p, : len(listed)].double() @ w.double() for p, w in enumerate(weights)) + bias.double()
        assert torch.allclose(dst[listed.cuda()].double(), ref, rtol=1e-5, atol=1e-3)
        assert not dst[~flags.cuda()].any()

@pytest.mark.parametrize("two, split, dtype", [(True, False, torch.float32), (False, False, torch.float32),
                                               (True, True, torch.float16), (False, True, torch.bfloat16)])
def test_scratch_product_matches_float64(two, split, dtype):
    """``dst[rows[i]] = Σ_p coef[p, i] @ W_p (+ bias)`` over two H splits; other rows untouched."""
    gen = torch.Generator().manual_seed(3)
    m, d, h, r_cap = 40, 24, 200, 32  # bh = 16: split_count(200, 16) = 2 splits
    flags = torch.zeros(m, dtype=torch.bool)
    flags[[0, 5, 17, 18, 39]] = True
    rows, n_dense = dense_list(flags.to(DEV))
    coef = torch.randn(2, r_cap, h, generator=gen)
    coef[:, 2, 7] = float("inf")  # hi + lo keeps Inf (lo is 0 there), as one IEEE product would
    weights = [torch.randn(h, d, generator=gen).to(dtype) for _ in range(2 if two else 1)]
    bias = torch.randn(d, generator=gen)
    dst = torch.full((m, d), 7.0, dtype=dtype)
    ours = dst.to(DEV)
    scratch_product(coef.to(DEV), rows, n_dense, [w.to(DEV) for w in weights], ours, bias.to(DEV),
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

def test_scratch_capacity_covers_the_budget_and_the_dispatch_limit():
    """A multiple of BR rows: SCRATCH_BYTES' worth, or DENSE_ROW_FRACTION_MAX of the rows when
    that is more, never more than M rounded up; an explicit request wins (tests)."""
    per_row = 4 * 3 * 5632  # the backward's three fp32 coefficient planes at H = 5632
    budget = SCRATCH_BYTES // per_row // BR * BR
    assert budget == 496
    assert scratch_capacity(16384, per_row) == 496  # 2% of the rows: 336
    big = scratch_capacity(65536, per_row)  # 2% is 1311
    assert big == 1312 and big % BR == 0 and big >= DENSE_ROW_FRACTION_MAX * 65536
    assert scratch_capacity(100, per_row) == 112  # M rounded up to BR
    assert scratch_capacity(16384, per_row, requested=20) == 32
    assert scratch_capacity(16384, per_row, requested=0) == 0
    assert scratch_capacity(16384, 1 << 40) == 336  # a tiny budget: still 2% of the rows
