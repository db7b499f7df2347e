"""The CUDA ops' sparse path: ``gate_pack`` (the gate GEMM packs TwELL in its epilogue), then
``sparse_ffn`` (up and down for the active neurons only) and, in training, ``sparse_ffn_backward``.

Rows that overflow a TwELL tile, and rows the finiteness guard flags (``kernels.reference``,
"Exactness guard"), are computed densely, so the result is the dense FFN's for every input.
"""

from __future__ import annotations

from typing import Optional

import torch

from twell_compile.kernels import (
    DEFAULT_LAYOUT,
    DENSE_WGRAD_GEMM_ROWS,
    TwellPacked,
    flag_rows,
    gate_pack,
    reference,
    sparse_ffn,
    sparse_ffn_backward,
)

from . import cuda_graphs, dispatch_policy
from .handoff import take_saved
from .weight_cache import WeightPrep


def sparse_forward(x2d, wg, wu, wd, bg, bu, bd, training: bool, want_l1: bool,
                   record=None, *, keep: bool = True, prep: Optional[tuple] = None) -> reference.ForwardResult:
    """The sparse forward. ``record`` (telemetry's ``call_record``) receives the active entries and
    the rows computed densely. In training the pair loop also sums each row's ``|h|``
    (``sparse_ffn``'s ``l1_rows``), over the rows it computes, and ``want_l1`` sums those into the
    L1 value. ``dense_rows`` of the result is None (the counts mark those rows as overflowed).
    ``keep=False``: cache nothing per weight (``WeightPrep``): layers compiled for CUDA graphs.
    ``prep``: ``WeightPrep.get``'s, if the caller has it."""
    gated = wg is not None
    # Inference keeps the TwELL buffer inside the op and reads it as 8-byte (idx, val) slots;
    # training returns idx and val from twell::ffn_train, whose schema has them as two contiguous
    # tensors.
    paired = not training
    # The op checked its arguments, and the rest are made here: the launchers check nothing again
    # (~50 µs of host time an inference call, ~160 µs a training step, on a 2-core CPU).
    packed = gate_pack(x2d, wg, bg, paired=paired, check=False) if gated else gate_pack(x2d, wu, bu, paired=paired, check=False)
    if prep is None:
        prep = WeightPrep.get(wg, wu, wd, bg, bu, bd, keep=keep)  # once: uncached, it is a launch
    forward_bound, _, wd_rows = prep
    # The finiteness guard, in the pair loop's kernel from the x rows it loads anyway: a non-finite
    # row has a non-finite norm, and for gated FFNs ‖x_t‖·max‖Wu_j‖ + max|bu| bounds the up
    # projection (a huge finite row is flagged too, which only costs speed). It marks the rows it
    # sends dense in the counts, where the backward finds them, and stores the call's record.
    rows = dict(wg=wg, bg=bg, guard_bound=forward_bound, record=record, mark=True, check=False)
    l1 = None
    if training:  # the backward needs the up values at the stored pairs
        # Every training call stores the L1 shares (one kernel variant, so none is first compiled
        # inside a CUDA-graph capture); only the calls that measure L1 sum them.
        l1_rows = torch.empty(x2d.shape[0], dtype=torch.float32, device=x2d.device)
        out, up_val = sparse_ffn(x2d, packed, wu, wd_rows, bu, bd, **rows, return_up=True, reuse_tickets=keep,
                                 l1_rows=l1_rows)
        if want_l1:
            l1 = l1_rows.sum() / max(1, x2d.shape[0])  # the sparse rows' share
    else:
        out, up_val = sparse_ffn(x2d, packed, wu, wd_rows, bu, bd, **rows, reuse_tickets=keep), None
    return reference.ForwardResult(out, packed, up_val, None, l1)


def sparse_backward(dout2d, x2d, wg, wu, wd, bg, bu, bd, packed: TwellPacked, up_val, l1_scale, *,
                    layer: Optional[int] = None, prep: Optional[tuple] = None,
                    gemm: Optional[bool] = None) -> reference.Grads:
    """Gradients of ``loss + l1_scale · L1`` after a sparse forward (``layer``: the forward's, when
    known; a layer compiled for CUDA graphs caches nothing per weight). ``prep`` (the forward's
    ``WeightPrep``) and ``gemm`` (``dense_wgrad_gemm``'s answer), when the caller has them."""
    key = packed.count.data_ptr()
    keep = layer not in cuda_graphs.CUDA_GRAPH_LAYERS
    # the forward's under capture; else once here (cached unless the layer is compiled for CUDA
    # graphs or its weights are gathered per call)
    prep = prep or take_saved(key, dense=False) or WeightPrep.get(wg, wu, wd, bg, bu, bd, keep=keep, layer=layer)
    _, backward_bound, wd_rows = prep
    dense_rows, listed = backward_guard_rows(dout2d, backward_bound, packed, keep=keep)
    if gemm is None:
        gemm = dense_wgrad_gemm(layer, x2d)
    args = (dout2d, x2d, wg, wu, wd_rows, bg, bu, bd, packed, up_val, dense_rows, l1_scale)
    grads = sparse_ffn_backward(*args, dense_wgrad_gemm=gemm, row_list=listed, reuse_tickets=keep, check=False)
    signature = ("backward", *dispatch_policy.problem_signature(x2d, wg, wu, bg, bu, bd, True))
    if not cuda_graphs.capturing() and signature not in dispatch_policy.WARM:
        tune_other_wgrad(args, gemm, listed, keep)
        dispatch_policy.WARM.add(signature)
    return grads


def dense_wgrad_gemm(layer: Optional[int], x2d) -> bool:
    """Whether the backward sums the dense rows' weight gradients as GEMMs (an fp32 ``[planes, H,
    D]`` buffer): when the layer's last measured call had ``DENSE_WGRAD_GEMM_ROWS`` of them or
    more. The same result either way."""
    policy = None if layer is None else dispatch_policy.layer_policy(layer, x2d.device, create=False)
    return policy is not None and policy.expects_dense_rows(x2d.shape[0], DENSE_WGRAD_GEMM_ROWS)


def tune_other_wgrad(args: tuple, gemm: bool, listed, keep: bool) -> None:
    """Run the problem's first sparse backward once more with the other weight-gradient variant
    (with or without the dense rows' GEMM buffer), result discarded, so that both are compiled and
    tuned at the start: each variant tunes on its first call, 4.5 and 6.4 s on the H200 at the 2B
    shape, which would otherwise fall in the middle of training, on the step where a layer first
    had ``DENSE_WGRAD_GEMM_ROWS`` dense rows. Out of memory here only leaves it for later."""
    try:
        sparse_ffn_backward(*args, dense_wgrad_gemm=not gemm, row_list=listed, reuse_tickets=keep, check=False)
    except torch.cuda.OutOfMemoryError:
        pass


def backward_guard_rows(dout, backward_bound, packed: TwellPacked, *, keep: bool = True):
    """``(bool [M], RowList)``: backward dense rows and their list, in one kernel: rows with an
    overflowed tile (which include the rows the forward's guard sent dense, marked in the counts by
    ``sparse_ffn``'s guard, and every row of a dense forward), and rows of ``dout`` that are
    non-finite or, gated, whose ``dh = dout·Wd`` may overflow (``backward_bound``: ``WeightPrep``'s)."""
    return flag_rows(dout, backward_bound, count=packed.count, slots=DEFAULT_LAYOUT.slots, flag_overflow=True,
                     with_list=True, reuse_tickets=keep, check=False)
