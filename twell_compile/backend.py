"""The ``twell`` torch.compile backend: rewrite FFNs on the Dynamo graph, then compile the rest.

Registered only through the ``torch_dynamo_backends`` entry point (pyproject.toml); this module
must not register itself, or ``lookup_backend`` would register the name twice.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Optional

import torch
from torch import fx

from .cache_salt import salted_config_patches
from .options import TwellOptions
from .pre_grad import REWRITTEN_META
from .rewrite_ffn import rewrite_ffns

_graph_ids = itertools.count()


def twell_backend(gm: fx.GraphModule, example_inputs: list, *, mode: Optional[str] = None, options: Optional[dict[str, Any]] = None) -> Callable:
    """``torch.compile(model, backend="twell", options={...})``.

    The FFNs are matched on the torch-level graph, before AOTAutograd, so their autograd is the
    TwELL ops' own (with the L1 injection); the inner compiler then compiles the whole graph.
    ``mode`` comes from ``torch.compile(mode=...)`` or, with other options, ``options["mode"]``.
    """
    if options is None:
        # A bare torch.compile under TWELL=1 reaches here through set_default_backend, with no
        # options: the TWELL_* variables apply.
        from .activate import active_options

        opts = active_options() or TwellOptions()
    else:
        opts = TwellOptions.from_dict(options)
    if mode is None:
        mode = opts.mode
    rewrite_ffns(gm, opts, graph_name=f"graph{next(_graph_ids)}",
                 cuda_graphs=opts.inner == "inductor" and uses_cuda_graphs(mode))
    gm.meta[REWRITTEN_META] = True  # the TWELL=1 pre-grad pass must not rewrite it again
    return compile_inner(gm, example_inputs, opts.inner, mode)


def uses_cuda_graphs(mode: Optional[str]) -> bool:
    """Whether Inductor compiles with CUDA graphs in ``mode`` (``reduce-overhead``, ``max-autotune``)
    or because ``torch._inductor.config.triton.cudagraphs`` is set."""
    from torch._inductor import config, list_mode_options

    patches = dict(list_mode_options(mode or "default", dynamic=None) or {})
    return bool(patches.get("triton.cudagraphs", config.triton.cudagraphs))


def compile_inner(gm: fx.GraphModule, example_inputs: list, inner: str, mode: Optional[str] = None) -> Callable:
    if inner == "eager":
        return gm.forward
    if inner == "aot_eager":
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)
    from torch._inductor import list_mode_options
    from torch._inductor.compile_fx import compile_fx

    patches = dict(list_mode_options(mode or "default", dynamic=None) or {})
    patches.update(salted_config_patches())
    return compile_fx(gm, example_inputs, config_patches=patches)
