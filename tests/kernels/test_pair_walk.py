"""kernels/pair_walk.py: which rows the pair loops read as int32 pairs of bf16 elements.

The walk itself and the pair reads run inside the kernels that use them: tests/kernels/test_sparse_ffn.py
and test_sparse_ffn_bwd.py pin both walks and both reads to each other bitwise.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # before the kernel modules are imported (docs/architecture.md, 'Testing')
    os.environ.setdefault("TRITON_INTERPRET", "1")

from twell_compile.kernels.pair_walk import paired  # noqa: E402


def test_which_rows_are_read_as_pairs():
    """Pairs need bf16, an even row length, even row strides and 4-byte aligned rows."""
    rows = torch.zeros(4, 10, dtype=torch.bfloat16)
    assert paired(rows, rows[:, :8])
    assert not paired(rows.half())  # fp16 widening is no bit operation
    assert not paired(rows[:, :7])  # odd length
    assert not paired(torch.zeros(4, 11, dtype=torch.bfloat16)[:, :10])  # odd row stride
    assert not paired(rows[:, 1:9])  # starts 2 bytes into a pair
