"""The dense path's element-wise steps, one memory pass each way.

Forward (``dense_activation``): ``h = relu(gate) · up`` (gated) or ``h = relu(up)`` (plain), with
the call's counters taken on the way. Backward (``dense_activation_backward``): the L1 term added
to ``dh``, then ``d_gate`` and ``d_up``.

Eager PyTorch spends two memory passes on this step: ``relu`` reads and writes ``[M, H]``, then
the product reads two ``[M, H]`` tensors and writes one (5 passes of ``M·H·e`` bytes). This kernel
reads ``gate`` and ``up`` once and writes ``h`` (3 passes; 4 with ``relu(gate)`` stored for the
training backward). On the way it counts, per row, the active entries of every ``tile_n``-column
tile (``not (gate <= 0)``, as ``format.is_active``), so the telemetry gets the exact active count
and the rows that would overflow a TwELL tile, and, when asked, ``Σ|h|`` for the L1 value.

The backward's eager form, ``dh.addcmul_(sign(h), coef)``, ``threshold_backward(dh * up, act, 0)``
and ``dh.mul_(act)``, makes ~14 passes over ``[M, H]`` tensors (``sign`` and every product
materialise one); ``dense_activation_backward`` reads ``dh``, ``h``, ``up`` and ``act`` once and
writes ``d_gate`` and ``d_up`` (6 passes), ``d_up`` into ``dh``'s storage as eager does.

Arithmetic is eager PyTorch's: ``relu`` keeps NaN, ``sign(NaN)`` is 0, ``threshold_backward``
zeroes the gradient where ``act <= 0``, and each element-wise op on 16-bit values is taken in fp32
and rounded once to the input dtype (fp64 in fp64), so the results equal eager's bitwise, up to
the sign of zeros.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .checks import check_tensor
from .format import DEFAULT_LAYOUT, TwellLayout
from .launch import cdiv, launch
from .tickets import CallRecord, check_record, finish_call, record_without_kernel

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# Rows per program: 8 rows x 128 columns of 16-bit values are one 16-byte vector per thread and
# load at 4 warps. Every row's tiles stay in one program, so a row's overflow flag needs no atomics.
ROWS_PER_PROGRAM = 8


@triton.jit
def _dense_act_kernel(
    # pointers
    pre_ptr, up_ptr, h_ptr, act_ptr, values_ptr, scratch_ptr, l1_ptr,
    # dimensions, row strides (elements)
    M, H, N_TILES, stride_p, stride_u, stride_h, stride_a,
    # meta-parameters
    GATED: tl.constexpr, STORE_ACT: tl.constexpr, COUNT: tl.constexpr, FLAG: tl.constexpr, L1: tl.constexpr,
    FP64: tl.constexpr, SLOTS: tl.constexpr, TILE_N: tl.constexpr, BM: tl.constexpr,
):
    """``h[r] = relu(pre[r]) (· up[r])`` for the ``BM`` rows of this program, tile by tile.

    STORE_ACT: also ``act = relu(pre)``. COUNT: the call's record (``tickets.finish_call``): the
    active entries, and the rows with a tile of more than SLOTS of them. L1: ``l1[0] += Σ|h|``
    (float32).
    """
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    r_ok = rows < M
    rows = rows.to(tl.int64)
    offs = tl.arange(0, TILE_N)
    n_active = tl.full([BM], 0, tl.int32)
    n_over = tl.full([BM], 0, tl.int32)
    l1 = tl.full([BM], 0.0, tl.float32)
    for tile in range(0, N_TILES):
        cols = tile * TILE_N + offs
        mask = r_ok[:, None] & (cols < H)[None, :]
        pre = tl.load(pre_ptr + rows[:, None] * stride_p + cols[None, :], mask=mask, other=0.0)
        act = tl.where(pre <= 0, 0.0, pre).to(pre.dtype)  # relu that keeps NaN, as torch.relu does
        if GATED:
            up = tl.load(up_ptr + rows[:, None] * stride_u + cols[None, :], mask=mask, other=0.0)
            if FP64:
                hv = act * up
            else:  # eager's opmath: fp32 product, one rounding to the input dtype
                hv = (act.to(tl.float32) * up.to(tl.float32)).to(pre.dtype)
            if STORE_ACT:
                tl.store(act_ptr + rows[:, None] * stride_a + cols[None, :], act, mask=mask)
        else:
            hv = act
        tl.store(h_ptr + rows[:, None] * stride_h + cols[None, :], hv, mask=mask)
        if COUNT:
            active = tl.sum(tl.where(pre <= 0, 0, 1), axis=1)  # not (pre <= 0); masked entries load 0
            n_active += active
            n_over += (active > SLOTS).to(tl.int32)
        if L1:
            l1 += tl.sum(tl.abs(hv.to(tl.float32)), axis=1)
    if L1:
        tl.atomic_add(l1_ptr, tl.sum(l1, axis=0))
    if COUNT:
        finish_call(values_ptr, scratch_ptr, tl.sum(n_active, axis=0), tl.sum((n_over > 0).to(tl.int32), axis=0),
                    M, FLAG)


def dense_activation(
    pre: torch.Tensor,
    up: Optional[torch.Tensor] = None,
    *,
    store_act: bool = False,
    record: Optional[CallRecord] = None,
    l1: Optional[torch.Tensor] = None,
    layout: TwellLayout = DEFAULT_LAYOUT,
    check: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(h, act)`` of a dense FFN's hidden layer: ``act = relu(pre)``, ``h = act · up`` (gated) or
    ``h = act`` (plain, ``up=None``), in ``pre``'s dtype, as eager ``torch.relu(pre) * up``.

    Args:
        pre: ``[M, H]`` gate pre-activation (gated) or up pre-activation (plain), float16/bfloat16/
            float32/float64.
        up: ``[M, H]`` up projection of a gated FFN, same dtype and device; None for a plain one.
        store_act: gated only: also write ``act`` (the training backward needs it). Otherwise the
            returned ``act`` is ``h`` (plain) or None (gated).
        record: receives the call's record (``tickets.CallRecord``): the active entries and the
            rows with a tile of more than ``layout.slots`` active entries, in the same launch.
        l1: float32 ``[1]`` on the same device: receives ``+= Σ|h|``.
        layout: the TwELL tiles the overflow count is taken over.
        check: validate the arguments; False where the caller has (the TwELL ops check theirs
            once a call).
    """
    if check:
        _check_activation_args(pre, up, record, l1)
    m, h = pre.shape
    dev = pre.device
    gated = up is not None
    store_act = store_act and gated
    pre = pre if pre.stride(-1) == 1 else pre.contiguous()
    up = pre if not gated else (up if up.stride(-1) == 1 else up.contiguous())
    hid = torch.empty(m, h, dtype=pre.dtype, device=dev)
    act = torch.empty(m, h, dtype=pre.dtype, device=dev) if store_act else None
    if m and h:
        launch(_dense_act_kernel, (cdiv(m, ROWS_PER_PROGRAM),),
            pre, up, hid, hid if act is None else act, pre if record is None else record.values,
            pre if record is None else record.scratch, pre if l1 is None else l1,
            m, h, layout.n_tiles(h), pre.stride(0), up.stride(0), hid.stride(0), hid.stride(0) if act is None else act.stride(0),
            GATED=gated, STORE_ACT=store_act, COUNT=record is not None,
            FLAG=0.0 if record is None else float(record.flag), L1=l1 is not None,
            FP64=pre.dtype == torch.float64, SLOTS=layout.slots, TILE_N=layout.tile_n, BM=ROWS_PER_PROGRAM,
            num_warps=4,
        )
    elif record is not None:
        record_without_kernel(record, m)
    return hid, (act if gated else hid)


@triton.jit
def _dense_act_backward_kernel(
    dh_ptr, h_ptr, up_ptr, act_ptr, coef_ptr, dgate_ptr, N,
    GATED: tl.constexpr, FP64: tl.constexpr, BLOCK: tl.constexpr,
):
    """Over ``N`` contiguous elements: ``dh += sign(h) · coef`` (rounded to the dtype), then gated
    ``d_gate = 0 if act <= 0 else dh · up`` and ``d_up = dh · act`` (into ``dh``), plain
    ``d_up = 0 if act <= 0 else dh`` (into ``dh``)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    compute = tl.float64 if FP64 else tl.float32
    dh = tl.load(dh_ptr + offs, mask=mask, other=0.0)
    dtype = dh.dtype
    h = tl.load(h_ptr + offs, mask=mask, other=0.0)
    act = tl.load(act_ptr + offs, mask=mask, other=0.0)
    sign = tl.where(h > 0, 1.0, tl.where(h < 0, -1.0, 0.0)).to(compute)  # sign(NaN) = 0, as torch.sign
    coef = tl.load(coef_ptr).to(compute)
    dh = (dh.to(compute) + sign * coef).to(dtype)  # addcmul_: one rounding
    if GATED:
        up = tl.load(up_ptr + offs, mask=mask, other=0.0)
        d_gate = tl.where(act <= 0, 0.0, (dh.to(compute) * up.to(compute)).to(dtype)).to(dtype)
        tl.store(dgate_ptr + offs, d_gate, mask=mask)
        d_up = (dh.to(compute) * act.to(compute)).to(dtype)
    else:
        d_up = tl.where(act <= 0, 0.0, dh).to(dtype)
    tl.store(dh_ptr + offs, d_up, mask=mask)


def _check_activation_args(pre, up, record, l1) -> None:
    """``dense_activation``'s argument checks."""
    if not isinstance(pre, torch.Tensor) or pre.dim() != 2:
        raise ValueError(f"pre must be a 2-D tensor [M, H], got {getattr(pre, 'shape', type(pre).__name__)}")
    m, h = pre.shape
    dev = pre.device
    check_tensor("pre", pre, (m, h), _DTYPES, dev)
    if up is not None:
        check_tensor("up", up, (m, h), (pre.dtype,), dev)
    if record is not None:
        check_record(record, dev)
    if l1 is not None:
        check_tensor("l1", l1, (1,), (torch.float32,), dev)


def dense_activation_backward(
    dh: torch.Tensor, h: torch.Tensor, act: torch.Tensor, coef: torch.Tensor, up: Optional[torch.Tensor] = None, *,
    check: bool = True,
) -> tuple[Optional[torch.Tensor], torch.Tensor]:
    """``(d_gate, d_up)`` of the dense FFN's hidden layer, as dense autograd of
    ``loss + coef · Σ|h|`` computes them from ``dh = dout @ Wd``:

    * ``dh += sign(h) · coef``;
    * gated (``up`` given): ``d_gate = threshold_backward(dh · up, act, 0)``, ``d_up = dh · act``;
    * plain: ``d_up = threshold_backward(dh, act, 0)``, and ``d_gate`` is None.

    ``d_up`` is written into ``dh``'s storage (it is returned as ``dh``).

    Args:
        dh: ``[M, H]`` contiguous, float16/bfloat16/float32/float64; overwritten.
        h, act: ``[M, H]`` forward's ``h`` and ``relu(pre)``, dh's dtype (plain: the same tensor).
        coef: 0-d tensor of dh's dtype on its device: the L1 gradient's scale per ``|h|``.
        up: ``[M, H]`` up projection of a gated FFN; None for a plain one.
        check: validate the arguments; False where the caller has (the TwELL ops check theirs
            once a call).
    """
    if check:
        _check_activation_backward_args(dh, h, act, coef, up)
    gated = up is not None
    h, act = h.contiguous(), act.contiguous()
    up = up.contiguous() if gated else dh
    d_gate = torch.empty_like(dh) if gated else None
    n = dh.numel()
    if n:
        block = 2048
        launch(_dense_act_backward_kernel, (cdiv(n, block),),
            dh, h, up, act, coef, dh if d_gate is None else d_gate, n,
            GATED=gated, FP64=dh.dtype == torch.float64, BLOCK=block, num_warps=8,
        )
    return d_gate, dh


def _check_activation_backward_args(dh, h, act, coef, up) -> None:
    """``dense_activation_backward``'s argument checks."""
    if not isinstance(dh, torch.Tensor) or dh.dim() != 2:
        raise ValueError(f"dh must be a 2-D tensor [M, H], got {getattr(dh, 'shape', type(dh).__name__)}")
    m, hid = dh.shape
    dev = dh.device
    check_tensor("dh", dh, (m, hid), _DTYPES, dev)
    if not dh.is_contiguous():
        raise ValueError("dh must be contiguous: d_up is written into it")
    check_tensor("h", h, (m, hid), (dh.dtype,), dev)
    check_tensor("act", act, (m, hid), (dh.dtype,), dev)
    check_tensor("coef", coef, (), (dh.dtype,), dev)
    if up is not None:
        check_tensor("up", up, (m, hid), (dh.dtype,), dev)


KERNELS = {"dense_act": _dense_act_kernel, "dense_act_backward": _dense_act_backward_kernel}
