"""The FFN rewrite as an Inductor ``pre_grad_custom_pass`` (the ``TWELL=1`` compile route)."""

from __future__ import annotations

import itertools

import torch
from torch import fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from .announcement import announce
from .cache_salt import source_hash
from .options import TwellOptions
from .rewrite_ffn import rewrite_ffns

_ids = itertools.count()
REWRITTEN_META = "twell_rewritten"


class TwellPreGradPass(CustomGraphPass):
    """Rewrite FFNs on the torch-level graph Inductor receives; ``uuid`` salts its caches."""

    def __init__(self, options: TwellOptions, inner=None):
        self.options = options
        self.inner = inner

    def __call__(self, graph: fx.Graph) -> None:
        if self.inner is not None:
            self.inner(graph)
        gm = graph.owning_module
        if gm is None or gm.meta.get(REWRITTEN_META):
            return  # already rewritten by backend="twell"
        gm.meta[REWRITTEN_META] = True
        # Inductor's config, mode patches included, is in force while its passes run
        rewritten, skipped = rewrite_ffns(gm, self.options, graph_name=f"inductor{next(_ids)}",
                                          cuda_graphs=bool(torch._inductor.config.triton.cudagraphs))
        announce(rewritten, skipped)  # TWELL=1's line on stderr, once per model

    def uuid(self):
        inner = self.inner.uuid() if hasattr(self.inner, "uuid") else repr(self.inner)
        return f"twell-pre-grad-{source_hash()}-{self.options}-{inner}"
