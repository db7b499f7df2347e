"""A rewritten graph serves only the modules whose FFNs it was rewritten for.

Dynamo reuses a compiled graph for every call that passes its guards, and it guards a module by
its type and attributes, not by its identity (modules are inlined, their parameters are graph
inputs). So identical decoder blocks compiled one by one (``block.compile()``, torchtitan's
habit), or reached through a graph break, share the graph compiled for the first block. A
rewritten graph carries its FFNs' layers: their ids (telemetry, dispatch), their live L1
coefficients and their model's L1 factor. Served to another block, the L1 term would be counted
under the first block's layer, so the model's mean over layers would become a sum.

``specialize`` adds an ``ID_MATCH`` guard on the frame-local module that each rewritten FFN's
weights are read from (``L['self']`` for a block's forward). Dynamo then compiles each block
once; its recompile limit counts entries per ID-matched frame local (``cache_size.py``), so one
entry per block is not a recompilation.
"""

from __future__ import annotations

from typing import Iterable

from torch import fx, nn

from .module_paths import real_tensor


def specialize(weights: Iterable[fx.Node]) -> bool:
    """Guard the graph being compiled on the identity of the frame-local modules that own
    ``weights`` (the rewritten FFNs' weight placeholders). False when some weight has no such
    owner (a compiled function handed the weights as tensors), or outside a Dynamo trace."""
    try:
        from torch._dynamo.guards import GuardBuilder
        from torch._dynamo.source import LocalSource
        from torch._dynamo.symbolic_convert import InstructionTranslator
        from torch._guards import TracingContext

        context = TracingContext.try_get()
        tx = InstructionTranslator.current_tx()
    except (ImportError, AttributeError):  # not inside a Dynamo trace (or an unknown torch layout)
        return False
    if context is None or tx is None:
        return False
    wanted = {id(t) for t in (real_tensor(node) for node in weights) if t is not None}
    owners = set()
    for name, value in tx.f_locals.items():
        if isinstance(value, nn.Module):
            owned = wanted & {id(p) for p in value.parameters()}
            if owned:
                owners.add(name)
                wanted -= owned
    for name in sorted(owners):
        # A local, not the weights' own sources: those may run through globals (a hook that
        # looked the module up), and only ID-matched locals keep the recompile limit per module.
        context.guards_context.dynamo_guards.add(LocalSource(name).make_guard(GuardBuilder.ID_MATCH))
    return not wanted
