"""The sparse path's per-weight work, cached while the weights are unchanged (``WeightPrep``)."""

from __future__ import annotations

import weakref
from typing import Optional

import torch

from twell_compile.kernels import weight_prep

from . import cuda_graphs


def state_key(t: torch.Tensor) -> Optional[tuple]:
    """What identifies a weight's contents between calls: its in-place version counter, storage
    pointer, shape and dtype (an optimizer step bumps the version). None for inference-mode
    tensors, which have no version counter: never cache on them."""
    try:
        return (t._version, t.data_ptr(), tuple(t.shape), t.dtype)
    except RuntimeError:
        return None


# Layers whose weights are gathered before each use and freed after it (FSDP2's unsharded
# parameters). A cached Wdᵀ would outlive the reshard, a full copy of each down weight that
# sharding was meant to save, so nothing is cached for them: each direction makes its own.
GATHERED_WEIGHT_LAYERS: set = set()


def mark_gathered_weight_layers(layers) -> None:
    """Layers whose weights are gathered for each call, such as FSDP2's (called by the backend)."""
    GATHERED_WEIGHT_LAYERS.update(layers)


class WeightPrep:
    """The per-weight work, made by one launch (``weight_prep``): the finiteness guard's bounds
    (``kernels.reference``, "Exactness guard") for ``sparse_ffn(guard_bound=...)`` and
    ``flag_rows``, and ``Wdᵀ`` rows for the sparse kernels (which read columns of Wd as rows).

    Made again after every change of a weight (each optimizer step bumps its in-place version
    counter), on every call under CUDA-graph capture (replays then see the weights of their own
    step), for inference-mode tensors (no version counter), where nothing can notice a change,
    and with ``keep=False`` (layers compiled for CUDA graphs, whose warm-up runs in the graphs'
    memory pool, where a kept tensor is an error). One entry per down weight, as its ``Wdᵀ`` copy
    is as large as the weight: keyed by the tensor itself and the state (``state_key``) of all
    six tensors, and freed with the weight.
    """

    # id(wd) -> (weakref to wd, the six tensors' state keys, the prep)
    cache: "dict[int, tuple]" = {}

    @classmethod
    def get(cls, wg, wu, wd, bg, bu, bd, *, keep: bool = True, layer: Optional[int] = None):
        """``(forward bound, backward bound, wd_rows)`` (``weight_prep``); never cached for a
        ``layer`` whose weights are gathered per call (``GATHERED_WEIGHT_LAYERS``)."""
        tensors = (wg, wu, wd, bg, bu, bd)
        states = tuple(None if t is None else state_key(t) for t in tensors)
        cachable = (keep and layer not in GATHERED_WEIGHT_LAYERS and not cuda_graphs.capturing()
                    and all(t is None or k is not None for t, k in zip(tensors, states)))
        key = id(wd)
        if cachable:
            hit = cls.cache.get(key)
            if hit is not None and hit[0]() is wd and hit[1] == states:
                return hit[2]
        prep = weight_prep(wg, wu, wd, bg, bu, bd, reuse_tickets=keep, down_rows=True)
        if cachable:
            cls.cache[key] = (weakref.ref(wd, lambda _, k=key: cls.cache.pop(k, None)), states, prep)
        return prep
