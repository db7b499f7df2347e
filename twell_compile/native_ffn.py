"""The dense variant of a rewritten graph: each FFN stays the model's own code, for Inductor to
compile and fuse, with the L1 gradient and twell's counters added (``variants.py`` runs it while
its layers are dense).

Per FFN, between ``h`` and the down projection, one call of ``dense_hidden``:

* its value is ``h`` itself; its backward adds ``l1_coeff · l1_factor / T · sign(h)`` to ``dh``
  (an ``autograd.Function``, which AOTAutograd traces into the backward graph, so Inductor fuses
  the term into the element-wise kernels around it): the gradient of the same L1 term the TwELL
  ops inject (docs/architecture.md, "The L1 regularizer"), with the same coefficient snapshot and
  live factor;
* it writes the layer's counters into its telemetry buffer, as the TwELL ops' kernels do: the
  call, its tokens, the active entries of ``act(gate)``, the path (dense) and, in training,
  ``(1/T) Σ|h|``: two full reductions over ``[T, H]``, which Inductor fuses with the activation.
  Left out, as too costly for every step of a dense layer: the rows that would overflow a TwELL
  tile (a TwELL trial measures their cost anyway). With them, and with which neurons fired read
  from every token, the counters cost this variant ~5% of a step of a 768-wide 12-layer model on
  an H200;
* in training, which neurons fired, for ``stats()``'s dead neurons, into the same state the TwELL
  ops update (``telemetry.fired_state``): sampled, as the ops sample every 8th eager call, but
  here one token in ``FIRED_EVERY`` of every call (a graph cannot skip calls without a host
  decision), at an offset that turns with the call count so every position is read in turn. The
  gather, a column ``any`` and an ``[H]`` update read 1/8 of ``act``; its cost on a GPU was not
  measured.

A SiLU/GELU gate converted by ``relu_gate`` becomes ``relu`` here too, so both variants compute
the same function.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import fx

from .lowering import telemetry
from .match_ffn import FfnMatch, example_value


# One token in 8 per call: as many sampled tokens per step as the TwELL ops' every 8th call.
FIRED_EVERY = 8


class _InjectL1(torch.autograd.Function):
    """Identity forward; the backward adds the L1 term's gradient to ``dh``."""

    @staticmethod
    def forward(ctx, h, coeff, factor):
        ctx.save_for_backward(h, coeff, factor)
        return h.view_as(h)

    @staticmethod
    def backward(ctx, dh):
        h, coeff, factor = ctx.saved_tensors
        tokens = h.numel() // h.shape[-1]
        scale = (coeff * factor / tokens).to(dh.dtype)
        return dh + scale * torch.sign(h), None, None


def dense_hidden(h, act, record, coeff: Optional[torch.Tensor], factor: Optional[torch.Tensor],
                 last: Optional[torch.Tensor] = None, seen: Optional[torch.Tensor] = None):
    """``h``, with the L1 backward (when ``coeff`` is given) and the call's counters written; in
    training, with ``last``/``seen`` (the layer's ``telemetry.fired_state``), the sampled firings."""
    with torch.no_grad():
        if coeff is not None and last is not None:
            _record_fired(act.detach(), record, last, seen)  # reads the call count before it moves
        _write_counters(h.detach(), act.detach(), record, coeff is not None)
    if coeff is None:
        return h
    return _InjectL1.apply(h, coeff, factor)


def _record_fired(act, record, last, seen) -> None:
    """``telemetry.record_fired`` on a sample of the call's tokens, as graph ops: rows
    ``offset, offset + FIRED_EVERY, ...`` of ``act`` [T, H], with ``offset`` the call count mod
    ``FIRED_EVERY`` (one row, turning, when T < FIRED_EVERY)."""
    rows = act.reshape(-1, act.shape[-1])
    tokens = rows.shape[0]
    sampled = max(1, tokens // FIRED_EVERY)
    offset = torch.remainder(record[0], FIRED_EVERY).long()
    idx = torch.remainder(torch.arange(sampled, device=rows.device) * FIRED_EVERY + offset, tokens)
    fired = (rows.index_select(0, idx) > 0).any(dim=0)  # [H]
    now = seen + sampled
    last.copy_(torch.where(fired, now, last))
    seen.copy_(now)


def _write_counters(h, act, record, training: bool) -> None:
    tokens = h.numel() // h.shape[-1]
    t = torch.full((), tokens, dtype=torch.float64, device=h.device)
    active = (act > 0).sum(dtype=torch.float64)
    l1 = h.abs().sum(dtype=torch.float64) / t if training else record[5]
    zero = torch.zeros_like(t)
    record.copy_(torch.stack([record[0] + 1, t, active, zero, zero, l1]))


def rewrite_dense(gm: fx.GraphModule, match: FfnMatch, layer_id: int, coeff: Optional[fx.Node], factor: Optional[fx.Node],
                  tensor_node, fake_mode) -> None:
    """Insert ``dense_hidden`` into ``match``'s FFN in ``gm`` (a copy of the graph the TwELL rewrite
    got), and turn a converted gate into ReLU. ``tensor_node(name, tensor)`` registers a tensor as
    a graph buffer and returns its node."""
    graph = gm.graph
    device = example_value(match.x).device
    if match.gate_activation != "ReLU":  # relu_gate: the same function as the TwELL op computes
        pre = match.act.args[0]
        with graph.inserting_after(match.act):
            relu = graph.call_function(F.relu, (pre,))
        relu.meta.update(match.act.meta)
        match.act.replace_all_uses_with(relu)
        graph.erase_node(match.act)
        match.act = relu
        if match.gate is None:
            match.hidden = relu
    record = tensor_node(f"_twell_record_{layer_id}", telemetry.buffer(layer_id, device))
    fired = (None, None)
    if coeff is not None:  # made at rewrite time (``telemetry.ensure``), never in a CUDA-graph warm-up
        last, seen = telemetry.fired_state(layer_id, device, example_value(match.up.weight).shape[0])
        fired = (tensor_node(f"_twell_fired_last_{layer_id}", last), tensor_node(f"_twell_fired_seen_{layer_id}", seen))
    down_input = match.hidden
    with graph.inserting_after(down_input):
        node = graph.call_function(dense_hidden, (down_input, match.act, record, coeff, factor, *fired))
    node.meta["example_value"] = example_value(down_input)
    for user in list(down_input.users):
        if user is not node:
            user.replace_input_with(down_input, node)

