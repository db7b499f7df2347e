"""CUDA implementations of the TwELL ops: each call takes its layer's path (``dispatch_policy``),
runs it, and leaves what the next call and the backward need.

* **sparse** (``sparse_path``): ``gate_pack``, then ``sparse_ffn`` and, in training,
  ``sparse_ffn_backward``: the products of the active neurons only;
* **dense** (``dense_path``): cuBLAS through PyTorch, exactly the dense FFN.

Both compute the same function for every input (docs/architecture.md, 'Exactness contract').
A call records its counters in the layer's telemetry from its own kernels, starts their copy to
the host for the policy's next choice, hands a training forward's path and saved work to its
backward (``handoff``), and prepares the warm-up call of a layer compiled for CUDA graphs
(``capture``).
"""

from __future__ import annotations

from typing import Optional

import torch

from twell_compile.kernels import TwellPacked, reference

from . import call_replay, cuda_graphs, dispatch_policy, telemetry
from .capture import prepare_capture
from .dense_path import dense_backward, dense_forward
from .handoff import DENSE_FORWARDS, remember, take_saved
from .sparse_path import dense_wgrad_gemm, sparse_backward, sparse_forward
from .weight_cache import WeightPrep

# The training L1 value for stats() costs a reduction and a copy (two launches of host time): measure
# it every N eager calls, and on every call a CUDA graph records (a graph replays what its capture
# did, so one captured on a call that skipped it would never report L1).
L1_EVERY = 8


def forward(x2d, wg, wu, wd, bg, bu, bd, *, layer: int, training: bool):
    """Returns ``(ForwardResult, sparse: bool)`` and records the layer's counters.

    On the dense path the result's ``packed``/``up_val`` are None for inference and ``dense_rows``
    is None; the telemetry then counts the rows that would have overflowed a TwELL tile. On the
    sparse path too ``dense_rows`` is None (the counts mark them as overflowed).
    Either path's counting kernel stores the call's record in the layer's telemetry itself.
    """
    policy = dispatch_policy.layer_policy(layer, x2d.device)
    capturing = cuda_graphs.capturing()
    signature = dispatch_policy.problem_signature(x2d, wg, wu, bg, bu, bd, training)
    forced = dispatch_policy.FORCED_PATH
    keep = layer not in cuda_graphs.CUDA_GRAPH_LAYERS
    replay = call_replay.eligible(x2d, wu.shape[0], layer, capturing, keep)
    if forced is None:
        # With the graphs' memory share spent, a call with no graph yet would run its launches eagerly:
        # then the eager token limit holds for every call.
        cheap = replay and call_replay.has_room(x2d.device)
        sparse = dispatch_policy.takes_sparse(policy, x2d.shape[0], signature, training, capturing, cheap)
    else:
        sparse = forced == "sparse"
    sparse = sparse and x2d.dtype != torch.float64
    want_l1 = training and (capturing or policy.calls % L1_EVERY == 0)
    saved = None
    record = telemetry.call_record(layer, x2d.device, sparse)
    weights = (wg, wu, wd, bg, bu, bd)
    if sparse and replay:
        res, saved = _replayed_sparse_forward(x2d, weights, layer, training, want_l1, record, keep)
        dispatch_policy.WARM.add(("forward", *signature))
    elif sparse:
        prep = WeightPrep.get(wg, wu, wd, bg, bu, bd, keep=keep, layer=layer)
        res = sparse_forward(x2d, wg, wu, wd, bg, bu, bd, training, want_l1, record, keep=keep, prep=prep)
        if capturing:
            saved = prep  # the captured backward's, as nothing is cached under capture
        else:
            dispatch_policy.WARM.add(("forward", *signature))
    elif replay and not training:  # a dense training forward keeps [M, H] activations: not replayed
        out = call_replay.forward(layer, False, False, False, x2d, weights, record, lambda x, rec, ws: dense_forward(
            x, *ws, False, False, rec)[0].out)
        res = reference.ForwardResult(out, None, None, None, None)
    else:
        res, saved = dense_forward(x2d, wg, wu, wd, bg, bu, bd, training, want_l1, record)
    if training:
        remember(res.packed.count, not sparse, saved, layer)
    if res.l1 is not None:
        telemetry.record_l1(layer, res.l1)
        _record_fired(layer, res, saved, sparse, x2d.shape[0], wu.shape[0])
    policy.after(telemetry.buffer(layer, x2d.device), wu.shape[0])
    if not keep and not capturing and forced is None and x2d.dtype != torch.float64:
        prepare_capture(policy, x2d, wg, wu, wd, bg, bu, bd, sparse, training, signature, layer)
    return res, sparse


def _replayed_sparse_forward(x2d, weights: tuple, layer: int, training: bool, want_l1: bool, record, keep: bool):
    """The sparse forward through ``call_replay``: ``(result, hand-off)``. Inference reads the
    cached per-weight prep; a training graph makes its own (the weights change every step), which
    its backward then reads, handed off as a capture's is."""
    if not training:
        prep = WeightPrep.get(*weights, keep=keep, layer=layer)
        out = call_replay.forward(layer, True, False, False, x2d, weights, record, lambda x, rec, ws: sparse_forward(
            x, *ws, False, False, rec, prep=prep).out, prep)
        return reference.ForwardResult(out, None, None, None, None), None

    def launches(x, rec, ws):
        prep = WeightPrep.get(*ws, keep=keep, layer=layer)  # made in the graph: not cached under capture
        return sparse_forward(x, *ws, True, want_l1, rec, keep=keep, prep=prep), prep

    return call_replay.forward(layer, True, True, want_l1, x2d, weights, record, launches)


def _record_fired(layer: int, res, saved, sparse: bool, tokens: int, hidden: int) -> None:
    """The neurons that fired in a sampled training call: from the TwELL slots on the sparse path,
    from ``relu(gate)`` (the first activation the dense path keeps) on the dense one."""
    if sparse:
        telemetry.record_fired_packed(layer, res.packed, hidden, tokens)
    elif saved is not None:
        telemetry.record_fired(layer, (saved[0] > 0).any(dim=0), tokens)
    # else a layer compiled for CUDA graphs keeps no activations: not sampled on the dense path


def backward(dout2d, x2d, wg, wu, wd, bg, bu, bd, packed: TwellPacked, up_val, l1_scale, *,
             layer: Optional[int] = None) -> reference.Grads:
    """Gradients of ``loss + l1_scale · L1``, on the path the forward took (``layer``: the
    forward's, when known; a layer compiled for CUDA graphs caches nothing per weight)."""
    key = packed.count.data_ptr()
    forward_graph = None if cuda_graphs.capturing() else call_replay.training_forward(packed.count, x2d)
    if forward_graph is not None:
        return _replayed_sparse_backward(forward_graph, dout2d, x2d, wg, wu, wd, bg, bu, bd, l1_scale, layer)
    if DENSE_FORWARDS.get(key, False) or x2d.dtype == torch.float64:
        # The popped activations go straight in: no reference here outlives their last use there.
        return dense_backward(dout2d, x2d, wg, wu, wd, bg, bu, bd, l1_scale, take_saved(key, dense=True))
    return sparse_backward(dout2d, x2d, wg, wu, wd, bg, bu, bd, packed, up_val, l1_scale, layer=layer)


def _replayed_sparse_backward(forward_graph, dout2d, x2d, wg, wu, wd, bg, bu, bd, l1_scale, layer) -> reference.Grads:
    """The backward of a sparse training forward replayed from a graph, through ``call_replay``:
    it reads that graph's TwELL buffers and per-weight prep, and its copies of the weights where it
    copies them in (the values the forward copied from these weights)."""
    res, prep = forward_graph.result
    take_saved(res.packed.count.data_ptr(), dense=False)  # the hand-off of that prep: dropped, it is read here
    gemm = dense_wgrad_gemm(layer, x2d)
    if forward_graph.weights is not None:
        wg, wu, wd, bg, bu, bd = forward_graph.weights
    key = (gemm, dout2d.dtype, l1_scale.dtype, *(None if w is None else w.data_ptr() for w in (wg, wu, wd, bg, bu, bd)))
    return call_replay.backward(forward_graph, key, dout2d, x2d, l1_scale, lambda dout, x, scale: sparse_backward(
        dout, x, wg, wu, wd, bg, bu, bd, res.packed, res.up_val, scale, layer=layer, prep=prep, gemm=gemm))
