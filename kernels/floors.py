"""The sparse part's floor for ``twell bench --floors``: the bytes it must move, moved by the
simplest loop.

For every active pair ``(t, j)`` the inference op's sparse part (``sparse_ffn``) must read row ``j``
of ``Wu`` and row ``j`` of ``Wdᵀ`` (``2·D·e`` bytes, 8 KiB at D=2048 in bf16), and per token the
``x`` row and the output row. ``gather_floor`` reads exactly those bytes with no TwELL walk, no dot
product and no reduction: one program per token, its pairs from a CSR list (``active_pairs``),
``out_t = x_t + Σ_j Wu_j ⊙ Wdᵀ_j`` (element-wise, fp32). It is not an FFN; its result only keeps
the compiler from dropping the loads (and lets tests check that every row was read). Its time
plus the dense gate GEMM's is the floor the bench reports beside the op: what the TwELL design
would cost if both kernels ran at the rate of these two.

One program of 4 warps per token with the whole ``D`` row in registers, the naive loop of
docs/benchmarks.md, 'Floors and targets'. On the H200 at D=2048, H=5632, M=16384, 0.5% density it
takes 0.426 ms with 4 warps, 0.417 with 8, 0.450 with 2 and 0.503 with 1: the reported floor is
within ~2% of this loop's best. The x and output rows stream through L2 as ``evict_first``, as
in ``sparse_ffn``, which leaves L2 to the weight rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import FLOAT_DTYPES, check_matrix, check_tensor
from .launch import launch, next_power_of_2
from .triton_helpers import INTERPRET


@triton.jit
def _gather_floor_kernel(x_ptr, row_ptr, cols_ptr, wu_ptr, wdt_ptr, out_ptr, D, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    in_d = offs < D
    acc = tl.load(x_ptr + t * D + offs, mask=in_d, other=0.0, eviction_policy="evict_first").to(tl.float32)
    start = tl.load(row_ptr + t)
    end = tl.load(row_ptr + t + 1)
    for k in range(start, end):
        j = tl.load(cols_ptr + k).to(tl.int64)
        u = tl.load(wu_ptr + j * D + offs, mask=in_d, other=0.0)
        w = tl.load(wdt_ptr + j * D + offs, mask=in_d, other=0.0)
        acc += u.to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + t * D + offs, acc.to(out_ptr.dtype.element_ty), mask=in_d, eviction_policy="evict_first")


def active_pairs(active: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(row_ptr [M + 1] int64, cols [nnz] int32)``: the CSR list of ``active [M, H]`` (bool),
    each row's columns in increasing order."""
    check_matrix("active", active, "[M, H]")
    if active.dtype != torch.bool:
        raise TypeError(f"active must be a bool tensor, got {active.dtype}")
    per_row = active.sum(dim=1)
    row_ptr = torch.zeros(active.shape[0] + 1, dtype=torch.int64, device=active.device)
    torch.cumsum(per_row, dim=0, out=row_ptr[1:])
    cols = active.nonzero()[:, 1].to(torch.int32)  # row-major order: by row, then by column
    return row_ptr, cols


def gather_floor_ref(x: torch.Tensor, row_ptr: torch.Tensor, cols: torch.Tensor, wu: torch.Tensor,
                     wd_t: torch.Tensor) -> torch.Tensor:
    """``gather_floor`` in PyTorch: each row's products summed in fp32 (float64 for float64
    inputs), in ``cols`` order, then cast to x's dtype."""
    acc_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    rows = torch.repeat_interleave(torch.arange(x.shape[0], device=x.device), row_ptr.diff())
    j = cols.long()
    acc = x.to(acc_dtype).index_add(0, rows, wu[j].to(acc_dtype) * wd_t[j].to(acc_dtype))
    return acc.to(x.dtype)


def gather_floor(x: torch.Tensor, row_ptr: torch.Tensor, cols: torch.Tensor, wu: torch.Tensor,
                 wd_t: torch.Tensor) -> torch.Tensor:
    """``out_t = x_t + Σ_{j in cols of row t} wu[j] ⊙ wd_t[j]`` (fp32, cast to x's dtype): the
    bytes the sparse part reads, read once (module docstring).

    Args:
        x: ``[M, D]`` float16/bfloat16/float32 rows, contiguous.
        row_ptr, cols: ``active_pairs``' CSR list of each token's active neurons (``cols`` < H).
        wu: ``[H, D]`` up weight (``nn.Linear`` layout); wd_t: ``[H, D]``, the down weight
            transposed (``Wdᵀ``, contiguous, as the op keeps it). Both of x's dtype.
    """
    check_matrix("x", x, "[M, D]")
    m, d = x.shape
    check_matrix("wu", wu, "[H, D]")
    h = wu.shape[0]
    check_tensor("x", x, (m, d), FLOAT_DTYPES, x.device)
    check_tensor("wu", wu, (h, d), (x.dtype,), x.device)
    check_tensor("wd_t", wd_t, (h, d), (x.dtype,), x.device)
    check_tensor("row_ptr", row_ptr, (m + 1,), (torch.int64,), x.device)
    if not isinstance(cols, torch.Tensor) or cols.dim() != 1:
        raise ValueError(f"cols must be a 1-D tensor [nnz], got {getattr(cols, 'shape', type(cols).__name__)}")
    check_tensor("cols", cols, cols.shape, (torch.int32,), x.device)
    for name, t in (("x", x), ("wu", wu), ("wd_t", wd_t)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    if not INTERPRET and x.device.type != "cuda":
        raise ValueError(f"x must be a CUDA tensor (or set TRITON_INTERPRET=1), got device {x.device}")
    out = torch.empty_like(x)
    if m == 0 or d == 0:
        return out
    launch(_gather_floor_kernel, (m,), x, row_ptr, cols, wu, wd_t, out, d, BLOCK_D=next_power_of_2(d), num_warps=4)
    return out


KERNELS = {"gather_floor": _gather_floor_kernel}
