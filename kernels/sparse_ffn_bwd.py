"""TwELL training backward: every product restricted to the stored (token, neuron) pairs.

Math (``reference.ffn_backward_ref``). For every stored pair ``(t, j)`` of a row that is not dense,
with ``g`` the packed pre-activation (gate for a gated FFN, up for a plain one) and ``u`` the up
value the forward kept (``up_val``):

* ``h = relu(g) · u`` (gated) or ``relu(g)`` (plain);
* ``dh = dout_t · Wd[:, j] + (l1_scale / M) · sign(h)`` (a sampled dense-dense product plus the L1
  gradient of docs/architecture.md, 'The L1 regularizer'; ``sign(NaN) = 0`` as in ``torch.sign``);
* gated: ``dgate = 0 if g <= 0 else dh · u`` (NaN passes) and ``dup = dh · relu(g)``;
  plain: ``dup = 0 if g <= 0 else dh``;
* ``dx_t += dgate · Wg_j + dup · Wu_j``, ``dWg_j += dgate · x_t``, ``dWu_j += dup · x_t``,
  ``dWd[:, j] += h · dout_t``, ``dbg_j += dgate``, ``dbu_j += dup``; ``dbd = Σ_t dout_t``.

Rows flagged in ``dense_rows`` (overflowed tiles, the finiteness guard) use the same formulas over
all H, with the gate and up values recomputed from ``x``. Arithmetic is fp32; each output is rounded
once, to its input's dtype. Nothing synchronises the host, every buffer has a capacity fixed by the
shapes, and every output element has exactly one writer, so results are deterministic and the
whole backward can be captured in a CUDA graph.

``sparse_ffn_backward`` launches, in order:

1. ``neuron_major``: the stored pairs of the sparse rows grouped by neuron (a counting sort on the
   device), and the neurons by decreasing pair count;
2. ``tokens_bwd``: ``dh`` at every stored pair, then the sparse rows' ``dx`` (token-major pair loops);
3. ``dense_rows_bwd``: the dense rows' coefficients into a scratch, their ``dx``, and with
   ``dense_wgrad_gemm`` their share of the weight gradients as GEMMs;
4. ``wgrad``: the weight and bias gradients, neuron-major.

Bytes, 16-bit tensors (``e = 2``), ``P`` stored pairs (``a`` per token): the tokens kernels gather
3 weight rows per pair, ``3·D·e`` (12 KiB at D = 2048), and move ``2·D·e`` per token; the
weight-gradient kernel gathers 2 rows per pair, ``2·D·e``, and writes ``3·H·D·e``; the pair lists
take ``2·M·n_tiles·4 + 3·P·4`` plus ``H·M/64·16``; ``Wdᵀ``: the launcher copies
``weights.transposed(wd)`` (``2·H·D·e``) unless ``wd`` already is a transposed view of a contiguous
``[H, D]`` tensor. At M = 16384, D = 2048, H = 5632, 0.5 % density (a = 28, P = 0.46 M) that is
5.7 GB + 3.8 GB of gathered rows (≈ 1.05 ms at the ~9 TB/s L2 rate measured for the forward
gather, docs/benchmarks.md, 'Floors and targets'), against 2.27 TFLOP (≈ 3.4 ms) for the six
dense backward GEMMs.

Scratch: ``dh`` and the pair list (``M·n_tiles·slots·4`` B each: 46 MB at the shape above), the
dense-row coefficients (≤ 32 MiB), ``Wdᵀ``.
"""

from __future__ import annotations

from typing import Optional

import torch

from .checks import check_ffn_operands, check_packed, check_row_list, check_tensor
from .dense_rows_bwd import dense_rows_backward
from .format import DEFAULT_LAYOUT, TwellLayout, TwellPacked
from .neuron_major import neuron_major
from .pair_walk import overflow_threshold
from .reference import Grads, backward_dense_rows_ref, may_overflow
from .row_lists import RowList, dense_list
from .tokens_bwd import tokens_backward
from .triton_helpers import INTERPRET, rowmajor
from .weights import transposed
from .wgrad import weight_grads

# From this many dense rows in a call, dense_wgrad_gemm pays (a training step on the H200 pays ~11
# us per dense row without it; the partial's write and read cost ~0.1 ms).
DENSE_WGRAD_GEMM_ROWS = 8


def backward_dense_rows(
    dout, x, wg, wu, wd, bg, bu, bd, packed: TwellPacked, forward_rows: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """bool ``[M]``: the rows the backward computes densely (``reference.backward_dense_rows_ref``).

    Device ops only, no host synchronisation. ``forward_rows`` may pass the forward's guard rows
    (``reference.dense_rows_ref``, or ``sparse_ffn.guard_rows`` which leaves out the overflow rows):
    then the weights are not re-checked, and only the overflow rows and the ``dout`` terms are added.
    """
    if forward_rows is None:
        return backward_dense_rows_ref(dout, x, wg, wu, wd, bg, bu, bd, packed)
    rows = forward_rows | packed.overflow_rows() | ~torch.isfinite(dout).all(-1)
    if wg is not None and x.shape[0] > 0:
        rows |= may_overflow(dout, wd.T, None, dout.dtype)
    return rows


def sparse_ffn_backward(
    dout: torch.Tensor,
    x: torch.Tensor,
    wg: Optional[torch.Tensor],
    wu: torch.Tensor,
    wd: torch.Tensor,
    bg: Optional[torch.Tensor],
    bu: Optional[torch.Tensor],
    bd: Optional[torch.Tensor],
    packed: TwellPacked,
    up_val: torch.Tensor,
    dense_rows: torch.Tensor,
    l1_scale: torch.Tensor,
    *,
    layout: TwellLayout = DEFAULT_LAYOUT,
    dense_scratch_rows: Optional[int] = None,
    dense_wgrad_gemm: bool = False,
    row_list: Optional[RowList] = None,
    reuse_tickets: bool = False,
    check: bool = True,
) -> Grads:
    """Gradients of ``(out · dout).sum() + l1_scale · (1/M) Σ|h|`` for a TwELL FFN.

    Equals ``reference.ffn_backward_ref`` with the same ``dense_rows`` up to fp32 summation order,
    without synchronising the host.

    Args:
        dout: ``[M, D]`` gradient of the output, dtype of x.
        x: ``[M, D]`` float16/bfloat16/float32 input of the forward.
        wg: ``[H, D]`` gate weight (dtype of x), or ``None`` for a plain FFN.
        wu: ``[H, D]`` up weight; wd: ``[D, H]`` down weight (``nn.Linear`` layouts, dtype of x).
        bg, bu, bd: optional biases ``[H]``, ``[H]``, ``[D]`` (any float dtype); a gradient is
            returned for each one given, ``None`` otherwise.
        packed: the forward's TwELL buffer (gate pre-activation for gated, up for plain), fp32
            values, in ``layout``; it must be a valid buffer (``format.py``).
        up_val: fp32 ``[M, n_tiles, slots]`` up values at the stored slots of the sparse rows
            (read nowhere else, so other slots may hold anything; gated); ignored (may be empty)
            for a plain FFN.
        dense_rows: bool ``[M]``: rows computed by the dense formulas, with the semantics of
            ``reference.backward_dense_rows_ref`` (``backward_dense_rows`` computes it). It must
            include every overflowed row: their stored slots are incomplete.
        l1_scale: 0-d float tensor on x's device, the layer's ``l1_coeff · l1_factor`` (read on the device).
        layout: the TwELL layout of ``packed``.
        dense_scratch_rows: dense rows whose coefficients are kept in scratch (default: a 32 MiB
            budget); rows past it are recomputed (exact, slower). Tests use small values.
        dense_wgrad_gemm: sum the scratch rows' weight gradients as GEMMs into an fp32
            ``[planes, H, D]`` buffer (138 MB at D=2048, H=5632, gated) that the neuron-major
            kernel reads, instead of gathering each dense row's ``x`` and ``dout`` once per
            neuron. Faster from a few dense rows on (``DENSE_WGRAD_GEMM_ROWS``), for that memory.
            The caller guesses, e.g. from the previous call's dense rows: either way the result is
            the same up to fp32 summation order (and the ``hi + lo`` split of bf16 coefficients).
        row_list: ``dense_rows`` already listed on the device (``row_lists.flag_rows(...,
            with_list=True)``); otherwise listed here, one launch.
        reuse_tickets: the dense rows' split sums take their tickets from a kept buffer
            (``tickets.zeroed_scratch``) instead of a fresh fill.
        check: validate the arguments; False where the caller has (the TwELL ops check theirs
            once a call).

    Returns:
        ``reference.Grads`` in the input dtypes, each contiguous. ``dwd`` is made from the ``[H, D]``
        rows of ``dWdᵀ`` the kernel writes by one tiled transpose (``weights.transposed``).

    Example::

        res = reference.ffn_forward_ref(x, wg, wu, wd, bg, bu, bd)
        rows = backward_dense_rows(dout, x, wg, wu, wd, bg, bu, bd, res.packed)
        grads = sparse_ffn_backward(dout, x, wg, wu, wd, bg, bu, bd, res.packed, res.up_val, rows, scale)
    """
    # 1. Check shapes, dtypes and devices (``check=False``: the caller has).
    if check:
        _check_args(dout, x, wg, wu, wd, bg, bu, bd, packed, up_val, dense_rows, l1_scale, layout, dense_scratch_rows,
                    row_list)
    m, d, h = x.shape[0], x.shape[1], wu.shape[0]
    dev = x.device
    gated = wg is not None
    n_tiles, slots = layout.n_tiles(h), layout.slots

    # 2. Allocate the outputs and the scratch.
    dx = torch.empty(m, d, dtype=x.dtype, device=dev)
    dwg = torch.empty(h, d, dtype=wg.dtype, device=dev) if gated else None
    dwu = torch.empty(h, d, dtype=wu.dtype, device=dev)
    dwdt = torch.empty(h, d, dtype=wd.dtype, device=dev)
    dbg = torch.empty(h, dtype=bg.dtype, device=dev) if bg is not None else None
    dbu = torch.empty(h, dtype=bu.dtype, device=dev) if bu is not None else None
    dbd = dout.sum(0, dtype=torch.float32).to(bd.dtype) if bd is not None else None
    if m == 0 or d == 0 or h == 0:
        for t in (dx, dwg, dwu, dwdt, dbg, dbu):
            if t is not None:
                t.zero_()
        return Grads(dx, dwg, dwu, transposed(dwdt), dbg, dbu, dbd)

    scale = (l1_scale.to(torch.float32) / m).reshape(())  # the reference's l1_scale / max(1, M)
    x, dout, wu = rowmajor(x), rowmajor(dout), rowmajor(wu)
    wg_ = rowmajor(wg) if gated else wu
    wdt = transposed(wd)  # [H, D]: column j of Wd as a contiguous row (no copy if wd = wdt.t())
    idx, val, count = packed.idx.contiguous(), packed.val.contiguous(), packed.count.contiguous()
    up = up_val.contiguous() if gated else val
    dense_rows = dense_rows.contiguous()
    dense_u8 = dense_rows.view(torch.uint8)
    dummy = val  # stands in for absent biases; never read
    bg_, bu_ = (bg if bg is not None else dummy), (bu if bu is not None else dummy)
    dh = torch.empty(m, n_tiles, slots, dtype=torch.float32, device=dev)

    # 3. Launch: the pair lists, sparse rows (dh, dx), dense rows (scratch, dx), then the weight gradients.
    pairs = neuron_major(TwellPacked(idx, val, count), dense_rows, h, layout=layout)
    listed = dense_list(dense_rows, check=check) if row_list is None else row_list
    flags = dict(GATED=gated, HAS_BG=bg is not None, HAS_BU=bu is not None)
    ovf = overflow_threshold(x.dtype)  # the stored pre-activations' overflow (pair_walk.overflow_up)
    tokens_backward(dout, wg_, wu, wdt, idx, val, up, count, dense_u8, scale, dh, dx, gated=gated, ovf=ovf)
    scratch = dense_rows_backward(x, dout, wg_, wu, wdt, bg_, bu_, scale, listed, dx, flags=flags,
                                  scratch_rows=dense_scratch_rows, wgrad_gemm=dense_wgrad_gemm,
                                  reuse_tickets=reuse_tickets, dummy=dummy)
    weight_grads(x, dout, val, up, dh, pairs, scratch, listed, wg_, wu, wdt, bg_, bu_, scale, dwg, dwu, dwdt, dbg, dbu,
                 flags=flags, ovf=ovf, reuse_tickets=reuse_tickets, dummy=dummy)
    return Grads(dx, dwg, dwu, transposed(dwdt), dbg, dbu, dbd)


def _check_args(dout, x, wg, wu, wd, bg, bu, bd, packed, up_val, dense_rows, l1_scale, layout, dense_scratch_rows,
                row_list) -> None:
    """``sparse_ffn_backward``'s argument checks: errors that name the argument at fault."""
    m, d, h = check_ffn_operands(x, wg, wu, wd, bg, bu, bd, dout=dout)
    dev = x.device
    check_packed(packed, m, h, layout, dev)
    n_tiles, slots = layout.n_tiles(h), layout.slots
    if wg is not None:
        check_tensor("up_val", up_val, (m, n_tiles, slots), (torch.float32,), dev)
    check_tensor("dense_rows", dense_rows, (m,), (torch.bool,), dev)
    if row_list is not None:
        check_row_list(row_list, m, dev)
    if not isinstance(l1_scale, torch.Tensor) or l1_scale.numel() != 1 or not l1_scale.is_floating_point():
        raise ValueError(f"l1_scale must be a 0-d float tensor, got {getattr(l1_scale, 'shape', type(l1_scale).__name__)}")
    if l1_scale.device != dev:
        raise ValueError(f"l1_scale is on {l1_scale.device} but x is on {dev}")
    if dense_scratch_rows is not None and dense_scratch_rows < 0:
        raise ValueError(f"dense_scratch_rows must be >= 0, got {dense_scratch_rows}")
    if not INTERPRET and dev.type != "cuda":
        raise ValueError(f"x must be a CUDA tensor (or set TRITON_INTERPRET=1), got device {dev}")
