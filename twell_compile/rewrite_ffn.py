"""Replace matched FFNs in an FX graph by TwELL op calls.

One orchestrating function, ``rewrite_ffns``, runs in this order:

1. match (``match_ffn.find_ffns``), in the graph and in its activation-checkpoint bodies
   (``regions``): read-only, so a failure leaves the graph's function untouched;
2. name: the model that called this graph and the FFNs' full paths in it (``module_paths``);
   SiLU/GELU gates are kept only with ``relu_gate``;
3. strict check: with ``strict=True`` any skipped pattern raises before the graph is edited;
4. rewrite each match: register its layer (``layers``: one id, name and L1 factor per model),
   casts first (autocast), then the op call, then the uses are moved;
5. dead-node removal, lint and recompile, and a Dynamo guard that keeps the graph to the modules
   it was rewritten for (``graph_guards``); the report is recorded last, once the graph is valid,
   with a warning if nothing of a model that asked for twell was rewritten.
"""

from __future__ import annotations

import operator
from typing import Optional

import torch
from torch import fx, nn

from . import density_control, graph_guards, layers, lowering, loss_scaling_hooks, native_ffn, reporting
from .lowering import mark_cuda_graph_layers
from .match_ffn import FfnMatch, example_value, find_ffns, where
from .module_paths import ModelIndex, calling_modules, display_name, gathers_weights, real_tensor
from .options import TwellOptions
from .regions import Region, graph_regions
from .reporting import Rewritten, SkipReason, Skipped


class TwellRewriteError(RuntimeError):
    """Raised with ``strict=True`` when an FFN-like pattern cannot be rewritten."""


def rewrite_ffns(gm: fx.GraphModule, options: TwellOptions, graph_name: str = "", *,
                 cuda_graphs: bool = False) -> tuple[list[Rewritten], list[Skipped]]:
    """Rewrite every FFN of ``gm`` in place; returns what was rewritten and what was skipped.

    ``cuda_graphs``: the inner compiler runs this graph under CUDA graphs (cudagraph trees), whose
    memory rules the ops then follow (``lowering.mark_cuda_graph_layers``)."""
    loss_scaling_hooks.install()
    owner = GraphOwner.of_calling_code()
    selected, skipped = [], []
    for region in graph_regions(gm):  # the graph, then its activation-checkpoint bodies
        kept, region_skipped = select_ffns(region.gm, options, owner, graph_name, region.outer)
        selected.append((region, kept))
        skipped += region_skipped
    if options.strict and skipped:
        reporting.record([], skipped)
        details = "\n".join(f"  - {s}" for s in skipped)
        raise TwellRewriteError(f"twell (strict=True): {len(skipped)} FFN-like pattern(s) cannot be rewritten:\n{details}")
    fake_mode = _fake_mode(gm)
    rewritten, weights = [], []
    for region, kept in selected:
        replaced: dict[fx.Node, fx.Node] = {}  # down-projection output → op output, for chained FFNs
        for m in kept:
            rewritten.append(_rewrite_one(region, m, options, owner, fake_mode, graph_name, replaced))
            weights += [region.outer(p.weight) for p in (m.gate, m.up, m.down) if p is not None]
        if kept:
            region.finish()
    if rewritten:
        gm.graph.lint()
        gm.recompile()
        # The graph now carries these FFNs' layers: Dynamo must not reuse it for other modules.
        graph_guards.specialize(weights)
    if cuda_graphs:
        mark_cuda_graph_layers(r.layer for r in rewritten)
    if owner.model is not None and gathers_weights(owner.model):
        lowering.mark_gathered_weight_layers(r.layer for r in rewritten)
    reporting.record(rewritten, skipped)
    if skipped and not rewritten:
        _warn_nothing_rewritten(owner, skipped, graph_name)
    return rewritten, skipped


def select_ffns(gm: fx.GraphModule, options: TwellOptions, owner: "GraphOwner", graph_name: str = "",
                outer=lambda node: node):
    """The FFNs of ``gm`` to rewrite, in graph order, and the FFN-like patterns left alone.
    ``outer`` maps a checkpoint body's placeholders to the Dynamo graph's (``regions``)."""
    matches, found_skips = find_ffns(gm)
    skipped = [Skipped(owner.full(s.where), s.reason, s.detail, graph_name) for s in found_skips]
    kept = []
    for m in matches:
        if m.gate_activation != "ReLU" and not options.relu_gate:
            skipped.append(Skipped(owner.name(m, outer), SkipReason.NOT_RELU, m.gate_activation, graph_name))
        else:
            kept.append(m)
    return _non_overlapping(kept), skipped


def add_dense_counters(gm: fx.GraphModule, options: TwellOptions, rewritten: list[Rewritten]) -> bool:
    """Make ``gm`` (a copy of a graph taken before ``rewrite_ffns`` rewrote it into ``rewritten``)
    the dense variant: each FFN keeps its code, with the same layer's L1 term and counters
    (``native_ffn``). False if its FFNs do not line up with ``rewritten``."""
    kept, _ = select_ffns(gm, options, GraphOwner(None, None))
    if len(kept) != len(rewritten):
        return False
    fake_mode = _fake_mode(gm)
    for m, r in zip(kept, rewritten):
        layer = layers.layer(r.layer)
        device = example_value(m.x).device
        coeff = factor = None
        if m.training:
            coeff = _coefficient_snapshot(gm, layer, device, fake_mode)
            factor = _graph_tensor(gm, f"_twell_l1_factor_{layer.model.index}_{_device_tag(device)}",
                                   layers.factor(layer.model, device), fake_mode)
        native_ffn.rewrite_dense(gm, m, layer.id, coeff, factor, lambda name, t: _graph_tensor(gm, name, t, fake_mode),
                                 fake_mode)
    gm.graph.lint()
    gm.recompile()
    return True


class GraphOwner:
    """The model whose call is compiling a graph, and how to name the graph's FFNs in it."""

    def __init__(self, model: Optional[nn.Module], compiled: Optional[nn.Module]):
        self.model = model
        self.index = ModelIndex(model) if model is not None else None
        # Dynamo's module paths are relative to the module being compiled (a decoder layer, when
        # compiled per layer); its own path in the model completes them.
        prefix = self.index.module_path(compiled) if self.index is not None and compiled is not None else None
        self.prefix = prefix or ""

    @classmethod
    def of_calling_code(cls) -> "GraphOwner":
        return cls(*calling_modules())

    def full(self, relative: str) -> str:
        """A Dynamo-relative module path (``mlp``) as a full one (``model.layers.3.mlp``)."""
        if not self.prefix:
            return relative
        if relative.startswith("File "):  # a frame resumed after a graph break has no module stack
            return f"{self.prefix} ({relative})"
        return self.prefix if relative in ("", "model") else f"{self.prefix}.{relative}"

    def layer_of(self, m: FfnMatch, outer=lambda node: node) -> tuple[Optional[nn.Module], object, str]:
        """``(model, identity, name)`` of a matched FFN: its full path in the model when its down
        weight is one of the model's parameters, else a key unique to its weights."""
        down = real_tensor(outer(m.down.weight))
        path = self.index.ffn_path(down) if self.index is not None else None
        if path is not None:
            return self.model, path, display_name(self.model, path)
        name = self.full(where(m.down.out))
        if down is not None:
            return None, ("tensor", id(down)), name
        return None, ("node", id(m.down.out.graph), m.down.out.name), name

    def name(self, m: FfnMatch, outer=lambda node: node) -> str:
        return self.layer_of(m, outer)[2]


def _warn_nothing_rewritten(owner: GraphOwner, skipped: list[Skipped], graph_name: str) -> None:
    if layers.model_of(owner.model).layers:
        return  # some of the model's FFNs are rewritten: the skips are in the report
    label = type(owner.model).__name__ if owner.model is not None else "the compiled code"
    reporting.warn_unrewritten(label, id(owner.model), skipped, graph_name, stacklevel=4)


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


def _rewrite_one(region: Region, m: FfnMatch, options: TwellOptions, owner: GraphOwner, fake_mode, graph_name: str,
                 replaced: dict) -> Rewritten:
    graph = region.gm.graph
    device = example_value(m.x).device
    model, identity, name = owner.layer_of(m, region.outer)
    hidden = example_value(m.up.weight).shape[0]
    layer = layers.register(model, identity, name, device, hidden=hidden, l1_coeff=options.l1_coeff)
    density_control.control(layer.model, options.target_density, options.l1_coeff, options.l1_coeff_max)
    lowering.telemetry.ensure(layer.id, device, hidden)
    dtype = m.compute_dtype
    with graph.inserting_before(m.down.out):

        def cast(node: Optional[fx.Node]) -> Optional[fx.Node]:
            if node is None:
                return None
            node = replaced.get(node, node)  # the input may be an FFN rewritten just before
            # Under autocast the projections ran in `dtype`; make that explicit for the op.
            if example_value(node).dtype == dtype:
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
        top = region.top  # the L1 tensors live in the Dynamo graph (lifted by AOTAutograd)
        coeff = region.thread(_coefficient_snapshot(top, layer, device, fake_mode))
        factor = region.thread(_graph_tensor(top, f"_twell_l1_factor_{layer.model.index}_{_device_tag(device)}",
                                             layers.factor(layer.model, device), fake_mode))
        with graph.inserting_before(m.down.out):
            call = _with_meta(graph.call_function(torch.ops.twell.ffn_train.default, (*args, coeff, factor, layer.id)),
                              fake_mode)
            out = _with_meta(graph.call_function(operator.getitem, (call, 0)), fake_mode)
        op_name = "twell::ffn_train"
    else:
        with graph.inserting_before(m.down.out):
            out = _with_meta(graph.call_function(torch.ops.twell.ffn.default, (*args, layer.id)), fake_mode)
        op_name = "twell::ffn"
    if m.gate_activation != "ReLU":
        op_name += f" ({m.gate_activation} gate as ReLU)"
    out.meta.setdefault("nn_module_stack", m.down.out.meta.get("nn_module_stack", {}))
    out.meta.setdefault("stack_trace", m.down.out.meta.get("stack_trace"))
    m.down.out.replace_all_uses_with(out)
    replaced[m.down.out] = out
    for node in m.nodes_to_remove():
        if not node.users:
            graph.erase_node(node)
    biases = [role for role, b in (("gate", m.gate.bias if m.gate else None), ("up", m.up.bias), ("down", m.down.bias)) if b is not None]
    return Rewritten(layer.id, name, m.kind, ",".join(biases) or "none", str(dtype).replace("torch.", ""), op_name, graph_name)


def _device_tag(device: torch.device) -> str:
    return str(device).replace(":", "_")


def _coefficient_snapshot(gm: fx.GraphModule, layer: layers.Layer, device: torch.device, fake_mode) -> fx.Node:
    """A snapshot of the layer's live L1 coefficient (``twell::l1_snapshot``), at the top of the
    graph: the value this forward's backward uses, whatever is written into the live tensor
    before it runs (a plain ``clone`` would be recomputed in Inductor's backward)."""
    live = _graph_tensor(gm, f"_twell_l1_coeff_{layer.id}_{_device_tag(device)}", layer.coefficient(device), fake_mode)
    snapshot = torch.ops.twell.l1_snapshot.default
    for user in live.users:
        if user.op == "call_function" and user.target is snapshot:
            return user
    with gm.graph.inserting_after(live):
        return _with_meta(gm.graph.call_function(snapshot, (live,)), fake_mode)


def _graph_tensor(gm: fx.GraphModule, name: str, tensor: torch.Tensor, fake_mode) -> fx.Node:
    """A ``get_attr`` of ``tensor``, registered on ``gm`` as buffer ``name``. AOTAutograd lifts a
    registered buffer to a graph input: passed by reference, so in-place writes reach compiled
    code and CUDA-graph replays, and never folded into a constant."""
    if not hasattr(gm, name):
        gm.register_buffer(name, tensor)
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
        mode = getattr(example_value(n), "fake_mode", None)
        if mode is not None:
            return mode
    return None


def _with_meta(node: fx.Node, fake_mode) -> fx.Node:
    """Fill ``example_value`` by running the node on its inputs' fake values (shape arithmetic only)."""
    if fake_mode is None:
        return node
    try:
        args = fx.node.map_arg(node.args, example_value)
        if any(isinstance(a, fx.Node) and example_value(a) is None for a in node.all_input_nodes):
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
