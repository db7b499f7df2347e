"""FFNs stay whole under DDP's graph splitting: rewrite them before DDPOptimizer cuts the graph.

Root cause: under ``DistributedDataParallel``, ``torch.compile`` (with the default
``torch._dynamo.config.optimize_ddp``) hands the whole Dynamo graph to DDPOptimizer, which cuts
it at gradient-bucket boundaries (~25 MB of parameters) so that each bucket's all-reduce overlaps
the rest of the backward, and only then calls the backend on each piece. A cut usually falls
inside an FFN (one 2048 × 5632 bf16 weight is 23 MB), and no piece holds a whole FFN.

The remedy is to rewrite before the cut: this wraps ``DDPOptimizer.compile_fn`` so that, when the
backend it will call is twell's, the FFNs of the whole graph are rewritten first. Each becomes one
``twell::ffn_train`` node holding all three weights, which DDPOptimizer puts into one bucket, so
no cut can fall inside it. The pieces then reach the backend already rewritten.

Installed by ``twell_compile.backend`` when it is imported (``torch.compile(backend="twell")``
looks the backend up before it compiles anything), which hands in its backend and its graph
preparation; idempotent; for any other backend, and if DDPOptimizer's signature is not the one
expected, the original runs unchanged.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

_WRAPPED = "_twell_ddp_wrapped"


def install(backend: Callable, prepare_graph: Callable) -> None:
    """Wrap ``DDPOptimizer.compile_fn``: when the backend it calls is ``backend``, the whole graph
    goes through ``prepare_graph(gm, mode, options)`` before DDPOptimizer cuts it."""
    try:
        from torch._dynamo.backends.distributed import DDPOptimizer
    except ImportError:  # a torch build without distributed
        return
    original = DDPOptimizer.compile_fn
    if getattr(original, _WRAPPED, False):
        return

    @functools.wraps(original)
    def compile_fn(self, gm, example_inputs, **compiler_configs):
        found = backend_call(self.backend_compile_fn, backend)
        if found is not None:
            prepare_graph(gm, *found)  # the pieces are compiled without a dense variant
        return original(self, gm, example_inputs, **compiler_configs)

    setattr(compile_fn, _WRAPPED, True)
    DDPOptimizer.compile_fn = compile_fn


def backend_call(fn: Any, backend: Callable) -> Optional[tuple[Optional[str], Optional[dict]]]:
    """``(mode, options)`` if ``fn`` is ``backend`` as ``torch.compile`` wraps it, else None."""
    for _ in range(8):  # Dynamo's debug and callback wrappers
        if fn is backend:
            return None, None
        inner = getattr(fn, "compiler_fn", None)
        if inner is backend:  # torch's _TorchCompileWrapper: backend="twell", mode=, options=
            kwargs = getattr(fn, "kwargs", {}) or {}
            return kwargs.get("mode"), kwargs.get("options")
        nxt = getattr(fn, "_torchdynamo_orig_backend", None)
        if nxt is None or nxt is fn:
            return None
        fn = nxt
    return None
