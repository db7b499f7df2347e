"""The ``twell`` torch.compile backend: rewrite FFNs on the Dynamo graph, then compile the rest.

Registered only through the ``torch_dynamo_backends`` entry point (pyproject.toml); this module
must not register itself, or ``lookup_backend`` would register the name twice.
"""

from __future__ import annotations

import itertools
import warnings
import weakref
from typing import Any, Callable, Optional

import torch
from torch import fx

from . import ddp_rewrite, layers, loss_scaling_hooks, variants
from .announcement import announce
from .cache_salt import salted_config_patches
from .module_paths import calling_model
from .options import TwellOptions
from .pre_grad import REWRITTEN_META
from .regions import copy_graph_module
from .rewrite_ffn import add_dense_counters, rewrite_ffns

_graph_ids = itertools.count()
_checkpointed_models: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()


def twell_backend(gm: fx.GraphModule, example_inputs: list, *, mode: Optional[str] = None, options: Optional[dict[str, Any]] = None) -> Callable:
    """``torch.compile(model, backend="twell", options={...})``.

    The FFNs are matched on the torch-level graph, before AOTAutograd, so their autograd is the
    TwELL ops' own (with the L1 injection); the inner compiler then compiles the whole graph.
    ``mode`` comes from ``torch.compile(mode=...)`` or, with other options, ``options["mode"]``.
    """
    dense = copy_graph_module(gm) if _wants_variants(gm, options) else None
    opts, mode, rewritten = prepare_graph(gm, mode, options)
    twell_fn = compile_inner(gm, example_inputs, opts.inner, mode)
    if dense is None or not rewritten or not add_dense_counters(dense, opts, rewritten):
        return twell_fn
    # The dense variant (variants.py): the same graph with the model's own FFN code, for Inductor.
    dense.meta[REWRITTEN_META] = True
    try:
        dense_fn = compile_inner(dense, example_inputs, opts.inner, mode)
    except Exception as exc:  # noqa: BLE001 - the TwELL variant is complete on its own: never fail the compile here
        warnings.warn(f"twell: the dense variant of a graph did not compile ({type(exc).__name__}: {exc}); it runs the "
                      "TwELL ops alone (dense_variant=False hides this)", RuntimeWarning, stacklevel=2)
        return twell_fn
    first = layers.layer(rewritten[0].layer)
    training = any(r.op.startswith("twell::ffn_train") for r in rewritten)
    coordinator = variants.model_variants(first.model, _device(gm), training,
                                          opts.inner == "inductor" and uses_cuda_graphs(mode))
    return variants.GraphVariants(dense_fn, twell_fn, {r.layer: layers.layer(r.layer).hidden for r in rewritten},
                                  coordinator)


# Tests set this to build both variants on the CPU too (where the TwELL ops run the reference).
VARIANTS_ON_CPU = False


def _wants_variants(gm: fx.GraphModule, options: Optional[dict[str, Any]]) -> bool:
    """Whether to build the dense variant too: on CUDA graphs, unless ``dense_variant=False``, and
    not for a graph that is already rewritten."""
    if gm.meta.get(REWRITTEN_META):
        return False
    opts = TwellOptions.from_dict(options) if options is not None else None
    if opts is not None and not opts.dense_variant:
        return False
    if opts is None:
        from .activate import active_options

        env = active_options()
        if env is not None and not env.dense_variant:
            return False
    device = _device(gm)
    return device is not None and (device.type == "cuda" or VARIANTS_ON_CPU)


def _device(gm: fx.GraphModule) -> Optional[torch.device]:
    for node in gm.graph.nodes:
        value = node.meta.get("example_value") if node.op == "placeholder" else None
        if isinstance(value, torch.Tensor):
            return value.device
    return None


def prepare_graph(gm: fx.GraphModule, mode: Optional[str], options: Optional[dict[str, Any]]):
    """Resolve the options and rewrite ``gm``'s FFNs, once (a graph that DDPOptimizer split after
    ``ddp_rewrite`` rewrote it reaches the backend again, piece by piece). Returns the options, the
    compile mode and what was rewritten."""
    if options is None:
        # A bare torch.compile under TWELL=1 reaches here through set_default_backend, with no
        # options: the TWELL_* variables apply.
        from .activate import active_options

        opts = active_options() or TwellOptions()
    else:
        opts = TwellOptions.from_dict(options)
    if mode is None:
        mode = opts.mode
    rewritten = []
    if not gm.meta.get(REWRITTEN_META):
        _patch_if_checkpointed(opts)
        rewritten, skipped = rewrite_ffns(gm, opts, graph_name=f"graph{next(_graph_ids)}",
                                          cuda_graphs=opts.inner == "inductor" and uses_cuda_graphs(mode))
        announce(rewritten, skipped)  # one line on stderr when TWELL=1 routed this compile here
        gm.meta[REWRITTEN_META] = True  # the TWELL=1 pre-grad pass and the pieces must not rewrite it again
    return opts, mode, rewritten


def _patch_if_checkpointed(opts: TwellOptions) -> None:
    """HF's ``gradient_checkpointing_enable()`` checkpoints reentrantly by default, where Dynamo
    breaks the graph at each checkpointed block, which then runs eagerly, out of the backend's
    sight: so the model's FFN modules are patched (``patch``), which runs the TwELL op inside those
    blocks, L1 term included, and recomputes it in the backward as checkpointing does.
    (Non-reentrant checkpoints are traced, and their bodies rewritten: ``regions``.)"""
    model = calling_model()
    if model is None or model in _checkpointed_models or not _hf_checkpointing(model):
        return
    _checkpointed_models.add(model)
    from .patch_ffn import patch

    from .activate import patch_options

    with torch._subclasses.fake_tensor.unset_fake_temporarily():
        patch(model, **patch_options(opts))


def _hf_checkpointing(model: torch.nn.Module) -> bool:
    """Whether a Hugging Face model has gradient checkpointing on: a submodule's
    ``gradient_checkpointing`` flag, which ``gradient_checkpointing_enable()`` sets (read directly:
    the model's ``is_gradient_checkpointing`` property is deprecated in transformers 5)."""
    return any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())


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
ddp_rewrite.install(twell_backend, prepare_graph)
loss_scaling_hooks.install()
