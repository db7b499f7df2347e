"""The ``twell`` torch.compile backend: rewrite FFNs on the Dynamo graph, then compile the rest.

Registered only through the ``torch_dynamo_backends`` entry point (pyproject.toml); this module
must not register itself, or ``lookup_backend`` would register the name twice.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any, Callable, Optional

import torch
from torch import fx

from . import ddp_rewrite, loss_scaling_hooks
from .cache_salt import salted_config_patches
from .module_paths import calling_model
from .options import TwellOptions
from .pre_grad import REWRITTEN_META
from .rewrite_ffn import rewrite_ffns

_graph_ids = itertools.count()
_checkpointed_models: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()


def twell_backend(gm: fx.GraphModule, example_inputs: list, *, mode: Optional[str] = None, options: Optional[dict[str, Any]] = None) -> Callable:
    """``torch.compile(model, backend="twell", options={...})``.

    The FFNs are matched on the torch-level graph, before AOTAutograd, so their autograd is the
    TwELL ops' own (with the L1 injection); the inner compiler then compiles the whole graph.
    ``mode`` comes from ``torch.compile(mode=...)`` or, with other options, ``options["mode"]``.
    """
    opts, mode = prepare_graph(gm, mode, options)
    return compile_inner(gm, example_inputs, opts.inner, mode)


def prepare_graph(gm: fx.GraphModule, mode: Optional[str], options: Optional[dict[str, Any]]):
    """Resolve the options and rewrite ``gm``'s FFNs, once (a graph that DDPOptimizer split after
    ``ddp_rewrite`` rewrote it reaches the backend again, piece by piece). Returns the options and
    the compile mode."""
    if options is None:
        # A bare torch.compile under TWELL=1 reaches here through set_default_backend, with no
        # options: the TWELL_* variables apply.
        from .activate import active_options

        opts = active_options() or TwellOptions()
    else:
        opts = TwellOptions.from_dict(options)
    if mode is None:
        mode = opts.mode
    if not gm.meta.get(REWRITTEN_META):
        _patch_if_checkpointed(opts)
        rewrite_ffns(gm, opts, graph_name=f"graph{next(_graph_ids)}",
                     cuda_graphs=opts.inner == "inductor" and uses_cuda_graphs(mode))
        gm.meta[REWRITTEN_META] = True  # the TWELL=1 pre-grad pass and the pieces must not rewrite it again
    return opts, mode


def _patch_if_checkpointed(opts: TwellOptions) -> None:
    """Activation checkpointing makes Dynamo break the graph at each checkpointed block (HF's
    ``gradient_checkpointing_enable()``), which then runs eagerly, out of the backend's sight: so
    the model's FFN modules are patched (``patch``), which runs the TwELL op inside those blocks,
    L1 term included, and recomputes it in the backward as checkpointing does."""
    model = calling_model()
    if model is None or model in _checkpointed_models or not getattr(model, "is_gradient_checkpointing", False):
        return
    _checkpointed_models.add(model)
    from .patch_ffn import patch

    from .activate import patch_options

    with torch._subclasses.fake_tensor.unset_fake_temporarily():
        patch(model, **patch_options(opts))


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


# Before the first compile: a training loop may look up GradScaler.scale before the call that
# compiles (``scaler.scale(model(x))`` fetches the method first).
ddp_rewrite.install()
loss_scaling_hooks.install()
