"""``twell::l1_snapshot``: the L1 coefficient a forward hands its backward.

A training forward passes its backward a copy of the layer's live coefficient, taken when the
forward runs, so that ``set_l1_coeff`` (or the density controller) between a forward and its
backward applies from the next forward and never to the backward in flight. Written as
``clone`` in the graph, the copy is not safe under Inductor: its partitioner recomputes cheap
ops in the backward instead of saving them, and a ``clone`` of a graph input recomputed there
reads the value written since. A custom op is never recomputed, so its output is saved.
"""

from __future__ import annotations

import torch
from torch import Tensor


@torch.library.custom_op("twell::l1_snapshot", mutates_args=())
def l1_snapshot(coefficient: Tensor) -> Tensor:
    """A copy of ``coefficient`` (a 0-d float32 tensor) that later writes to it do not change.

    Example::

        >>> live = torch.tensor(2e-5)
        >>> snapshot = torch.ops.twell.l1_snapshot(live)
    """
    return coefficient.clone()


@l1_snapshot.register_fake
def _(coefficient):
    return torch.empty_like(coefficient)
