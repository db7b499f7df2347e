"""What a CUDA training forward hands its backward: which path it took, and work not to redo.

Keys are the forward's ``count`` pointer: ``count`` is saved for backward, so no other forward
can reuse that memory before this one's backward runs, and every training forward overwrites its
key (a stale entry can never be read). Exactness never depends on this registry: a dense forward
marks every tile as overflowed, which the sparse backward computes densely, and a missing
hand-off only means redoing its work.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Optional

import torch

from . import cuda_graphs

# count pointer -> whether that forward took the dense path
DENSE_FORWARDS: "OrderedDict[int, bool]" = OrderedDict()
DENSE_FORWARDS_MAX = 4096
# A training forward's hand-off to its backward, which then skips redoing the work:
# * a dense forward's relu(gate), up and h (what dense autograd saves): two GEMMs;
# * a sparse forward's per-weight prep (``weight_cache.WeightPrep``), under CUDA-graph capture
#   only, where nothing is cached per weight (eagerly the cache serves the backward): one launch.
# Popped by the backward (``take_saved``); bounded, and an evicted or missing entry only means
# redoing it (exact). Not kept for layers compiled for CUDA graphs (``cuda_graphs``), nor under
# saved-tensor hooks (activation checkpointing, offloading), which exist to control what is saved.
# Values: (tensors, whether the forward was dense, whether a CUDA-graph capture recorded them).
HANDOFF: "OrderedDict[int, tuple[tuple, bool, bool]]" = OrderedDict()
HANDOFF_MAX = 64


def remember(count: torch.Tensor, dense: bool, saved: Optional[tuple] = None, layer: Optional[int] = None) -> None:
    """Record a training forward's path under its ``count`` pointer, and its hand-off ``saved``
    (if any, and if ``layer`` may keep one)."""
    key = count.data_ptr()
    DENSE_FORWARDS[key] = dense
    DENSE_FORWARDS.move_to_end(key)
    while len(DENSE_FORWARDS) > DENSE_FORWARDS_MAX:
        DENSE_FORWARDS.popitem(last=False)
    HANDOFF.pop(key, None)
    if saved is not None and layer not in cuda_graphs.CUDA_GRAPH_LAYERS and not saved_tensor_hooks_active():
        HANDOFF[key] = (saved, dense, cuda_graphs.capturing())
        while len(HANDOFF) > HANDOFF_MAX:
            HANDOFF.popitem(last=False)


def take_saved(key: int, *, dense: bool) -> Optional[tuple]:
    """A forward's hand-off, popped; None if there is none to use. A backward being captured takes
    only what a capture recorded (in a graph's memory pool, rewritten by each replay): an eager
    forward's tensors would be freed after this use while the graph kept reading their memory on
    every replay. ``dense``: the path the backward takes, which must be the forward's."""
    entry = HANDOFF.pop(key, None)
    if entry is None or entry[1] != dense or (cuda_graphs.capturing() and not entry[2]):
        return None
    return entry[0]


def saved_tensor_hooks_active() -> bool:
    """Whether saved-tensor hooks are active (True when torch cannot say: then keep nothing)."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is None:
        return True  # cannot tell: keep nothing
    return top(False) is not None
