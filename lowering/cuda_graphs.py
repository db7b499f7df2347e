"""What the CUDA ops know of CUDA graphs: whether a capture is underway, and which layers run under
CUDA graphs.

A capture records the kernels a call launches and replays them for good: host-side decisions
(the dispatch policy, the per-weight cache, the forward→backward hand-off) must not depend on
anything a replay would not redo. Layers compiled to run under CUDA graphs (Inductor's cudagraph
trees, e.g. ``mode="reduce-overhead"``) are marked by the backend at compile time
(``mark_cuda_graph_layers``). Their warm-up runs eagerly in the graphs' memory pool, where a
tensor kept after the op returns is an error ("tensors in the cudagraph pool not tracked as
outputs"), so the ops keep nothing per weight or per forward for them.
"""

from __future__ import annotations

import functools

import torch

# The layers compiled to run under CUDA graphs. Read as ``cuda_graphs.CUDA_GRAPH_LAYERS`` at call
# time (never bound by name elsewhere), so that replacing the set reaches every reader.
CUDA_GRAPH_LAYERS: set = set()


def mark_cuda_graph_layers(layers) -> None:
    """Layers whose graph Inductor will run under CUDA graphs (called by the backend)."""
    CUDA_GRAPH_LAYERS.update(layers)


@functools.lru_cache(maxsize=None)
def cuda_available() -> bool:
    return torch.cuda.is_available()  # an NVML/environment check: ~2 µs, 4+ times per call


def capturing() -> bool:
    """Whether the current CUDA stream is being captured into a graph."""
    return cuda_available() and torch.cuda.is_current_stream_capturing()
