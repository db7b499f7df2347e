"""What the dense-row tests share: the check of a device-built row list, and a split-product problem."""

from __future__ import annotations

import torch

from twell_compile.kernels.row_lists import dense_list


def assert_lists(listed, flags):
    """``listed`` (a ``RowList``) holds exactly the rows ``flags`` sets, in increasing order."""
    expected = torch.nonzero(flags.cpu()).flatten().to(torch.int32)
    assert listed.n_dense.dtype == torch.int32 and listed.n_dense.shape == (1,)
    assert listed.n_dense.item() == expected.numel()
    assert torch.equal(listed.rows[: expected.numel()].cpu(), expected)


def split_problem(gen, h=4096, d=512, r_cap=256):
    """A split-product problem on the GPU: 200 listed rows of ``r_cap + 40``, two planes of fp32
    coefficients ``[2, r_cap, h]`` and two ``[h, d]`` weights (16 splits at ``bh=16``)."""
    flags = torch.zeros(r_cap + 40, dtype=torch.bool)
    flags[torch.randperm(r_cap + 40, generator=gen)[:200]] = True
    rows, n_dense = dense_list(flags.cuda())
    coef = torch.randn(2, r_cap, h, generator=gen).cuda()
    weights = [torch.randn(h, d, generator=gen).cuda() for _ in range(2)]
    return flags, rows, n_dense, coef, weights
