"""Where FFNs are rewritten in a Dynamo graph: the graph itself, and its activation-checkpoint bodies;
and ``copy_graph_module``, the copy of a graph that the backend and a body's rewrite start from.

``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`` and ``checkpoint_wrapper`` reach
the backend as a ``tag_activation_checkpoint`` higher-order op whose body is a graph of its own,
holding the checkpointed block's FFNs; its operands are the top graph's nodes (the block's input
and parameters). The rewrite edits such a body like the top graph, with two differences, both
here: the body is a copy (the backend's dense variant keeps the original), and the L1 tensors the
ops need come from the top graph, threaded in as new operands. The coefficient's snapshot is thus
taken outside the body, so the checkpoint's recomputation in the backward uses the forward's.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import fx

from .match_ffn import example_value


class Region:
    """A graph to rewrite FFNs in: the Dynamo graph ``top``, or the body of its checkpoint ``hop``."""

    def __init__(self, top: fx.GraphModule, hop: Optional[fx.Node] = None):
        self.top = top
        self.hop = hop
        self.gm = top
        self._outer: dict[fx.Node, fx.Node] = {}
        self._threaded: dict[fx.Node, fx.Node] = {}
        if hop is not None:
            name = hop.args[0].target
            self.gm = copy_graph_module(getattr(top, name))
            setattr(top, name, self.gm)
            inner = [n for n in self.gm.graph.nodes if n.op == "placeholder"]
            self._outer = dict(zip(inner, hop.args[1:]))

    def outer(self, node: fx.Node) -> fx.Node:
        """The top graph's node that a body's placeholder stands for (``node`` itself otherwise)."""
        return self._outer.get(node, node)

    def thread(self, top_node: fx.Node) -> fx.Node:
        """A node of this region that carries ``top_node``'s value: itself in the top graph, else a
        new placeholder of the body, fed by a new operand of the checkpoint."""
        if self.hop is None:
            return top_node
        inner = self._threaded.get(top_node)
        if inner is None:
            last = [n for n in self.gm.graph.nodes if n.op == "placeholder"][-1]
            with self.gm.graph.inserting_after(last):
                inner = self.gm.graph.placeholder(f"twell_{top_node.name}")
            inner.meta["example_value"] = example_value(top_node)
            self.hop.args = (*self.hop.args, top_node)
            self._threaded[top_node] = inner
            self._outer[inner] = top_node
        return inner

    def finish(self) -> None:
        if self.hop is not None:
            self.gm.graph.lint()
            self.gm.recompile()


def graph_regions(gm: fx.GraphModule) -> list[Region]:
    """``gm`` itself, then the body of each of its activation checkpoints."""
    checkpoint = getattr(torch.ops.higher_order, "tag_activation_checkpoint", None)
    hops = [n for n in gm.graph.nodes
            if checkpoint is not None and n.op == "call_function" and n.target is checkpoint
            and n.args and isinstance(n.args[0], fx.Node) and n.args[0].op == "get_attr"]
    return [Region(gm)] + [Region(gm, hop) for hop in hops]


def copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A second GraphModule over a copy of ``gm``'s graph (node meta shared, not deep-copied), with
    the Dynamo attributes AOTAutograd reads."""
    graph = fx.Graph()
    nodes: dict[fx.Node, fx.Node] = {}
    graph.output(graph.graph_copy(gm.graph, nodes))
    for old, new in nodes.items():
        if hasattr(old, "_dynamo_source"):  # AOTAutograd reads each placeholder's Dynamo source
            new._dynamo_source = old._dynamo_source
    copy = fx.GraphModule(gm, graph)
    copy.meta = dict(gm.meta)
    sources = getattr(gm, "_param_name_to_source", None)
    if isinstance(sources, dict):
        copy._param_name_to_source = dict(sources)
    return copy
