"""Replace matched FFNs in an FX graph by TwELL op calls.

One orchestrating function, ``rewrite_ffns``, runs in this order:

1. match (``match_ffn.find_ffns``): read-only, so a failure leaves the graph untouched;
2. strict check: with ``strict=True`` any skipped pattern raises before the graph is edited;
3. rewrite each match: casts first (autocast), then the op call, then the uses are moved;
4. dead-node removal, lint and recompile; the report is recorded last, once the graph is valid.
"""

from __future__ import annotations

import operator
from typing import Optional

import torch
from torch import fx

from . import reporting
from .l1 import coefficient_tensor
from .lowering import cuda_impl
from .match_ffn import FfnMatch, _val, find_ffns, where
from .options import TwellOptions
from .reporting import Rewritten, Skipped

# Importing lowering registers torch.ops.twell.*.
from . import lowering  # noqa: F401  (registers the ops)


class TwellRewriteError(RuntimeError):
    """Raised with ``strict=True`` when an FFN-like pattern cannot be rewritten."""


def rewrite_ffns(gm: fx.GraphModule, options: TwellOptions, graph_name: str = "", *,
                 cuda_graphs: bool = False) -> tuple[list[Rewritten], list[Skipped]]:
    """Rewrite every FFN of ``gm`` in place; returns what was rewritten and what was skipped.

    ``cuda_graphs``: the inner compiler runs this graph under CUDA graphs (cudagraph trees), whose
    memory rules the ops then follow (``lowering.cuda_impl.mark_cuda_graph_layers``)."""
    matches, skipped = find_ffns(gm)
    skipped = [Skipped(s.where, s.reason, s.detail, graph_name) for s in skipped]
    if options.strict and skipped:
        reporting.record([], skipped)
        details = "\n".join(f"  - {s}" for s in skipped)
        raise TwellRewriteError(f"twell (strict=True): {len(skipped)} FFN-like pattern(s) cannot be rewritten:\n{details}")
    matches = _non_overlapping(matches)
    fake_mode = _fake_mode(gm)
    rewritten = []
    n_layers = len(matches)  # the L1 is a mean over the layers rewritten in this graph
    replaced: dict[fx.Node, fx.Node] = {}  # down-projection output → op output, for chained FFNs
    for m in matches:
        rewritten.append(_rewrite_one(gm, m, options, n_layers, fake_mode, graph_name, replaced))
    if matches:
        gm.graph.lint()
        gm.recompile()
    if cuda_graphs:
        cuda_impl.mark_cuda_graph_layers(r.layer for r in rewritten)
    reporting.record(rewritten, skipped)
    return rewritten, skipped


def _non_overlapping(matches: list[FfnMatch]) -> list[FfnMatch]:
    """Matches in graph order whose nodes no earlier match uses (``Linear, ReLU, Linear, ReLU,
    Linear`` holds two overlapping candidates; the first one wins)."""
    taken: set[fx.Node] = set()
    kept = []
    for m in matches:
        nodes = set(m.nodes_to_remove())
        if nodes & taken:
            continue
        taken |= nodes
        kept.append(m)
    return kept


def _rewrite_one(gm: fx.GraphModule, m: FfnMatch, options: TwellOptions, n_layers: int, fake_mode, graph_name: str, replaced: dict) -> Rewritten:
    graph = gm.graph
    layer = reporting.new_layer_id()
    lowering.telemetry.ensure(layer, _val(m.x).device)
    dtype = m.compute_dtype
    with graph.inserting_before(m.down.out):

        def cast(node: Optional[fx.Node]) -> Optional[fx.Node]:
            if node is None:
                return None
            node = replaced.get(node, node)  # the input may be an FFN rewritten just before
            # Under autocast the projections ran in `dtype`; make that explicit for the op.
            if _val(node).dtype == dtype:
                return node
            return _with_meta(graph.call_method("to", (node, dtype)), fake_mode)

        args = (
            cast(m.x),
            cast(m.gate.weight) if m.gate else None,
            cast(m.up.weight),
            cast(m.down.weight),
            cast(m.gate.bias) if m.gate else None,
            cast(m.up.bias),
            cast(m.down.bias),
        )
        if m.training:
            coeff = _coefficient_node(gm, _val(m.x).device, options.l1_coeff, fake_mode)
            call = _with_meta(graph.call_function(torch.ops.twell.ffn_train.default, (*args, coeff, n_layers, layer)), fake_mode)
            out = _with_meta(graph.call_function(operator.getitem, (call, 0)), fake_mode)
            op_name = "twell::ffn_train"
        else:
            out = _with_meta(graph.call_function(torch.ops.twell.ffn.default, (*args, layer)), fake_mode)
            op_name = "twell::ffn"
    out.meta.setdefault("nn_module_stack", m.down.out.meta.get("nn_module_stack", {}))
    out.meta.setdefault("stack_trace", m.down.out.meta.get("stack_trace"))
    loc = where(m.down.out)
    m.down.out.replace_all_uses_with(out)
    replaced[m.down.out] = out
    for node in m.nodes_to_remove():
        if not node.users:
            graph.erase_node(node)
    biases = [name for name, b in (("gate", m.gate.bias if m.gate else None), ("up", m.up.bias), ("down", m.down.bias)) if b is not None]
    return Rewritten(layer, loc, m.kind, ",".join(biases) or "none", str(dtype).replace("torch.", ""), op_name, graph_name)


def _coefficient_node(gm: fx.GraphModule, device: torch.device, value: float, fake_mode) -> fx.Node:
    """A ``get_attr`` of this graph's live L1 coefficient buffer on ``device`` (one per device)."""
    name = "_twell_l1_coeff_" + str(device).replace(":", "_")
    if not hasattr(gm, name):
        # A registered buffer is lifted to a graph input by AOTAutograd: passed by reference, never folded.
        gm.register_buffer(name, coefficient_tensor(value, device))
        sources = getattr(gm, "_param_name_to_source", None)
        if isinstance(sources, dict):  # Dynamo graphs: AOTAutograd asserts every lifted buffer has a source
            from torch._dynamo.source import ConstantSource

            sources[name] = ConstantSource(f"{name}_{id(gm)}")
    for node in gm.graph.nodes:
        if node.op == "get_attr" and node.target == name:
            return node
    first = next(n for n in gm.graph.nodes if n.op != "placeholder")
    with gm.graph.inserting_before(first):
        node = gm.graph.get_attr(name)
    if fake_mode is not None:
        node.meta["example_value"] = fake_mode.from_tensor(getattr(gm, name))
    return node


def _fake_mode(gm: fx.GraphModule):
    """The fake mode the nodes' example values belong to (not the ambient tracing context's)."""
    for n in gm.graph.nodes:
        mode = getattr(_val(n), "fake_mode", None)
        if mode is not None:
            return mode
    return None


def _with_meta(node: fx.Node, fake_mode) -> fx.Node:
    """Fill ``example_value`` by running the node on its inputs' fake values (shape arithmetic only)."""
    if fake_mode is None:
        return node
    try:
        args = fx.node.map_arg(node.args, _val)
        if any(isinstance(a, fx.Node) and _val(a) is None for a in node.all_input_nodes):
            return node  # an input without a value: leave this node's meta empty
        with fake_mode:
            if node.op == "call_method":
                value = getattr(args[0], node.target)(*args[1:])
            else:
                value = node.target(*args)
        node.meta["example_value"] = value
    except Exception:  # noqa: BLE001 - see above
        pass
    return node
